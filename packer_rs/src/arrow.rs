//! The Arrow layouts of the rollout↔trainer contract, defined once here: the Sample
//! schema of DESIGN.md §6 (one row per sample, exact round trips, Arrow IPC files) and
//! the packed-row layout of DESIGN.md §5 (five record batches and five counts per row).
//! Python reads both through the bindings (`sample_schema`, `row_schema`, `ROW_PARTS`,
//! `ROW_COUNTS`) and never re-describes them.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{Float32Builder, Int32Builder, ListBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Int32Type, Int64Type, Int8Type};
use arrow_array::{
    Array, ArrayRef, ArrowPrimitiveType, Float32Array, Int32Array, Int64Array, ListArray,
    PrimitiveArray, RecordBatch,
};
use arrow_buffer::OffsetBuffer;
use arrow_ipc::reader::FileReader;
use arrow_ipc::writer::FileWriter;
use arrow_schema::{DataType, Field, Schema, SchemaRef};

use crate::error::{PackError, Result};
use crate::sample::{Sample, TokenLists};
use crate::trie::{PackedRow, TreeRow};

/// Optional columns: sampler top-k ids and log-probs, and the sampling mask.
pub const TOPK_IDS: &str = "sampler_topk_ids";
pub const TOPK_LOGPROBS: &str = "sampler_topk_logprobs";
pub const SAMPLING_MASK: &str = "sampling_mask";

fn list_of(dt: DataType) -> DataType {
    DataType::List(Arc::new(Field::new_list_field(dt, true)))
}

/// The Sample schema; the three optional columns are present when `with_topk`
/// / `with_mask` say so.
pub fn sample_schema(with_topk: bool, with_mask: bool) -> SchemaRef {
    let mut fields = vec![
        Field::new("sample_id", DataType::Int64, false),
        Field::new("group_id", DataType::Int64, false),
        Field::new("prompt_index", DataType::Int64, false),
        Field::new("input_ids", list_of(DataType::Int32), false),
        Field::new("completion_mask", list_of(DataType::Int8), false),
        Field::new("sampler_logprobs", list_of(DataType::Float32), false),
        Field::new("advantage", DataType::Float32, false),
        Field::new("policy_version", DataType::Int32, false),
    ];
    if with_topk {
        fields.push(Field::new(
            TOPK_IDS,
            list_of(list_of(DataType::Int32)),
            true,
        ));
        fields.push(Field::new(
            TOPK_LOGPROBS,
            list_of(list_of(DataType::Float32)),
            true,
        ));
    }
    if with_mask {
        fields.push(Field::new(
            SAMPLING_MASK,
            list_of(list_of(DataType::Int32)),
            true,
        ));
    }
    Arc::new(Schema::new(fields))
}

fn list_array<T: ArrowPrimitiveType>(values: Vec<T::Native>, offsets: Vec<i32>) -> ArrayRef {
    let field = Arc::new(Field::new_list_field(T::DATA_TYPE, true));
    let values = Arc::new(PrimitiveArray::<T>::from_iter_values(values));
    Arc::new(ListArray::new(
        field,
        OffsetBuffer::new(offsets.into()),
        values,
        None,
    ))
}

fn flat<T: ArrowPrimitiveType>(
    samples: &[Sample],
    get: impl Fn(&Sample) -> &[T::Native],
) -> ArrayRef {
    let mut offsets = Vec::with_capacity(samples.len() + 1);
    offsets.push(0i32);
    let mut values = Vec::with_capacity(samples.iter().map(Sample::len).sum());
    for s in samples {
        values.extend_from_slice(get(s));
        offsets.push(values.len() as i32);
    }
    list_array::<T>(values, offsets)
}

fn nested_ids(samples: &[Sample], get: impl Fn(&Sample) -> Option<&TokenLists>) -> ArrayRef {
    let mut b = ListBuilder::new(ListBuilder::new(Int32Builder::new()));
    for s in samples {
        match get(s) {
            None => b.append(false),
            Some(l) => {
                for t in 0..l.offsets.len() - 1 {
                    b.values().values().append_slice(l.entry(t).0);
                    b.values().append(true);
                }
                b.append(true);
            }
        }
    }
    Arc::new(b.finish())
}

