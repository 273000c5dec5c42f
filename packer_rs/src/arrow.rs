//! Sample ↔ Arrow: the Sample schema of DESIGN.md §6 (one row per sample),
//! exact round trips, and Arrow IPC files.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{Float32Builder, Int32Builder, ListBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Int32Type, Int64Type, Int8Type};
use arrow_array::{Array, ArrayRef, ArrowPrimitiveType, Float32Array, Int32Array, Int64Array, ListArray, PrimitiveArray, RecordBatch};
use arrow_buffer::OffsetBuffer;
use arrow_ipc::reader::FileReader;
use arrow_ipc::writer::FileWriter;
use arrow_schema::{DataType, Field, Schema, SchemaRef};

use crate::error::{PackError, Result};
use crate::sample::{Sample, TokenLists};

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
        fields.push(Field::new(TOPK_IDS, list_of(list_of(DataType::Int32)), true));
        fields.push(Field::new(TOPK_LOGPROBS, list_of(list_of(DataType::Float32)), true));
    }
    if with_mask {
        fields.push(Field::new(SAMPLING_MASK, list_of(list_of(DataType::Int32)), true));
    }
    Arc::new(Schema::new(fields))
}

fn list_array<T: ArrowPrimitiveType>(values: Vec<T::Native>, offsets: Vec<i32>) -> ArrayRef {
    let field = Arc::new(Field::new_list_field(T::DATA_TYPE, true));
    let values = Arc::new(PrimitiveArray::<T>::from_iter_values(values));
    Arc::new(ListArray::new(field, OffsetBuffer::new(offsets.into()), values, None))
}

fn flat<T: ArrowPrimitiveType>(samples: &[Sample], get: impl Fn(&Sample) -> &[T::Native]) -> ArrayRef {
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
                    b.values().values().append_slice(l.entry(t).1.unwrap_or(&[]));
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
        Arc::new(Int64Array::from_iter_values(samples.iter().map(|s| s.sample_id))),
        Arc::new(Int64Array::from_iter_values(samples.iter().map(|s| s.group_id))),
        Arc::new(Int64Array::from_iter_values(samples.iter().map(|s| s.prompt_index))),
        flat::<Int32Type>(samples, |s| &s.input_ids),
        flat::<Int8Type>(samples, |s| &s.completion_mask),
        flat::<Float32Type>(samples, |s| &s.sampler_logprobs),
        Arc::new(Float32Array::from_iter_values(samples.iter().map(|s| s.advantage))),
        Arc::new(Int32Array::from_iter_values(samples.iter().map(|s| s.policy_version))),
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
    PackError::Schema { field: field.to_string(), reason: reason.into() }
}

fn column<'a>(batch: &'a RecordBatch, name: &str, required: bool) -> Result<Option<&'a ArrayRef>> {
    match batch.column_by_name(name) {
        Some(c) => {
            if required && c.null_count() > 0 {
                return Err(schema_err(name, "has nulls; every sample needs a value"));
            }
            Ok(Some(c))
        }
        None if required => Err(schema_err(name, "is missing; see the Sample schema (DESIGN.md §6)")),
        None => Ok(None),
    }
}

fn scalar<T: ArrowPrimitiveType>(batch: &RecordBatch, name: &str) -> Result<Vec<T::Native>> {
    let c = column(batch, name, true)?.unwrap();
    c.as_primitive_opt::<T>()
        .map(|a| a.values().to_vec())
        .ok_or_else(|| schema_err(name, format!("has type {}, expected {}", c.data_type(), T::DATA_TYPE)))
}

/// `(offsets, values)` of a `list<T>` column; offsets index into `values`.
fn list<'a, T: ArrowPrimitiveType>(c: &'a ArrayRef, name: &str) -> Result<(&'a [i32], &'a [T::Native])> {
    let wrong = || schema_err(name, format!("has type {}, expected list<{}>", c.data_type(), T::DATA_TYPE));
    let l = c.as_list_opt::<i32>().ok_or_else(wrong)?;
    let v = l.values().as_primitive_opt::<T>().ok_or_else(wrong)?;
    if v.null_count() > 0 {
        return Err(schema_err(name, "has null entries inside a list"));
    }
    Ok((l.value_offsets(), v.values()))
}

fn lists_of<T: ArrowPrimitiveType>(batch: &RecordBatch, name: &str) -> Result<Vec<Vec<T::Native>>> {
    let (offsets, values) = list::<T>(column(batch, name, true)?.unwrap(), name)?;
    Ok(offsets.windows(2).map(|w| values[w[0] as usize..w[1] as usize].to_vec()).collect())
}

/// Per sample, the ragged per-token lists of a `list<list<T>>` column.
fn nested<T: ArrowPrimitiveType>(c: &ArrayRef, name: &str) -> Result<Vec<Option<(Vec<u32>, Vec<T::Native>)>>> {
    let wrong = || schema_err(name, format!("has type {}, expected list<list<{}>>", c.data_type(), T::DATA_TYPE));
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
        out.push(Some((local, values[base as usize..*offs.last().unwrap() as usize].to_vec())));
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
    let topk_ids = column(batch, TOPK_IDS, false)?.map(|c| nested::<Int32Type>(c, TOPK_IDS)).transpose()?;
    let topk_lp = column(batch, TOPK_LOGPROBS, false)?
        .map(|c| nested::<Float32Type>(c, TOPK_LOGPROBS))
        .transpose()?;
    if topk_ids.is_some() != topk_lp.is_some() {
        return Err(schema_err(TOPK_LOGPROBS, format!("and `{TOPK_IDS}` must come together")));
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
                        return Err(schema_err(TOPK_LOGPROBS, format!("row {i}: lists differ in shape from `{TOPK_IDS}`")));
                    }
                    Some(TokenLists { offsets, ids: tids, logprobs: Some(lps) })
                }
                (None, None) => None,
                _ => return Err(schema_err(TOPK_LOGPROBS, format!("row {i}: null in one of the top-k columns only"))),
            },
            None => None,
        };
        let sampling_mask = sampling_mask
            .as_mut()
            .and_then(|c| c[i].take())
            .map(|(offsets, ids)| TokenLists { offsets, ids, logprobs: None });
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
    PackError::Ipc { path: path.display().to_string(), reason: e.to_string() }
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
