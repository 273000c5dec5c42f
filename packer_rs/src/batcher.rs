//! The token-budget batcher: streams samples into one open row per
//! data-parallel rank and closes a micro-batch when the next sample has no
//! good place (DESIGN.md §5, token-budget batcher).

use crate::error::{PackError, Result};
use crate::sample::Sample;
use crate::trie::{Placement, TreeRow};

/// What the batcher did with one sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Placed in row `rank` of the open micro-batch.
    Placed { rank: usize },
    /// The open micro-batch was closed first; the sample opened the next one.
    Closed { rank: usize },
    /// Longer than the token budget: fits no row, dropped and counted.
    Dropped,
}

/// Streams samples into `num_ranks` open rows under a token budget.
///
/// Placement of each sample, in order:
/// 1. a row that already holds its group, if it fits there (the least loaded
///    of those, ties to the lowest rank): its prompt is already forwarded;
/// 2. else the fitting row whose load would be smallest with it, if some
///    rank's row is still empty, or if placing it does not raise the largest
///    row load (which sets the micro-batch's time) by more than its share of
///    the work, `added_load / num_ranks`: the time it would cost in the next
///    micro-batch if that one is balanced. With one rank this fills the row to
///    the budget; with many it keeps rows balanced;
/// 3. else the micro-batch closes and the sample opens the next one in rank 0.
///
/// "Fits" counts only tokens new to the row's trie against the budget, and the
/// row's trained tokens against the same budget. Samples longer than the budget
/// are dropped and counted. The result is deterministic for a given input order.
///
/// Every micro-batch closed because of a sample has all `num_ranks` rows
/// non-empty: an empty row always takes a sample that is not oversize. Only the
/// final, partial micro-batch returned by [`finish`](Self::finish) can have
/// empty rows, when the stream ended with fewer samples than ranks; the trainer
/// then gives those ranks a dummy row with no loss term so that collectives stay
/// in step.
#[derive(Debug)]
pub struct TokenBudgetBatcher {
    num_ranks: usize,
    token_budget: usize,
    rows: Vec<TreeRow>,
    dropped_oversize: u64,
}

impl TokenBudgetBatcher {
    /// A batcher for `num_ranks` ranks and rows of at most `token_budget` tokens.
    ///
    /// Errors: [`PackError::BadRanks`], [`PackError::BadBudget`].
    pub fn new(num_ranks: i64, token_budget: i64) -> Result<Self> {
        if num_ranks < 1 {
            return Err(PackError::BadRanks(num_ranks));
        }
        if token_budget < 1 {
            return Err(PackError::BadBudget(token_budget));
        }
        let num_ranks = num_ranks as usize;
        Ok(Self {
            num_ranks,
            token_budget: token_budget as usize,
            rows: (0..num_ranks)
                .map(|_| TreeRow::with_capacity((token_budget as usize).min(1 << 16)))
                .collect(),
            dropped_oversize: 0,
        })
    }

    /// Ranks (rows per micro-batch).
    pub fn num_ranks(&self) -> usize {
        self.num_ranks
    }
    /// The token budget of a row.
    pub fn token_budget(&self) -> usize {
        self.token_budget
    }
    /// Samples dropped because they were longer than the budget.
    pub fn dropped_oversize_count(&self) -> u64 {
        self.dropped_oversize
    }
    /// The open rows.
    pub fn rows(&self) -> &[TreeRow] {
        &self.rows
    }

    /// Place one sample; returns what happened and, when a micro-batch closed,
    /// its rows (one per rank).
    ///
    /// Errors: the sample's validation error; the batcher is unchanged then.
    pub fn push(&mut self, sample: Sample) -> Result<(Outcome, Option<Vec<TreeRow>>)> {
        sample.validate()?;
        Ok(self.push_validated(sample))
    }

    /// [`push`](Self::push) for a sample that already passed [`Sample::validate`]
    /// (e.g. decoded from Arrow, which validates).
    pub fn push_validated(&mut self, sample: Sample) -> (Outcome, Option<Vec<TreeRow>>) {
        if sample.len() > self.token_budget {
            self.dropped_oversize += 1;
            return (Outcome::Dropped, None);
        }
        if let Some((rank, placement)) = self.choose_row(&sample) {
            self.rows[rank].push_placed(sample, placement);
            return (Outcome::Placed { rank }, None);
        }
        let fresh = self.fresh_rows();
        let closed = std::mem::replace(&mut self.rows, fresh);
        self.rows[0].push(sample);
        (Outcome::Closed { rank: 0 }, Some(closed))
    }

    fn fresh_rows(&self) -> Vec<TreeRow> {
        (0..self.num_ranks)
            .map(|_| TreeRow::with_capacity(self.token_budget.min(1 << 16)))
            .collect()
    }

    /// Close the stream: the last micro-batch if any row holds a sample.
    pub fn finish(&mut self) -> Option<Vec<TreeRow>> {
        if self.rows.iter().all(TreeRow::is_empty) {
            return None;
        }
        let fresh = self.fresh_rows();
        Some(std::mem::replace(&mut self.rows, fresh))
    }