fn nested_logprobs(samples: &[Sample]) -> ArrayRef {
    let mut b = ListBuilder::new(ListBuilder::new(Float32Builder::new()));
    for s in samples {
        match s.sampler_topk.as_ref() {
            None => b.append(false),
            Some(l) => {
                for t in 0..l.offsets.len() - 1 {
                    b.values()
                        .values()
                        .append_slice(l.entry(t).1.unwrap_or(&[]));
                    b.values().append(true);
                }
                b.append(true);
            }
        }
    }
    Arc::new(b.finish())
}

/// Encode samples as one record batch of the Sample schema. The optional
/// columns are present when any sample has them (null for the others).
pub fn encode(samples: &[Sample]) -> Result<RecordBatch> {
    let with_topk = samples.iter().any(|s| s.sampler_topk.is_some());
    let with_mask = samples.iter().any(|s| s.sampling_mask.is_some());
    let mut columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values(
            samples.iter().map(|s| s.sample_id),
        )),
        Arc::new(Int64Array::from_iter_values(
            samples.iter().map(|s| s.group_id),
        )),
        Arc::new(Int64Array::from_iter_values(
            samples.iter().map(|s| s.prompt_index),
        )),
        flat::<Int32Type>(samples, |s| &s.input_ids),
        flat::<Int8Type>(samples, |s| &s.completion_mask),
        flat::<Float32Type>(samples, |s| &s.sampler_logprobs),
        Arc::new(Float32Array::from_iter_values(
            samples.iter().map(|s| s.advantage),
        )),
        Arc::new(Int32Array::from_iter_values(
            samples.iter().map(|s| s.policy_version),
        )),
    ];
    if with_topk {
        columns.push(nested_ids(samples, |s| s.sampler_topk.as_ref()));
        columns.push(nested_logprobs(samples));
    }
    if with_mask {
        columns.push(nested_ids(samples, |s| s.sampling_mask.as_ref()));
    }
    RecordBatch::try_new(sample_schema(with_topk, with_mask), columns)
        .map_err(|e| schema_err("*", e.to_string()))
}

fn schema_err(field: &str, reason: impl Into<String>) -> PackError {
    PackError::Schema {
        field: field.to_string(),
        reason: reason.into(),
    }
}

fn column<'a>(batch: &'a RecordBatch, name: &str, required: bool) -> Result<Option<&'a ArrayRef>> {
    match batch.column_by_name(name) {
        Some(c) => {
            if required && c.null_count() > 0 {
                return Err(schema_err(name, "has nulls; every sample needs a value"));
            }
            Ok(Some(c))
        }
        None if required => Err(schema_err(
            name,
            "is missing; see the Sample schema (DESIGN.md §6)",
        )),
        None => Ok(None),
    }
}

fn scalar<T: ArrowPrimitiveType>(batch: &RecordBatch, name: &str) -> Result<Vec<T::Native>> {
    let c = column(batch, name, true)?.unwrap();
    c.as_primitive_opt::<T>()
        .map(|a| a.values().to_vec())
        .ok_or_else(|| {
            schema_err(
                name,
                format!("has type {}, expected {}", c.data_type(), T::DATA_TYPE),
            )
        })
}

/// `(offsets, values)` of a `list<T>` column; offsets index into `values`.
fn list<'a, T: ArrowPrimitiveType>(
    c: &'a ArrayRef,
    name: &str,
) -> Result<(&'a [i32], &'a [T::Native])> {
    let wrong = || {
        schema_err(
            name,
            format!(
                "has type {}, expected list<{}>",
                c.data_type(),
                T::DATA_TYPE
            ),
        )
    };
    let l = c.as_list_opt::<i32>().ok_or_else(wrong)?;
    let v = l.values().as_primitive_opt::<T>().ok_or_else(wrong)?;
    if v.null_count() > 0 {
        return Err(schema_err(name, "has null entries inside a list"));
    }
    Ok((l.value_offsets(), v.values()))
}

