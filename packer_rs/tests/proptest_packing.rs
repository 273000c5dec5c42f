//! Property tests of the packing core: layout invariants of packed rows, the
//! batcher's placement guarantees, and exact Arrow round trips.

use packer_rs::{arrow, Sample, TokenBudgetBatcher, TokenLists, TreeRow};
use proptest::prelude::*;

/// Samples drawn from a few shared prompts, with small vocabularies so that
/// completions collide and fork at random depths.
fn samples_strategy() -> impl Strategy<Value = Vec<Sample>> {
    let prompts = prop::collection::vec(prop::collection::vec(0i32..4, 1..6), 1..4);
    (
        prompts,
        prop::collection::vec(
            (
                0usize..4,
                prop::collection::vec(0i32..3, 1..8),
                any::<bool>(),
            ),
            1..24,
        ),
    )
        .prop_map(|(prompts, specs)| {
            specs
                .into_iter()
                .enumerate()
                .map(|(i, (p, completion, topk))| {
                    let prompt = &prompts[p % prompts.len()];
                    let ids: Vec<i32> = prompt.iter().chain(&completion).copied().collect();
                    let mask = (0..ids.len())
                        .map(|t| i8::from(t >= prompt.len()))
                        .collect();
                    let sampler_topk = topk.then(|| TokenLists {
                        offsets: (0..=ids.len() as u32).collect(),
                        ids: ids.iter().map(|t| t + 1).collect(),
                        logprobs: Some(ids.iter().map(|&t| -(t as f32)).collect()),
                    });
                    Sample {
                        sample_id: i as i64,
                        group_id: (p % prompts.len()) as i64,
                        prompt_index: p as i64,
                        sampler_logprobs: (0..ids.len()).map(|t| -(t as f32) - i as f32).collect(),
                        input_ids: ids,
                        completion_mask: mask,
                        advantage: i as f32 - 3.0,
                        policy_version: (i % 3) as i32,
                        sampler_topk,
                        sampling_mask: None,
                    }
                })
                .collect()
        })
}

/// The ancestors (and self) of packed position `q`, from the root down.
fn ancestors(subtree_end: &[i32], q: usize) -> Vec<usize> {
    (0..=q).filter(|&j| q < subtree_end[j] as usize).collect()
}

fn check_row(row: &TreeRow) -> Result<(), TestCaseError> {
    let p = row.pack();
    let n = p.input_ids.len();
    prop_assert!(n <= p.num_raw);
    for q in 0..n {
        let anc = ancestors(&p.subtree_end, q);
        prop_assert_eq!(anc.len() as i32 - 1, p.position_ids[q], "position is depth");
    }
    // Every trained token appears once, predicted at the end of its own prefix.
    let mut m = 0;
    for (i, s) in row.samples().iter().enumerate() {
        for t in 1..s.len() {
            if s.completion_mask[t] == 0 {
                continue;
            }
            let q = p.token_index[m] as usize;
            let prefix: Vec<i32> = ancestors(&p.subtree_end, q)
                .iter()
                .map(|&j| p.input_ids[j])
                .collect();
            prop_assert_eq!(&prefix[..], &s.input_ids[..t]);
            prop_assert_eq!(p.target_id[m], s.input_ids[t]);
            prop_assert_eq!(p.sampler_logprob[m], s.sampler_logprobs[t]);
            prop_assert_eq!(p.advantage[m], s.advantage);
            prop_assert_eq!(p.sample_index[m], i as i32);
            m += 1;
        }
    }
    prop_assert_eq!(m, p.token_index.len());
    // Segment key paths are exactly the ancestors of the segment's last token.
    for w in 0..p.cu_seqlens_q.len() - 1 {
        let last = p.cu_seqlens_q[w + 1] as usize - 1;
        let keys: Vec<usize> = p.kv_index
            [p.cu_seqlens_k[w] as usize..p.cu_seqlens_k[w + 1] as usize]
            .iter()
            .map(|&k| k as usize)
            .collect();
        prop_assert_eq!(keys, ancestors(&p.subtree_end, last));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn packed_rows_keep_every_sample_exact(samples in samples_strategy()) {
        let mut row = TreeRow::new();
        for s in samples {
            row.add(s, usize::MAX).unwrap();
        }
        check_row(&row)?;
    }

    #[test]
    fn batcher_places_every_sample_once_within_budget(
        samples in samples_strategy(), ranks in 1i64..5, budget in 1i64..40,
    ) {
        let run = |samples: &[Sample]| {
            let mut b = TokenBudgetBatcher::new(ranks, budget).unwrap();
            let mut mbs = Vec::new();
            for s in samples {
                if let (_, Some(rows)) = b.push(s.clone()).unwrap() {
                    mbs.push((rows, false));
                }
            }
            if let Some(rows) = b.finish() {
                mbs.push((rows, true));
            }
            (mbs, b.dropped_oversize_count())
        };
        let (mbs, dropped) = run(&samples);
        let mut seen: Vec<i64> = Vec::new();
        for (rows, last) in &mbs {
            prop_assert_eq!(rows.len(), ranks as usize);
            prop_assert!(*last || rows.iter().all(|r| !r.is_empty()), "closed micro-batch with an empty row");
            for r in rows {
                prop_assert!(r.num_forwarded() <= budget as usize && r.num_trained() <= budget as usize);
                seen.extend(r.samples().iter().map(|s| s.sample_id));
                check_row(r)?;
            }
        }
        let oversize: Vec<i64> = samples.iter().filter(|s| s.len() > budget as usize).map(|s| s.sample_id).collect();
        prop_assert_eq!(dropped as usize, oversize.len());
        seen.extend(oversize);
        seen.sort_unstable();
        prop_assert_eq!(seen, (0..samples.len() as i64).collect::<Vec<_>>());
        // Deterministic for a given input order.
        let again = run(&samples).0;
        let shape = |m: &Vec<(Vec<TreeRow>, bool)>| m.iter().map(|(rows, _)| rows.iter().map(|r| r.pack()).collect::<Vec<_>>()).collect::<Vec<_>>();
        prop_assert_eq!(shape(&mbs), shape(&again));
    }

    #[test]
    fn arrow_round_trip_is_exact(samples in samples_strategy()) {
        let batch = arrow::encode(&samples).unwrap();
        prop_assert_eq!(arrow::decode(&batch).unwrap(), samples.clone());
        let sliced = batch.slice(1.min(batch.num_rows()), batch.num_rows() - 1.min(batch.num_rows()));
        prop_assert_eq!(arrow::decode(&sliced).unwrap(), samples[1.min(samples.len())..].to_vec());
    }
}

#[test]
fn ipc_file_round_trip() {
    let dir = std::env::temp_dir().join(format!("packer_rs_ipc_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("samples.arrow");
    let samples: Vec<Sample> = (0..3)
        .map(|i| Sample {
            sample_id: i,
            input_ids: vec![1, 2, i as i32],
            completion_mask: vec![0, 1, 1],
            sampler_logprobs: vec![0.0, -0.5, -1.5],
            sampling_mask: (i == 1).then(|| TokenLists {
                offsets: vec![0, 0, 2, 3],
                ids: vec![4, 5, 6],
                logprobs: None,
            }),
            ..Default::default()
        })
        .collect();
    arrow::write_ipc(&path, &samples).unwrap();
    assert_eq!(arrow::read_ipc(&path).unwrap(), samples);
    let err = arrow::read_ipc(&dir.join("missing.arrow"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing.arrow"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
