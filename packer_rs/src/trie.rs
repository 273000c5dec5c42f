//! A row: the samples one data-parallel rank forwards in one micro-batch, folded
//! into a prefix trie so that a token shared by several samples is forwarded once.
//!
//! Layout (DESIGN.md §5, tree packing): the trie is laid out depth first
//! (pre-order, children in insertion order), `position_ids` = depth, and each
//! token attends to its ancestors and itself only. Sharing is across every
//! sample of the row: the rollouts of a group, and any common prefix across
//! groups (a shared system prompt). A node is keyed on its parent and token
//! alone, so samples share every token of their common prefix; each loss term
//! carries its own target id, so a node may predict different targets for
//! different samples.

use rustc_hash::{FxHashMap, FxHashSet};

use crate::error::{PackError, Result};
use crate::sample::Sample;

const NONE: u32 = u32::MAX;

/// How a sample would land in a row: tokens already there and the load it adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Leading tokens of the sample already present in the trie.
    pub shared: usize,
    /// Tokens the sample adds to the row (forwarded tokens).
    pub new_tokens: usize,
    /// Attention cost the sample adds: sum over its new tokens of depth + 1.
    pub added_load: u64,
    /// Node of the last shared token (`u32::MAX` when nothing is shared).
    pub last_shared_node: u32,
}

/// One rank's row under construction. See the module docs.
#[derive(Debug, Default, Clone)]
pub struct TreeRow {
    tokens: Vec<i32>,
    num_children: Vec<u32>,
    first_child: Vec<u32>,
    last_child: Vec<u32>,
    next_sibling: Vec<u32>,
    parent: Vec<u32>,
    roots: Vec<u32>,
    /// Children of nodes with two or more children (and roots when there are
    /// several), keyed by (parent or NONE, token). Unary chains never hash: the
    /// lookup checks the first child first.
    edges: FxHashMap<(u32, i32), u32>,
    samples: Vec<Sample>,
    /// Trie node of each sample's last token; its ancestors are the sample.
    sample_ends: Vec<u32>,
    groups: FxHashSet<i64>,
    num_trained: usize,
    num_raw: usize,
    load: u64,
}

/// A packed row: flat arrays ready for the forward pass and the loss.
///
/// Sizes: `N` forwarded tokens, `S` segments (maximal unary chains of the
/// trie), `K` = total length of the root-to-segment-end paths, `M` loss terms.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PackedRow {
    /// `[N]` token id of each forwarded position.
    pub input_ids: Vec<i32>,
    /// `[N]` depth in the trie = position in every sample that contains it.
    pub position_ids: Vec<i32>,
    /// `[N]` end (exclusive) of each position's subtree: key `j` is visible to
    /// query `q` iff `j <= q < subtree_end[j]`.
    pub subtree_end: Vec<i32>,
    /// `[S + 1]` segment boundaries in the row (varlen queries).
    pub cu_seqlens_q: Vec<i32>,
    /// `[S + 1]` boundaries of each segment's key path in `kv_index`.
    pub cu_seqlens_k: Vec<i32>,
    /// `[K]` packed positions of every segment's root-to-end path, laid end to end.
    pub kv_index: Vec<i32>,
    /// `[M]` packed position whose output predicts each trained token.
    pub token_index: Vec<i32>,
    /// `[M]` the trained token id.
    pub target_id: Vec<i32>,
    /// `[M]` sampler log-prob of the trained token.
    pub sampler_logprob: Vec<f32>,
    /// `[M]` advantage of the sample the term comes from.
    pub advantage: Vec<f32>,
    /// `[M]` index (in the row's sample order) of the sample the term comes from.
    pub sample_index: Vec<i32>,
    /// Sampler top-k per loss term (CSR, offsets `[M + 1]`), when any sample has it.
    pub sampler_topk: Option<crate::sample::TokenLists>,
    /// Sampling mask per loss term (CSR, offsets `[M + 1]`), when any sample has it.
    pub sampling_mask: Option<crate::sample::TokenLists>,
    /// Sum of the samples' lengths (tokens before packing).
    pub num_raw: usize,
    /// Attention cost of the row: sum over forwarded tokens of depth + 1.
    pub load: u64,
}

impl PackedRow {
    /// Forwarded tokens `N`.
    pub fn num_forwarded(&self) -> usize {
        self.input_ids.len()
    }
    /// Loss terms `M`.
    pub fn num_trained(&self) -> usize {
        self.token_index.len()
    }
}