fn lists_of<T: ArrowPrimitiveType>(batch: &RecordBatch, name: &str) -> Result<Vec<Vec<T::Native>>> {
    let (offsets, values) = list::<T>(column(batch, name, true)?.unwrap(), name)?;
    Ok(offsets
        .windows(2)
        .map(|w| values[w[0] as usize..w[1] as usize].to_vec())
        .collect())
}

/// One sample's ragged per-token lists: offsets into the values from 0 (one more than
/// the sample's tokens) and the flat values.
type Ragged<N> = (Vec<u32>, Vec<N>);

/// Per sample, the ragged per-token lists of a `list<list<T>>` column.
fn nested<T: ArrowPrimitiveType>(
    c: &ArrayRef,
    name: &str,
) -> Result<Vec<Option<Ragged<T::Native>>>> {
    let wrong = || {
        schema_err(
            name,
            format!(
                "has type {}, expected list<list<{}>>",
                c.data_type(),
                T::DATA_TYPE
            ),
        )
    };
    let outer = c.as_list_opt::<i32>().ok_or_else(wrong)?;
    let inner_ref = outer.values();
    let (inner_offsets, values) = list::<T>(inner_ref, name)?;
    let mut out = Vec::with_capacity(outer.len());
    for (i, w) in outer.value_offsets().windows(2).enumerate() {
        if outer.is_null(i) {
            out.push(None);
            continue;
        }
        let offs = &inner_offsets[w[0] as usize..=w[1] as usize];
        let base = offs[0];
        let local: Vec<u32> = offs.iter().map(|&o| (o - base) as u32).collect();
        out.push(Some((
            local,
            values[base as usize..*offs.last().unwrap() as usize].to_vec(),
        )));
    }
    Ok(out)
}

/// Decode a record batch of the Sample schema; every sample is validated.
///
/// Errors: [`PackError::Schema`] naming a missing or mistyped column, or the
/// first invalid sample's validation error.
pub fn decode(batch: &RecordBatch) -> Result<Vec<Sample>> {
    let sample_id = scalar::<Int64Type>(batch, "sample_id")?;
    let group_id = scalar::<Int64Type>(batch, "group_id")?;
    let prompt_index = scalar::<Int64Type>(batch, "prompt_index")?;
    let advantage = scalar::<Float32Type>(batch, "advantage")?;
    let policy_version = scalar::<Int32Type>(batch, "policy_version")?;
    let input_ids = lists_of::<Int32Type>(batch, "input_ids")?;
    let mask = lists_of::<Int8Type>(batch, "completion_mask")?;
    let logprobs = lists_of::<Float32Type>(batch, "sampler_logprobs")?;
    let topk_ids = column(batch, TOPK_IDS, false)?
        .map(|c| nested::<Int32Type>(c, TOPK_IDS))
        .transpose()?;
    let topk_lp = column(batch, TOPK_LOGPROBS, false)?
        .map(|c| nested::<Float32Type>(c, TOPK_LOGPROBS))
        .transpose()?;
    if topk_ids.is_some() != topk_lp.is_some() {
        return Err(schema_err(
            TOPK_LOGPROBS,
            format!("and `{TOPK_IDS}` must come together"),
        ));
    }
    let mut sampling_mask = column(batch, SAMPLING_MASK, false)?
        .map(|c| nested::<Int32Type>(c, SAMPLING_MASK))
        .transpose()?;
    let mut topk = topk_ids.zip(topk_lp);
    let mut samples = Vec::with_capacity(batch.num_rows());
    for (i, ((ids, m), lp)) in input_ids.into_iter().zip(mask).zip(logprobs).enumerate() {
        let sampler_topk = match topk.as_mut() {
            Some((ids_col, lp_col)) => match (ids_col[i].take(), lp_col[i].take()) {
                (Some((offsets, tids)), Some((lp_offsets, lps))) => {
                    if offsets != lp_offsets {
                        return Err(schema_err(
                            TOPK_LOGPROBS,
                            format!("row {i}: lists differ in shape from `{TOPK_IDS}`"),
                        ));
                    }
                    Some(TokenLists {
                        offsets,
                        ids: tids,
                        logprobs: Some(lps),
                    })
                }
                (None, None) => None,
                _ => {
                    return Err(schema_err(
                        TOPK_LOGPROBS,
                        format!("row {i}: null in one of the top-k columns only"),
                    ))
                }
            },
            None => None,
        };
        let sampling_mask =
            sampling_mask
                .as_mut()
                .and_then(|c| c[i].take())
                .map(|(offsets, ids)| TokenLists {
                    offsets,
                    ids,
                    logprobs: None,
                });
        let s = Sample {
            sample_id: sample_id[i],
            group_id: group_id[i],
            prompt_index: prompt_index[i],
            input_ids: ids,
            completion_mask: m,
            sampler_logprobs: lp,
            advantage: advantage[i],
            policy_version: policy_version[i],
            sampler_topk,
            sampling_mask,
        };
        s.validate()?;
        samples.push(s);
    }
    Ok(samples)
}

