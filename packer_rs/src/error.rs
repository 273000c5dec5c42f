//! Errors of the packing core. Each one names the offending field; the Python
//! bindings raise them as `packer_rs.PackingError`, a `ValueError` subclass.

use thiserror::Error;

/// Everything that can go wrong while validating, packing or encoding samples.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PackError {
    /// Two per-token fields of one sample have different lengths.
    #[error("sample {sample_id}: `{field}` has {got} entries but `input_ids` has {expected}; every per-token field needs one entry per token")]
    LengthMismatch {
        sample_id: i64,
        field: &'static str,
        expected: usize,
        got: usize,
    },
    /// A sample without tokens.
    #[error("sample {sample_id}: `input_ids` is empty; a sample needs at least a prompt token and a trained token")]
    EmptySample { sample_id: i64 },
    /// A sample whose completion mask trains nothing.
    #[error("sample {sample_id}: `completion_mask` marks no trained token after position 0; drop the sample or mark its completion tokens with 1")]
    NoTrainedToken { sample_id: i64 },
    /// The first token cannot be trained: nothing before it predicts it.
    #[error("sample {sample_id}: `completion_mask[0]` is set, but the first token has no predecessor to predict it; set it to 0")]
    FirstTokenTrained { sample_id: i64 },
    /// A completion-mask entry other than 0 or 1.
    #[error("sample {sample_id}: `completion_mask[{position}]` is {value}; use 0 (not trained) or 1 (trained)")]
    BadMask {
        sample_id: i64,
        position: usize,
        value: i8,
    },
    /// A ragged per-token list (top-k or sampling mask) with broken offsets.
    #[error("sample {sample_id}: `{field}` {reason}")]
    BadTokenLists {
        sample_id: i64,
        field: &'static str,
        reason: String,
    },
    /// A token budget that cannot hold a single token.
    #[error("`token_budget` must be a positive number of tokens, got {0}")]
    BadBudget(i64),
    /// A data-parallel world with no ranks.
    #[error("`num_ranks` must be at least 1, got {0}")]
    BadRanks(i64),
    /// A sample does not fit the row it was explicitly added to.
    #[error("sample {sample_id} needs {needed} new tokens and {trained} trained tokens but the row has room for {room_forwarded} and {room_trained} under `token_budget`; check `fits` before `add`")]
    DoesNotFit {
        sample_id: i64,
        needed: usize,
        trained: usize,
        room_forwarded: usize,
        room_trained: usize,
    },
    /// An Arrow record batch that does not follow the Sample schema.
    #[error("Sample batch: column `{field}` {reason}")]
    Schema { field: String, reason: String },
    /// Arrow IPC read or write failure.
    #[error("Arrow IPC file {path}: {reason}")]
    Ipc { path: String, reason: String },
}

pub type Result<T> = std::result::Result<T, PackError>;

impl PackError {
    /// The variant's name (`"LengthMismatch"`, `"Schema"`, …): the stable, structured kind of the error that
    /// the Python bindings set as `PackingError.kind`.
    pub fn kind(&self) -> &'static str {
        match self {
            PackError::LengthMismatch { .. } => "LengthMismatch",
            PackError::EmptySample { .. } => "EmptySample",
            PackError::NoTrainedToken { .. } => "NoTrainedToken",
            PackError::FirstTokenTrained { .. } => "FirstTokenTrained",
            PackError::BadMask { .. } => "BadMask",
            PackError::BadTokenLists { .. } => "BadTokenLists",
            PackError::BadBudget(_) => "BadBudget",
            PackError::BadRanks(_) => "BadRanks",
            PackError::DoesNotFit { .. } => "DoesNotFit",
            PackError::Schema { .. } => "Schema",
            PackError::Ipc { .. } => "Ipc",
        }
    }

    /// The offending field (a sample field, a Sample-schema column or an argument), when there is one.
    pub fn field(&self) -> Option<&str> {
        match self {
            PackError::LengthMismatch { field, .. } | PackError::BadTokenLists { field, .. } => {
                Some(*field)
            }
            PackError::EmptySample { .. } => Some("input_ids"),
            PackError::NoTrainedToken { .. }
            | PackError::FirstTokenTrained { .. }
            | PackError::BadMask { .. } => Some("completion_mask"),
            PackError::BadBudget(_) | PackError::DoesNotFit { .. } => Some("token_budget"),
            PackError::BadRanks(_) => Some("num_ranks"),
            PackError::Schema { field, .. } => Some(field.as_str()),
            PackError::Ipc { .. } => None,
        }
    }

    /// The id of the offending sample, when the error is about one sample.
    pub fn sample_id(&self) -> Option<i64> {
        match self {
            PackError::LengthMismatch { sample_id, .. }
            | PackError::EmptySample { sample_id }
            | PackError::NoTrainedToken { sample_id }
            | PackError::FirstTokenTrained { sample_id }
            | PackError::BadMask { sample_id, .. }
            | PackError::BadTokenLists { sample_id, .. }
            | PackError::DoesNotFit { sample_id, .. } => Some(*sample_id),
            PackError::BadBudget(_)
            | PackError::BadRanks(_)
            | PackError::Schema { .. }
            | PackError::Ipc { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_names_its_kind_field_and_sample() {
        let e = PackError::LengthMismatch {
            sample_id: 7,
            field: "sampler_logprobs",
            expected: 3,
            got: 2,
        };
        assert_eq!(
            (e.kind(), e.field(), e.sample_id()),
            ("LengthMismatch", Some("sampler_logprobs"), Some(7))
        );
        let e = PackError::BadMask {
            sample_id: 2,
            position: 1,
            value: 3,
        };
        assert_eq!(
            (e.kind(), e.field(), e.sample_id()),
            ("BadMask", Some("completion_mask"), Some(2))
        );
        let e = PackError::Schema {
            field: "input_ids".into(),
            reason: "is missing".into(),
        };
        assert_eq!(
            (e.kind(), e.field(), e.sample_id()),
            ("Schema", Some("input_ids"), None)
        );
        let e = PackError::BadBudget(0);
        assert_eq!(
            (e.kind(), e.field(), e.sample_id()),
            ("BadBudget", Some("token_budget"), None)
        );
        assert!(
            e.to_string().contains("token_budget"),
            "the message names the field too: {e}"
        );
        let e = PackError::Ipc {
            path: "x".into(),
            reason: "gone".into(),
        };
        assert_eq!((e.kind(), e.field(), e.sample_id()), ("Ipc", None, None));
    }
}
