//! packer_rs: prefix-trie packing of GRPO samples into token-budget rows, and
//! the Arrow encoding of samples (DESIGN.md §5, §6).
//!
//! The logic lives in plain-Rust modules (`sample`, `trie`, `batcher`,
//! `arrow`), tested by `cargo test` without libpython. This file holds only the
//! pyo3 bindings, compiled with the `python` feature (maturin turns it on):
//! numpy arrays and Arrow record batches (PyCapsule interface) in, Arrow record
//! batches out, zero-copy into pyarrow; batch work runs without the GIL.

pub mod arrow;
pub mod batcher;
pub mod error;
pub mod sample;
pub mod trie;

pub use batcher::{Outcome, TokenBudgetBatcher};
pub use error::{PackError, Result};
pub use sample::{Sample, TokenLists};
pub use trie::{PackedRow, Placement, TreeRow};

#[cfg(feature = "python")]
mod bindings {
    use numpy::{PyArray1, PyReadonlyArray1};
    use pyo3::create_exception;
    use pyo3::exceptions::PyValueError;
    use pyo3::prelude::*;
    use pyo3::types::{PyDict, PyList, PyTuple};
    use pyo3_arrow::{PyRecordBatch, PySchema};

    use crate::arrow::RowBatches;
    use crate::{arrow, PackError, Sample, TokenLists};

    create_exception!(
        packer_rs,
        PackingError,
        PyValueError,
        "Bad sample or packing input. Attributes: `kind` (the Rust `PackError` variant, or `BadInput` for a \
         Python value of the wrong type), `field` (the offending field or column, or None) and `sample_id` \
         (or None); the message names the field and the fix."
    );

    /// A `PackingError` with its structured attributes set.
    fn structured(
        kind: &str,
        field: Option<&str>,
        sample_id: Option<i64>,
        message: String,
    ) -> PyErr {
        let e = PackingError::new_err(message);
        let failed = Python::attach(|py| {
            let value = e.value(py);
            value
                .setattr("kind", kind)
                .and_then(|()| value.setattr("field", field))
                .and_then(|()| value.setattr("sample_id", sample_id))
                .err()
        });
        failed.unwrap_or(e)
    }

    fn err(e: PackError) -> PyErr {
        structured(e.kind(), e.field(), e.sample_id(), e.to_string())
    }

    /// A Python value of the wrong type or shape for `field`.
    fn bad_input(field: &str, message: String) -> PyErr {
        structured("BadInput", Some(field), None, message)
    }