fn ipc_err(path: &Path, e: impl ToString) -> PackError {
    PackError::Ipc {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

/// Write samples to an Arrow IPC file (one record batch).
pub fn write_ipc(path: &Path, samples: &[Sample]) -> Result<()> {
    let batch = encode(samples)?;
    let file = File::create(path).map_err(|e| ipc_err(path, e))?;
    let mut w = FileWriter::try_new(file, batch.schema_ref()).map_err(|e| ipc_err(path, e))?;
    w.write(&batch).map_err(|e| ipc_err(path, e))?;
    w.finish().map_err(|e| ipc_err(path, e))
}

/// Read every sample of an Arrow IPC file of the Sample schema.
pub fn read_ipc(path: &Path) -> Result<Vec<Sample>> {
    let file = File::open(path).map_err(|e| ipc_err(path, e))?;
    let reader = FileReader::try_new(file, None).map_err(|e| ipc_err(path, e))?;
    let mut samples = Vec::new();
    for batch in reader {
        samples.extend(decode(&batch.map_err(|e| ipc_err(path, e))?)?);
    }
    Ok(samples)
}

/// The five record batches of a packed row and their flat columns, in order. `loss` also
/// carries the optional list columns ([`TOPK_IDS`], [`TOPK_LOGPROBS`], [`SAMPLING_MASK`]) when
/// any sample of the row has them.
pub const ROW_PARTS: [(&str, &[&str]); 5] = [
    ("tokens", &["input_ids", "position_ids", "subtree_end"]),
    ("segments", &["cu_seqlens_q", "cu_seqlens_k"]),
    ("kv", &["kv_index"]),
    (
        "loss",
        &[
            "token_index",
            "target_id",
            "sampler_logprob",
            "advantage",
            "sample_index",
        ],
    ),
    (
        "samples",
        &[
            "sample_id",
            "group_id",
            "prompt_index",
            "policy_version",
            "num_tokens",
            "num_trained",
        ],
    ),
];

/// The counts of a packed row, in order: forwarded tokens `N`, loss terms `M`, raw tokens
/// (sum of sample lengths), samples, and the attention load (sum over forwarded tokens of depth + 1).
pub const ROW_COUNTS: [&str; 5] = [
    "num_forwarded",
    "num_trained",
    "num_raw",
    "num_samples",
    "load",
];

fn row_column_type(name: &str) -> DataType {
    match name {
        "sample_id" | "group_id" | "prompt_index" => DataType::Int64,
        "sampler_logprob" | "advantage" => DataType::Float32,
        TOPK_IDS | SAMPLING_MASK => list_of(DataType::Int32),
        TOPK_LOGPROBS => list_of(DataType::Float32),
        _ => DataType::Int32,
    }
}

/// The schema of one part of a packed row (`tokens`, `segments`, `kv`, `loss`, `samples`); every
/// column is non-nullable. `with_topk` / `with_mask` add the optional list columns to `loss`.
///
/// Errors: [`PackError::Schema`] for an unknown part.
pub fn row_schema(part: &str, with_topk: bool, with_mask: bool) -> Result<SchemaRef> {
    let (_, columns) = ROW_PARTS
        .iter()
        .find(|(name, _)| *name == part)
        .ok_or_else(|| {
            schema_err(
                part,
                format!(
                    "is not a packed-row part; parts: {:?}",
                    ROW_PARTS.map(|p| p.0)
                ),
            )
        })?;
    let mut names: Vec<&str> = columns.to_vec();
    if part == "loss" && with_topk {
        names.extend([TOPK_IDS, TOPK_LOGPROBS]);
    }
    if part == "loss" && with_mask {
        names.push(SAMPLING_MASK);
    }
    Ok(Arc::new(Schema::new(
        names
            .into_iter()
            .map(|n| Field::new(n, row_column_type(n), false))
            .collect::<Vec<_>>(),
    )))
}

/// A packed row as Arrow: its five parts (in [`ROW_PARTS`] order) and its counts (in [`ROW_COUNTS`] order).
pub struct RowBatches {
    /// `(part name, record batch)`: tokens `[N]`, segments `[S + 1]`, kv `[K]`, loss `[M]`, samples.
    pub parts: Vec<(&'static str, RecordBatch)>,
    /// `(count name, value)`.
    pub counts: [(&'static str, u64); 5],
}

fn i32_column(v: Vec<i32>) -> ArrayRef {
    Arc::new(Int32Array::from(v))
}

/// A per-loss-term CSR list (`offsets [M + 1]`) as a `list<int32>` or `list<float32>` column.
fn ragged(lists: &TokenLists, logprobs: bool) -> ArrayRef {
    let offsets: Vec<i32> = lists.offsets.iter().map(|&o| o as i32).collect();
    if logprobs {
        list_array::<Float32Type>(lists.logprobs.clone().unwrap_or_default(), offsets)
    } else {
        list_array::<Int32Type>(lists.ids.clone(), offsets)
    }
}

fn part(
    name: &'static str,
    columns: Vec<ArrayRef>,
    with_topk: bool,
    with_mask: bool,
) -> (&'static str, RecordBatch) {
    let schema = row_schema(name, with_topk, with_mask).expect("a part of ROW_PARTS");
    let batch = RecordBatch::try_new(schema, columns).expect("packed-row columns match row_schema");
    (name, batch)
}

/// Encode a packed row in the layout of [`ROW_PARTS`] / [`row_schema`] (see `trie::PackedRow` for
/// what each column means).
pub fn encode_row(row: &TreeRow) -> RowBatches {
    let p: PackedRow = row.pack();
    let samples = row.samples();
    let counts = [
        ("num_forwarded", p.num_forwarded() as u64),
        ("num_trained", p.num_trained() as u64),
        ("num_raw", p.num_raw as u64),
        ("num_samples", samples.len() as u64),
        ("load", p.load),
    ];
    let (with_topk, with_mask) = (p.sampler_topk.is_some(), p.sampling_mask.is_some());
    let mut loss = vec![
        i32_column(p.token_index),
        i32_column(p.target_id),
        Arc::new(Float32Array::from(p.sampler_logprob)) as ArrayRef,
        Arc::new(Float32Array::from(p.advantage)) as ArrayRef,
        i32_column(p.sample_index),
    ];
    if let Some(t) = &p.sampler_topk {
        loss.extend([ragged(t, false), ragged(t, true)]);
    }
    if let Some(m) = &p.sampling_mask {
        loss.push(ragged(m, false));
    }
    let int64 = |get: fn(&Sample) -> i64| {
        Arc::new(Int64Array::from_iter_values(samples.iter().map(get))) as ArrayRef
    };
    let parts = vec![
        part(
            "tokens",
            vec![
                i32_column(p.input_ids),
                i32_column(p.position_ids),
                i32_column(p.subtree_end),
            ],
            false,
            false,
        ),
        part(
            "segments",
            vec![i32_column(p.cu_seqlens_q), i32_column(p.cu_seqlens_k)],
            false,
            false,
        ),
        part("kv", vec![i32_column(p.kv_index)], false, false),
        part("loss", loss, with_topk, with_mask),
        part(
            "samples",
            vec![
                int64(|s| s.sample_id),
                int64(|s| s.group_id),
                int64(|s| s.prompt_index),
                i32_column(samples.iter().map(|s| s.policy_version).collect()),
                i32_column(samples.iter().map(|s| s.len() as i32).collect()),
                i32_column(samples.iter().map(|s| s.num_trained() as i32).collect()),
            ],
            false,
            false,
        ),
    ];
    RowBatches { parts, counts }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(id: i64, ids: &[i32], topk: bool) -> Sample {
        let n = ids.len();
        Sample {
            sample_id: id,
            group_id: 10 + id,
            prompt_index: 20 + id,
            input_ids: ids.to_vec(),
            completion_mask: (0..n).map(|i| i8::from(i >= 1)).collect(),
            sampler_logprobs: vec![-0.25; n],
            advantage: 0.5,
            policy_version: 3,
            sampler_topk: topk.then(|| TokenLists {
                offsets: (0..=n as u32).map(|i| 2 * i).collect(),
                ids: (0..2 * n as i32).collect(),
                logprobs: Some(vec![-1.0; 2 * n]),
            }),
            sampling_mask: None,
        }
    }

    #[test]
    fn every_part_follows_its_schema_and_the_counts_match_the_columns() {
        let mut row = TreeRow::new();
        row.add(sample(0, &[1, 2, 3], true), 64).unwrap();
        row.add(sample(1, &[1, 2, 4, 5], true), 64).unwrap();
        let encoded = encode_row(&row);
        let names: Vec<&str> = encoded.parts.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ROW_PARTS.map(|p| p.0).to_vec());
        for (name, batch) in &encoded.parts {
            assert_eq!(
                batch.schema(),
                row_schema(name, true, false).unwrap(),
                "part {name}"
            );
        }
        let counts: Vec<(&str, u64)> = encoded.counts.to_vec();
        // Shared prefix [1, 2]: forwarded 1,2,3,4,5; trained 2 + 3 terms; raw 3 + 4 tokens; load 1+2+3 + 3+4.
        assert_eq!(
            counts,
            vec![
                ("num_forwarded", 5),
                ("num_trained", 5),
                ("num_raw", 7),
                ("num_samples", 2),
                ("load", 13)
            ]
        );
        assert_eq!(encoded.parts[0].1.num_rows(), 5);
        assert_eq!(encoded.parts[3].1.num_rows(), 5);
        let ids = encoded.parts[4]
            .1
            .column_by_name("sample_id")
            .unwrap()
            .as_primitive::<Int64Type>();
        assert_eq!(ids.values().to_vec(), vec![0, 1]);
        let topk = encoded.parts[3]
            .1
            .column_by_name(TOPK_IDS)
            .unwrap()
            .as_list::<i32>();
        assert_eq!(topk.value_length(0), 2, "two candidates per trained token");
    }

    #[test]
    fn loss_columns_appear_only_when_asked_and_unknown_parts_are_an_error() {
        let plain = row_schema("loss", false, false).unwrap();
        assert_eq!(plain.fields().len(), 5);
        let full = row_schema("loss", true, true).unwrap();
        let extra: Vec<&str> = full
            .fields()
            .iter()
            .skip(5)
            .map(|f| f.name().as_str())
            .collect();
        assert_eq!(extra, vec![TOPK_IDS, TOPK_LOGPROBS, SAMPLING_MASK]);
        assert_eq!(
            row_schema("tokens", true, true).unwrap().fields().len(),
            3,
            "only loss has optional columns"
        );
        let err = row_schema("rows", false, false).unwrap_err();
        assert_eq!((err.kind(), err.field()), ("Schema", Some("rows")));
    }
}
