//! The training sample (DESIGN.md §6): what the loss sees for one rollout turn chain.

use crate::error::{PackError, Result};

/// A ragged list of token candidates per token of a sample (CSR layout).
///
/// Entry `t` is `ids[offsets[t]..offsets[t + 1]]` (and the matching `logprobs`
/// slice when present). Used for the sampler's top-k log-probs (score centering)
/// and for the sampling mask (the candidate set of top-k / top-p / min-p).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TokenLists {
    /// `num_tokens + 1` offsets into `ids`, starting at 0, non-decreasing.
    pub offsets: Vec<u32>,
    /// Token ids, concatenated.
    pub ids: Vec<i32>,
    /// Log-probs (natural log) of `ids`, same length; `None` for a sampling mask.
    pub logprobs: Option<Vec<f32>>,
}

impl TokenLists {
    /// The candidates of token `t`: `(ids, logprobs)`.
    pub fn entry(&self, t: usize) -> (&[i32], Option<&[f32]>) {
        let (a, b) = (self.offsets[t] as usize, self.offsets[t + 1] as usize);
        (&self.ids[a..b], self.logprobs.as_ref().map(|l| &l[a..b]))
    }

    fn validate(&self, sample_id: i64, field: &'static str, num_tokens: usize) -> Result<()> {
        let bad = |reason: String| PackError::BadTokenLists {
            sample_id,
            field,
            reason,
        };
        if self.offsets.len() != num_tokens + 1 {
            return Err(bad(format!(
                "has {} entries but the sample has {} tokens",
                self.offsets.len().saturating_sub(1),
                num_tokens
            )));
        }
        if self.offsets[0] != 0 || self.offsets.windows(2).any(|w| w[0] > w[1]) {
            return Err(bad("offsets must start at 0 and never decrease".into()));
        }
        if *self.offsets.last().unwrap() as usize != self.ids.len() {
            return Err(bad("offsets do not end at the number of ids".into()));
        }
        if let Some(l) = &self.logprobs {
            if l.len() != self.ids.len() {
                return Err(bad(
                    "has a different number of log-probs than token ids".into()
                ));
            }
        }
        Ok(())
    }
}

/// One training sample: a token sequence, which of its tokens are trained, and
/// the sampler's view of them.
///
/// Per-token fields have one entry per token of `input_ids` (`num_tokens`).
/// Token `t` is trained iff `completion_mask[t] == 1`; its loss term is predicted
/// from token `t - 1`, so `completion_mask[0]` must be 0.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Sample {
    /// Unique id of the sample in the run.
    pub sample_id: i64,
    /// Group (prompt × generation round) the sample belongs to; advantages are relative within it.
    pub group_id: i64,
    /// Index of the prompt in the training dataset (resume bookkeeping).
    pub prompt_index: i64,
    /// Token ids, `[num_tokens]`.
    pub input_ids: Vec<i32>,
    /// 1 = trained (a completion token), 0 = context, `[num_tokens]`.
    pub completion_mask: Vec<i8>,
    /// Sampler log-prob of each token (natural log; 0 where not trained), `[num_tokens]`.
    pub sampler_logprobs: Vec<f32>,
    /// Group-normalised advantage shared by every trained token.
    pub advantage: f32,
    /// Policy version (number of weight syncs) that generated the sample.
    pub policy_version: i32,
    /// Optional sampler top-k log-probs per token (score centering).
    pub sampler_topk: Option<TokenLists>,
    /// Optional sampling mask per token (top-k / top-p / min-p candidate set).
    pub sampling_mask: Option<TokenLists>,
}

impl Sample {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether the sample has no tokens (never true for a validated sample).
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    /// Number of trained tokens (loss terms).
    pub fn num_trained(&self) -> usize {
        self.completion_mask.iter().filter(|&&m| m != 0).count()
    }

    /// Check lengths, mask values and ragged lists; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let sample_id = self.sample_id;
        let n = self.input_ids.len();
        if n == 0 {
            return Err(PackError::EmptySample { sample_id });
        }
        for (field, got) in [
            ("completion_mask", self.completion_mask.len()),
            ("sampler_logprobs", self.sampler_logprobs.len()),
        ] {
            if got != n {
                return Err(PackError::LengthMismatch {
                    sample_id,
                    field,
                    expected: n,
                    got,
                });
            }
        }
        if let Some((position, &value)) = self
            .completion_mask
            .iter()
            .enumerate()
            .find(|(_, &m)| m != 0 && m != 1)
        {
            return Err(PackError::BadMask {
                sample_id,
                position,
                value,
            });
        }
        if self.completion_mask[0] != 0 {
            return Err(PackError::FirstTokenTrained { sample_id });
        }
        if self.num_trained() == 0 {
            return Err(PackError::NoTrainedToken { sample_id });
        }
        if let Some(t) = &self.sampler_topk {
            t.validate(sample_id, "sampler_topk", n)?;
        }
        if let Some(m) = &self.sampling_mask {
            m.validate(sample_id, "sampling_mask", n)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample(ids: &[i32], mask: &[i8]) -> Sample {
        Sample {
            input_ids: ids.to_vec(),
            completion_mask: mask.to_vec(),
            sampler_logprobs: vec![-0.5; ids.len()],
            ..Default::default()
        }
    }

    #[test]
    fn validate_names_the_field() {
        let mut s = sample(&[1, 2, 3], &[0, 1, 1]);
        assert!(s.validate().is_ok());
        s.sampler_logprobs.pop();
        let err = s.validate().unwrap_err().to_string();
        assert!(err.contains("sampler_logprobs"), "{err}");
        assert!(matches!(
            sample(&[], &[]).validate(),
            Err(PackError::EmptySample { .. })
        ));
        assert!(matches!(
            sample(&[1, 2], &[0, 0]).validate(),
            Err(PackError::NoTrainedToken { .. })
        ));
        assert!(matches!(
            sample(&[1, 2], &[1, 1]).validate(),
            Err(PackError::FirstTokenTrained { .. })
        ));
        assert!(matches!(
            sample(&[1, 2], &[0, 2]).validate(),
            Err(PackError::BadMask { .. })
        ));
    }

    #[test]
    fn token_lists_offsets_are_checked() {
        let mut s = sample(&[1, 2], &[0, 1]);
        s.sampler_topk = Some(TokenLists {
            offsets: vec![0, 0, 2],
            ids: vec![5, 6],
            logprobs: Some(vec![-1.0, -2.0]),
        });
        assert!(s.validate().is_ok());
        s.sampler_topk.as_mut().unwrap().offsets = vec![0, 3, 2];
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("sampler_topk"));
    }
}