impl TreeRow {
    /// An empty row.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty row with room for `num_tokens` forwarded tokens without reallocating.
    pub fn with_capacity(num_tokens: usize) -> Self {
        let v = || Vec::<u32>::with_capacity(num_tokens);
        Self {
            tokens: Vec::with_capacity(num_tokens),
            num_children: v(),
            first_child: v(),
            last_child: v(),
            next_sibling: v(),
            parent: v(),
            edges: FxHashMap::with_capacity_and_hasher(num_tokens / 4, Default::default()),
            ..Self::default()
        }
    }

    /// Forwarded (unique) tokens in the row.
    pub fn num_forwarded(&self) -> usize {
        self.tokens.len()
    }
    /// Trained tokens (loss terms) in the row.
    pub fn num_trained(&self) -> usize {
        self.num_trained
    }
    /// Sum of the samples' lengths.
    pub fn num_raw(&self) -> usize {
        self.num_raw
    }
    /// Attention cost: sum over forwarded tokens of depth + 1.
    pub fn load(&self) -> u64 {
        self.load
    }
    /// The samples, in the order they were added.
    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }
    /// Whether the row holds no sample.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
    /// Whether a sample of `group_id` is in the row.
    pub fn holds_group(&self, group_id: i64) -> bool {
        self.groups.contains(&group_id)
    }

    fn child(&self, parent: u32, token: i32) -> Option<u32> {
        let (first, count) = if parent == NONE {
            (
                self.roots.first().copied().unwrap_or(NONE),
                self.roots.len() as u32,
            )
        } else {
            (
                self.first_child[parent as usize],
                self.num_children[parent as usize],
            )
        };
        if first == NONE {
            return None;
        }
        if self.tokens[first as usize] == token {
            return Some(first);
        }
        if count < 2 {
            return None;
        }
        self.edges.get(&(parent, token)).copied()
    }

    /// Where `sample` would land, without changing the row.
    pub fn placement(&self, sample: &Sample) -> Placement {
        let mut node = NONE;
        let mut shared = 0;
        for &token in &sample.input_ids {
            match self.child(node, token) {
                Some(c) => {
                    node = c;
                    shared += 1;
                }
                None => break,
            }
        }
        let n = sample.len() as u64;
        let s = shared as u64;
        Placement {
            shared,
            new_tokens: sample.len() - shared,
            added_load: (n * (n + 1) - s * (s + 1)) / 2,
            last_shared_node: node,
        }
    }

    /// The placement of `sample` if the row stays within `budget` forwarded
    /// tokens and `budget` trained tokens with it added, else `None`.
    pub fn fits(&self, sample: &Sample, budget: usize) -> Option<Placement> {
        if self.num_trained + sample.num_trained() > budget {
            return None;
        }
        let p = self.placement(sample);
        (self.tokens.len() + p.new_tokens <= budget).then_some(p)
    }

    /// Add `sample` (already validated) unconditionally.
    pub fn push(&mut self, sample: Sample) {
        let p = self.placement(&sample);
        self.push_placed(sample, p);
    }

    /// Add `sample` (already validated) at `placement`, computed on this row
    /// since its last change: the shared prefix is not walked again.
    pub fn push_placed(&mut self, sample: Sample, placement: Placement) {
        let mut parent = placement.last_shared_node;
        for (depth, &token) in sample.input_ids.iter().enumerate().skip(placement.shared) {
            parent = self.new_node(parent, token, depth);
        }
        self.sample_ends.push(parent);
        self.num_trained += sample.num_trained();
        self.num_raw += sample.len();
        self.groups.insert(sample.group_id);
        self.samples.push(sample);
    }

    /// Validate `sample` and add it if it fits `budget`.
    ///
    /// Errors: the sample's own validation error, or [`PackError::DoesNotFit`].
    pub fn add(&mut self, sample: Sample, budget: usize) -> Result<()> {
        sample.validate()?;
        if self.fits(&sample, budget).is_none() {
            let p = self.placement(&sample);
            return Err(PackError::DoesNotFit {
                sample_id: sample.sample_id,
                needed: p.new_tokens,
                trained: sample.num_trained(),
                room_forwarded: budget.saturating_sub(self.tokens.len()),
                room_trained: budget.saturating_sub(self.num_trained),
            });
        }
        self.push(sample);
        Ok(())
    }

    fn new_node(&mut self, parent: u32, token: i32, depth: usize) -> u32 {
        let id = self.tokens.len() as u32;
        self.tokens.push(token);
        self.num_children.push(0);
        self.first_child.push(NONE);
        self.last_child.push(NONE);
        self.next_sibling.push(NONE);
        self.parent.push(parent);
        // The first child is found without hashing; siblings go to the map,
        // and the first one joins them when the second arrives.
        let siblings = if parent == NONE {
            self.roots.len()
        } else {
            self.num_children[parent as usize] as usize
        };
        if siblings == 1 {
            let first = if parent == NONE {
                self.roots[0]
            } else {
                self.first_child[parent as usize]
            };
            self.edges
                .insert((parent, self.tokens[first as usize]), first);
        }
        if siblings >= 1 {
            self.edges.insert((parent, token), id);
        }
        if parent == NONE {
            self.roots.push(id);
        } else {
            let p = parent as usize;
            self.num_children[p] += 1;
            match self.last_child[p] {
                NONE => self.first_child[p] = id,
                last => self.next_sibling[last as usize] = id,
            }
            self.last_child[p] = id;
        }
        self.load += depth as u64 + 1;
        id
    }

    /// Lay the trie out depth first and collect the loss terms. See [`PackedRow`].
    pub fn pack(&self) -> PackedRow {
        let n = self.tokens.len();
        let mut out = PackedRow {
            num_raw: self.num_raw,
            load: self.load,
            ..Default::default()
        };
        out.input_ids.reserve(n);
        out.position_ids.reserve(n);
        let mut packed = vec![0u32; n];
        let mut path: Vec<i32> = Vec::new();
        out.cu_seqlens_q.push(0);
        out.cu_seqlens_k.push(0);
        let mut stack: Vec<(u32, u32)> = self.roots.iter().rev().map(|&r| (r, 0)).collect();
        let mut children: Vec<u32> = Vec::new();
        while let Some((node, depth)) = stack.pop() {
            let pos = out.input_ids.len() as i32;
            packed[node as usize] = pos as u32;
            out.input_ids.push(self.tokens[node as usize]);
            out.position_ids.push(depth as i32);
            path.truncate(depth as usize);
            path.push(pos);
            if self.num_children[node as usize] != 1 {
                out.cu_seqlens_q.push(pos + 1);
                out.kv_index.extend_from_slice(&path);
                out.cu_seqlens_k.push(out.kv_index.len() as i32);
            }
            children.clear();
            let mut c = self.first_child[node as usize];
            while c != NONE {
                children.push(c);
                c = self.next_sibling[c as usize];
            }
            stack.extend(children.iter().rev().map(|&c| (c, depth + 1)));
        }
        out.subtree_end = self.subtree_ends(&packed);
        self.collect_loss_terms(&packed, &mut out);
        out
    }

    /// `subtree_end` in packed order. A child's node id is always larger than its
    /// parent's (nodes are created root first), so one reverse sweep sums sizes.
    fn subtree_ends(&self, packed: &[u32]) -> Vec<i32> {
        let n = self.tokens.len();
        let mut size = vec![1u32; n];
        for v in (0..n).rev() {
            let mut c = self.first_child[v];
            while c != NONE {
                size[v] += size[c as usize];
                c = self.next_sibling[c as usize];
            }
        }
        let mut end = vec![0i32; n];
        for v in 0..n {
            end[packed[v] as usize] = (packed[v] + size[v]) as i32;
        }
        end
    }

    fn collect_loss_terms(&self, packed: &[u32], out: &mut PackedRow) {
        let with_topk = self.samples.iter().any(|s| s.sampler_topk.is_some());
        let with_mask = self.samples.iter().any(|s| s.sampling_mask.is_some());
        let mut topk = with_topk.then(|| lists(true));
        let mut mask = with_mask.then(|| lists(false));
        out.token_index.reserve(self.num_trained);
        let mut nodes: Vec<u32> = Vec::new();
        for (i, (s, &end)) in self.samples.iter().zip(&self.sample_ends).enumerate() {
            nodes.clear();
            let mut v = end;
            while v != NONE {
                nodes.push(v);
                v = self.parent[v as usize];
            }
            nodes.reverse();
            debug_assert_eq!(nodes.len(), s.len());
            for t in 1..s.len() {
                if s.completion_mask[t] == 0 {
                    continue;
                }
                out.token_index.push(packed[nodes[t - 1] as usize] as i32);
                out.target_id.push(s.input_ids[t]);
                out.sampler_logprob.push(s.sampler_logprobs[t]);
                out.advantage.push(s.advantage);
                out.sample_index.push(i as i32);
                if let Some(dst) = topk.as_mut() {
                    append_entry(dst, s.sampler_topk.as_ref(), t);
                }
                if let Some(dst) = mask.as_mut() {
                    append_entry(dst, s.sampling_mask.as_ref(), t);
                }
            }
        }
        out.sampler_topk = topk;
        out.sampling_mask = mask;
    }
}