    /// The rank the sample goes to and its placement there, or `None` when
    /// the micro-batch must close.
    fn choose_row(&self, sample: &Sample) -> Option<(usize, Placement)> {
        let budget = self.token_budget;
        // 1. A row of its own group, least loaded first.
        let home = self
            .rows
            .iter()
            .enumerate()
            .filter(|(_, r)| r.holds_group(sample.group_id))
            .filter_map(|(i, r)| r.fits(sample, budget).map(|p| ((r.load(), i), p)))
            .min_by_key(|(key, _)| *key);
        if let Some(((_, rank), p)) = home {
            return Some((rank, p));
        }
        // 2. The row whose load stays smallest, under the conditions above.
        let ((new_load, rank), p) = self
            .rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| {
                r.fits(sample, budget)
                    .map(|p| ((r.load() + p.added_load, i), p))
            })
            .min_by_key(|(key, _)| *key)?;
        let any_empty = self.rows.iter().any(TreeRow::is_empty);
        let max_load = self.rows.iter().map(TreeRow::load).max().unwrap_or(0);
        // Raising the largest load by its share of the new work (added ÷ ranks)
        // costs no more than sending it to the next micro-batch would.
        let ranks = self.num_ranks as u64;
        (any_empty || new_load * ranks <= max_load * ranks + p.added_load).then_some((rank, p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(id: i64, group: i64, ids: &[i32]) -> Sample {
        let mut mask = vec![1i8; ids.len()];
        mask[0] = 0;
        Sample {
            sample_id: id,
            group_id: group,
            input_ids: ids.to_vec(),
            completion_mask: mask,
            sampler_logprobs: vec![-1.0; ids.len()],
            ..Default::default()
        }
    }

    #[test]
    fn rejects_bad_arguments() {
        assert_eq!(
            TokenBudgetBatcher::new(0, 10).unwrap_err(),
            PackError::BadRanks(0)
        );
        assert_eq!(
            TokenBudgetBatcher::new(2, 0).unwrap_err(),
            PackError::BadBudget(0)
        );
    }

    #[test]
    fn group_stays_together_and_new_groups_fill_empty_ranks() {
        let mut b = TokenBudgetBatcher::new(2, 100).unwrap();
        assert_eq!(
            b.push(s(0, 7, &[1, 2, 3, 4])).unwrap().0,
            Outcome::Placed { rank: 0 }
        );
        assert_eq!(
            b.push(s(1, 7, &[1, 2, 3, 5])).unwrap().0,
            Outcome::Placed { rank: 0 }
        );
        assert_eq!(
            b.push(s(2, 8, &[9, 2, 3, 5])).unwrap().0,
            Outcome::Placed { rank: 1 }
        );
        assert_eq!(b.rows()[0].num_forwarded(), 5);
        let rows = b.finish().unwrap();
        assert_eq!(rows.len(), 2);
        assert!(b.finish().is_none());
    }

    #[test]
    fn oversize_is_dropped_and_counted() {
        let mut b = TokenBudgetBatcher::new(1, 3).unwrap();
        assert_eq!(b.push(s(0, 0, &[1, 2, 3, 4])).unwrap().0, Outcome::Dropped);
        assert_eq!(b.dropped_oversize_count(), 1);
        assert!(b.finish().is_none());
    }

    #[test]
    fn closes_when_no_row_fits() {
        let mut b = TokenBudgetBatcher::new(1, 6).unwrap();
        b.push(s(0, 0, &[1, 2, 3, 4])).unwrap();
        let (outcome, closed) = b.push(s(1, 1, &[5, 6, 7])).unwrap();
        assert_eq!(outcome, Outcome::Closed { rank: 0 });
        assert_eq!(closed.unwrap()[0].samples().len(), 1);
        assert_eq!(b.rows()[0].samples()[0].sample_id, 1);
    }

    #[test]
    fn does_not_raise_the_largest_load_once_all_ranks_are_busy() {
        let mut b = TokenBudgetBatcher::new(2, 100).unwrap();
        b.push(s(0, 0, &[1, 2, 3, 4, 5, 6])).unwrap(); // load 21
        b.push(s(1, 1, &[7, 8])).unwrap(); // rank 1, load 3
                                           // 3 + (1+..+5) = 18 <= 21: goes to rank 1.
        assert_eq!(
            b.push(s(2, 2, &[9, 9, 9, 9, 9])).unwrap().0,
            Outcome::Placed { rank: 1 }
        );
        // rank 1 would reach 18 + 21 > 21, rank 0 42 > 21: close.
        assert_eq!(
            b.push(s(3, 3, &[4, 4, 4, 4, 4, 4])).unwrap().0,
            Outcome::Closed { rank: 0 }
        );
    }

    #[test]
    fn one_rank_fills_its_row_to_the_budget() {
        let mut b = TokenBudgetBatcher::new(1, 12).unwrap();
        for g in 0..3 {
            assert_eq!(
                b.push(s(g, g, &[g as i32 + 10, 1, 2, 3])).unwrap().0,
                Outcome::Placed { rank: 0 }
            );
        }
        assert_eq!(b.rows()[0].num_forwarded(), 12);
        assert_eq!(
            b.push(s(3, 3, &[20, 1])).unwrap().0,
            Outcome::Closed { rank: 0 }
        );
    }
}