    fn array<'py, T: numpy::Element + Copy>(
        obj: &Bound<'py, PyAny>,
        field: &str,
        dtype: &str,
    ) -> PyResult<Vec<T>> {
        let value = obj.getattr(field)?;
        let arr = value.extract::<PyReadonlyArray1<'py, T>>().map_err(|_| {
            bad_input(field, format!(
                "`{field}` must be a 1-D numpy array of {dtype}, got {}; convert it with np.asarray(x, dtype=np.{dtype})",
                value.repr().map(|r| r.to_string()).unwrap_or_default().chars().take(80).collect::<String>()
            ))
        })?;
        Ok(arr.as_array().to_vec())
    }

    fn token_lists(
        obj: &Bound<'_, PyAny>,
        field: &str,
        with_logprobs: bool,
    ) -> PyResult<Option<TokenLists>> {
        let value = obj.getattr(field)?;
        if value.is_none() {
            return Ok(None);
        }
        let offsets: Vec<i32> = array(&value, "offsets", "int32")?;
        if offsets.iter().any(|&o| o < 0) {
            return Err(bad_input(
                field,
                format!("`{field}.offsets` must not be negative"),
            ));
        }
        Ok(Some(TokenLists {
            offsets: offsets.into_iter().map(|o| o as u32).collect(),
            ids: array(&value, "ids", "int32")?,
            logprobs: if with_logprobs {
                Some(array(&value, "logprobs", "float32")?)
            } else {
                None
            },
        }))
    }

    /// Read a sample from any object with the Sample attributes (numpy arrays).
    fn extract_sample(obj: &Bound<'_, PyAny>) -> PyResult<Sample> {
        let int = |name: &str| -> PyResult<i64> {
            obj.getattr(name)?
                .extract::<i64>()
                .map_err(|_| bad_input(name, format!("`{name}` must be an integer")))
        };
        let s = Sample {
            sample_id: int("sample_id")?,
            group_id: int("group_id")?,
            prompt_index: int("prompt_index")?,
            input_ids: array(obj, "input_ids", "int32")?,
            completion_mask: array(obj, "completion_mask", "int8")?,
            sampler_logprobs: array(obj, "sampler_logprobs", "float32")?,
            advantage: obj
                .getattr("advantage")?
                .extract::<f64>()
                .map_err(|_| bad_input("advantage", "`advantage` must be a float".into()))?
                as f32,
            policy_version: i32::try_from(int("policy_version")?).map_err(|_| {
                bad_input(
                    "policy_version",
                    "`policy_version` must fit in int32".into(),
                )
            })?,
            sampler_topk: token_lists(obj, "sampler_topk", true)?,
            sampling_mask: token_lists(obj, "sampling_mask", false)?,
        };
        s.validate().map_err(err)?;
        Ok(s)
    }

    fn extract_samples(samples: &Bound<'_, PyAny>) -> PyResult<Vec<Sample>> {
        samples.try_iter()?.map(|s| extract_sample(&s?)).collect()
    }

    fn row_to_py<'py>(py: Python<'py>, row: RowBatches) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, b) in row.parts {
            d.set_item(name, PyRecordBatch::new(b).into_pyarrow(py)?)?;
        }
        for (name, v) in row.counts {
            d.set_item(name, v)?;
        }
        Ok(d)
    }

    fn micro_batches_to_py<'py>(
        py: Python<'py>,
        mbs: Vec<Vec<RowBatches>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for mb in mbs {
            let rows = PyList::empty(py);
            for r in mb {
                rows.append(row_to_py(py, r)?)?;
            }
            out.append(rows)?;
        }
        Ok(out)
    }

    /// One rank's row under construction: a prefix trie over its samples.
    #[pyclass(name = "TreeRow", module = "packer_rs")]
    struct PyTreeRow(crate::TreeRow);

    #[pymethods]
    impl PyTreeRow {
        #[new]
        fn new() -> Self {
            Self(crate::TreeRow::new())
        }

        /// Whether `sample` fits with at most `token_budget` forwarded and trained tokens.
        fn fits(&self, sample: &Bound<'_, PyAny>, token_budget: i64) -> PyResult<bool> {
            let budget = check_budget(token_budget)?;
            Ok(self.0.fits(&extract_sample(sample)?, budget).is_some())
        }

        /// Add `sample`; raises PackingError when it does not fit `token_budget`.
        fn add(&mut self, sample: &Bound<'_, PyAny>, token_budget: i64) -> PyResult<()> {
            let budget = check_budget(token_budget)?;
            self.0.add(extract_sample(sample)?, budget).map_err(err)
        }

        #[getter]
        fn load(&self) -> u64 {
            self.0.load()
        }
        #[getter]
        fn num_forwarded(&self) -> usize {
            self.0.num_forwarded()
        }
        #[getter]
        fn num_trained(&self) -> usize {
            self.0.num_trained()
        }
        #[getter]
        fn num_raw(&self) -> usize {
            self.0.num_raw()
        }
        #[getter]
        fn num_samples(&self) -> usize {
            self.0.samples().len()
        }

        /// The packed row: dict of pyarrow record batches and counts.
        fn pack<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
            let rb = py.detach(|| arrow::encode_row(&self.0));
            row_to_py(py, rb)
        }
    }

    fn check_budget(b: i64) -> PyResult<usize> {
        if b < 1 {
            return Err(err(PackError::BadBudget(b)));
        }
        Ok(b as usize)
    }

    /// Streams samples into one open row per rank under a token budget.
    #[pyclass(name = "TokenBudgetBatcher", module = "packer_rs")]
    struct PyBatcher(crate::TokenBudgetBatcher);

    impl PyBatcher {
        fn push_all(&mut self, samples: Vec<Sample>) -> Vec<Vec<RowBatches>> {
            let mut out = Vec::new();
            for s in samples {
                // Validated on the way in (decode / extract_sample).
                if let (_, Some(rows)) = self.0.push_validated(s) {
                    out.push(rows.iter().map(arrow::encode_row).collect());
                }
            }
            out
        }
    }

    #[pymethods]
    impl PyBatcher {
        #[new]
        fn new(num_ranks: i64, token_budget: i64) -> PyResult<Self> {
            crate::TokenBudgetBatcher::new(num_ranks, token_budget)
                .map(Self)
                .map_err(err)
        }

        /// Push a record batch of the Sample schema; returns the micro-batches it closed.
        fn push<'py>(
            &mut self,
            py: Python<'py>,
            batch: PyRecordBatch,
        ) -> PyResult<Bound<'py, PyList>> {
            let batch = batch.into_inner();
            let mbs = py
                .detach(|| arrow::decode(&batch).map(|s| self.push_all(s)))
                .map_err(err)?;
            micro_batches_to_py(py, mbs)
        }

        /// Push sample objects (numpy fields); returns the micro-batches they closed.
        fn push_samples<'py>(
            &mut self,
            py: Python<'py>,
            samples: &Bound<'py, PyAny>,
        ) -> PyResult<Bound<'py, PyList>> {
            let samples = extract_samples(samples)?;
            let mbs = py.detach(|| self.push_all(samples));
            micro_batches_to_py(py, mbs)
        }

        /// End of stream: the last, possibly partial, micro-batch (a list of 0 or 1).
        fn finish<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
            let mbs = py.detach(|| {
                self.0
                    .finish()
                    .map(|rows| rows.iter().map(arrow::encode_row).collect())
            });
            micro_batches_to_py(py, mbs.into_iter().collect())
        }

        #[getter]
        fn dropped_oversize_count(&self) -> u64 {
            self.0.dropped_oversize_count()
        }
        #[getter]
        fn num_ranks(&self) -> usize {
            self.0.num_ranks()
        }
        #[getter]
        fn token_budget(&self) -> usize {
            self.0.token_budget()
        }
    }

    /// Encode sample objects (numpy fields) as a pyarrow RecordBatch of the Sample schema.
    #[pyfunction]
    fn encode_samples<'py>(
        py: Python<'py>,
        samples: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let samples = extract_samples(samples)?;
        let b = py.detach(|| arrow::encode(&samples)).map_err(err)?;
        PyRecordBatch::new(b).into_pyarrow(py)
    }

    fn np<'py, T: numpy::Element>(py: Python<'py>, v: Vec<T>) -> Bound<'py, PyAny> {
        PyArray1::from_vec(py, v).into_any()
    }

    fn lists_to_py<'py>(py: Python<'py>, l: Option<TokenLists>) -> PyResult<Bound<'py, PyAny>> {
        let Some(l) = l else {
            return Ok(py.None().into_bound(py));
        };
        let d = PyDict::new(py);
        d.set_item(
            "offsets",
            np(
                py,
                l.offsets
                    .into_iter()
                    .map(|o| o as i32)
                    .collect::<Vec<i32>>(),
            ),
        )?;
        d.set_item("ids", np(py, l.ids))?;
        d.set_item("logprobs", l.logprobs.map(|v| np(py, v)))?;
        Ok(d.into_any())
    }

    /// Decode a Sample-schema record batch into a list of dicts of numpy arrays.
    #[pyfunction]
    fn decode_samples<'py>(py: Python<'py>, batch: PyRecordBatch) -> PyResult<Bound<'py, PyList>> {
        let batch = batch.into_inner();
        let samples = py.detach(|| arrow::decode(&batch)).map_err(err)?;
        let out = PyList::empty(py);
        for s in samples {
            let d = PyDict::new(py);
            d.set_item("sample_id", s.sample_id)?;
            d.set_item("group_id", s.group_id)?;
            d.set_item("prompt_index", s.prompt_index)?;
            d.set_item("input_ids", np(py, s.input_ids))?;
            d.set_item("completion_mask", np(py, s.completion_mask))?;
            d.set_item("sampler_logprobs", np(py, s.sampler_logprobs))?;
            d.set_item("advantage", s.advantage)?;
            d.set_item("policy_version", s.policy_version)?;
            d.set_item("sampler_topk", lists_to_py(py, s.sampler_topk)?)?;
            d.set_item("sampling_mask", lists_to_py(py, s.sampling_mask)?)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Write a Sample-schema record batch to an Arrow IPC file (validated first).
    #[pyfunction]
    fn write_samples_ipc(
        py: Python<'_>,
        path: std::path::PathBuf,
        batch: PyRecordBatch,
    ) -> PyResult<()> {
        let batch = batch.into_inner();
        py.detach(|| arrow::decode(&batch).and_then(|s| arrow::write_ipc(&path, &s)))
            .map_err(err)
    }

    /// Read every sample of an Arrow IPC file into one pyarrow RecordBatch.
    #[pyfunction]
    fn read_samples_ipc<'py>(
        py: Python<'py>,
        path: std::path::PathBuf,
    ) -> PyResult<Bound<'py, PyAny>> {
        let b = py
            .detach(|| arrow::read_ipc(&path).and_then(|s| arrow::encode(&s)))
            .map_err(err)?;
        PyRecordBatch::new(b).into_pyarrow(py)
    }

    /// The schema of one part of a packed row (`tokens`, `segments`, `kv`, `loss`, `samples`) as a pyarrow Schema.
    #[pyfunction]
    #[pyo3(signature = (part, with_topk=false, with_mask=false))]
    fn row_schema<'py>(
        py: Python<'py>,
        part: &str,
        with_topk: bool,
        with_mask: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        PySchema::new(arrow::row_schema(part, with_topk, with_mask).map_err(err)?).into_pyarrow(py)
    }

    /// The Sample schema as a pyarrow Schema.
    #[pyfunction]
    #[pyo3(signature = (with_topk=false, with_mask=false))]
    fn sample_schema<'py>(
        py: Python<'py>,
        with_topk: bool,
        with_mask: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        PySchema::new(arrow::sample_schema(with_topk, with_mask)).into_pyarrow(py)
    }

    #[pymodule]
    fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("PackingError", m.py().get_type::<PackingError>())?;
        m.add_class::<PyTreeRow>()?;
        m.add_class::<PyBatcher>()?;
        m.add_function(wrap_pyfunction!(encode_samples, m)?)?;
        m.add_function(wrap_pyfunction!(decode_samples, m)?)?;
        m.add_function(wrap_pyfunction!(write_samples_ipc, m)?)?;
        m.add_function(wrap_pyfunction!(read_samples_ipc, m)?)?;
        m.add_function(wrap_pyfunction!(sample_schema, m)?)?;
        m.add_function(wrap_pyfunction!(row_schema, m)?)?;
        m.add(
            "ROW_PARTS",
            PyTuple::new(m.py(), arrow::ROW_PARTS.map(|(name, _)| name))?,
        )?;
        m.add("ROW_COUNTS", PyTuple::new(m.py(), arrow::ROW_COUNTS)?)?;
        Ok(())
    }
}