fn lists(with_logprobs: bool) -> crate::sample::TokenLists {
    crate::sample::TokenLists {
        offsets: vec![0],
        ids: Vec::new(),
        logprobs: with_logprobs.then(Vec::new),
    }
}

/// Append token `t`'s entry of `src` (an empty entry when the sample has none).
fn append_entry(
    dst: &mut crate::sample::TokenLists,
    src: Option<&crate::sample::TokenLists>,
    t: usize,
) {
    if let Some(src) = src {
        let (ids, logprobs) = src.entry(t);
        dst.ids.extend_from_slice(ids);
        if let Some(d) = dst.logprobs.as_mut() {
            match logprobs {
                Some(l) => d.extend_from_slice(l),
                None => d.extend(std::iter::repeat_n(f32::NAN, ids.len())),
            }
        }
    }
    dst.offsets.push(dst.ids.len() as u32);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(id: i64, group: i64, ids: &[i32], trained_from: usize) -> Sample {
        let mask = (0..ids.len())
            .map(|i| i8::from(i >= trained_from))
            .collect();
        Sample {
            sample_id: id,
            group_id: group,
            input_ids: ids.to_vec(),
            completion_mask: mask,
            sampler_logprobs: (0..ids.len()).map(|i| -(i as f32) / 10.0).collect(),
            advantage: id as f32,
            ..Default::default()
        }
    }

    #[test]
    fn shares_prefixes_across_groups_and_lays_out_depth_first() {
        let mut row = TreeRow::new();
        row.add(s(0, 0, &[1, 2, 3, 4, 5], 2), 100).unwrap();
        row.add(s(1, 0, &[1, 2, 3, 6, 7], 2), 100).unwrap();
        row.add(s(2, 1, &[9, 2], 1), 100).unwrap();
        let p = row.pack();
        assert_eq!(p.input_ids, vec![1, 2, 3, 4, 5, 6, 7, 9, 2]);
        assert_eq!(p.position_ids, vec![0, 1, 2, 3, 4, 3, 4, 0, 1]);
        assert_eq!(p.subtree_end, vec![7, 7, 7, 5, 5, 7, 7, 9, 9]);
        assert_eq!(p.cu_seqlens_q, vec![0, 3, 5, 7, 9]);
        assert_eq!(
            p.kv_index,
            vec![0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8]
        );
        assert_eq!(p.cu_seqlens_k, vec![0, 3, 8, 13, 15]);
        assert_eq!(p.token_index, vec![1, 2, 3, 1, 2, 5, 7]);
        assert_eq!(p.target_id, vec![3, 4, 5, 3, 6, 7, 2]);
        assert_eq!(p.sample_index, vec![0, 0, 0, 1, 1, 1, 2]);
        assert_eq!(p.advantage, vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0]);
        assert_eq!((p.num_forwarded(), p.num_trained(), p.num_raw), (9, 7, 12));
        // load: 1+2+3+4+5 for sample 0, 4+5 for sample 1's new tokens, 1+2 for sample 2.
        assert_eq!(p.load, 15 + 9 + 3);
    }

    #[test]
    fn a_sample_that_is_a_prefix_of_another_shares_all_its_tokens() {
        let mut row = TreeRow::new();
        row.add(s(0, 0, &[1, 2, 3, 4], 1), 100).unwrap();
        row.add(s(1, 0, &[1, 2, 3], 1), 100).unwrap();
        let p = row.pack();
        assert_eq!(p.input_ids, vec![1, 2, 3, 4]);
        assert_eq!(p.token_index, vec![0, 1, 2, 0, 1]);
        assert_eq!(p.cu_seqlens_q, vec![0, 4]);
    }

    #[test]
    fn fits_counts_new_tokens_and_trained_tokens() {
        let mut row = TreeRow::new();
        row.add(s(0, 0, &[1, 2, 3, 4], 1), 6).unwrap();
        // 2 new tokens, 3 trained: forwarded 6 <= 6 but trained 6 <= 6 as well.
        let p = row.fits(&s(1, 0, &[1, 2, 5, 6], 1), 6).unwrap();
        assert_eq!((p.shared, p.new_tokens, p.added_load), (2, 2, 3 + 4));
        // 4 trained: 3 + 4 > 6.
        assert!(row.fits(&s(2, 0, &[1, 2, 3, 4, 5], 1), 6).is_none());
        let err = row.add(s(3, 0, &[7, 8, 9], 1), 5).unwrap_err();
        assert!(matches!(err, PackError::DoesNotFit { .. }), "{err}");
    }
}
