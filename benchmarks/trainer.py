"""Trainer throughput on one GPU: tree rows vs plain padding-free rows from the same samples.

A Qwen3-0.6B-shaped random model (bf16) runs forward + backward of the GRPO loss
over micro-batches of one row each (token budget 16384, rows padded to the budget
so FlexAttention compiles once). Tree rows come from the packer (prompts shared
by the G rollouts of a group are forwarded once); plain rows hold the same
samples back to back with block-diagonal causal attention (nothing shared).
``--check`` first verifies, in fp32, that every trained token's log-prob from a
packed row equals the sample run alone (random Qwen3- and Llama-shaped models).

Usage (GPU)::

    python benchmarks/trainer.py --json            # tree vs plain, Qwen3-0.6B shape
    python benchmarks/trainer.py --check --json    # equivalence figure first
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from grpo_core.packing import PackedRow, Sample, get_packer
from grpo_core.packing.base import ROW_PARTS
from grpo_core.train.attention import TREE_ATTENTION, FlexTreeMasks, register_tree_attention
from grpo_core.train.loss import LossSettings, grpo_loss
from grpo_core.train.parallelize import apply_layer_wrappers
from grpo_core.train.policy import Policy
from grpo_core.train.rows import to_tensors

#: Qwen3-0.6B's shape (config.json of Qwen/Qwen3-0.6B).
TINY = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=32, max_position_embeddings=4096)
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 tie_word_embeddings=True)
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s (H100/H200 SXM datasheet)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    """Wait for queued GPU work (no-op on CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def prepare(row: PackedRow, length: int, flex: FlexTreeMasks | None):
    """A row's tensors padded to ``length``; a FlexAttention block mask on CUDA, a dense mask on CPU."""
    rt = to_tensors(row, DEVICE, length)
    if flex is not None:
        rt.tree_mask = flex.build(rt.tree_mask.subtree_end, length)
    return rt


def workload(num_groups: int, group_size: int, vocab: int, seed: int = 0, prompt_len: int = 1024,
             completion_len: tuple[int, int] = (128, 1024)) -> list[Sample]:
    """GRPO groups: ``prompt_len``-token prompts, completions of uniform length in ``completion_len``."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num_groups):
        prompt = rng.integers(0, vocab, prompt_len)
        for _ in range(group_size):
            completion = rng.integers(0, vocab, int(rng.integers(completion_len[0], completion_len[1] + 1)))
            ids = np.concatenate([prompt, completion]).astype(np.int32)
            mask = np.r_[np.zeros(prompt_len, np.int8), np.ones(len(completion), np.int8)]
            lp = np.where(mask == 1, -rng.exponential(1.0, len(mask)), 0).astype(np.float32)
            out.append(Sample(sample_id=len(out), group_id=g, prompt_index=g, input_ids=ids, completion_mask=mask,
                              sampler_logprobs=lp, advantage=float(rng.normal())))
    return out


def plain_rows(samples: list[Sample], budget: int) -> list[PackedRow]:
    """Samples back to back (first fit in order), each attending to itself only."""
    import pyarrow as pa

    rows, cur = [], []
    for s in samples:
        if cur and sum(c.num_tokens for c in cur) + s.num_tokens > budget:
            rows.append(cur)
            cur = []
        cur.append(s)
    rows.append(cur)
    packed = []
    for row in rows:
        starts = np.cumsum([0] + [s.num_tokens for s in row])
        ids = np.concatenate([s.input_ids for s in row])
        pos = np.concatenate([np.arange(s.num_tokens) for s in row]).astype(np.int32)
        end = np.concatenate([np.full(s.num_tokens, starts[i + 1]) for i, s in enumerate(row)]).astype(np.int32)
        t = [np.nonzero(s.completion_mask)[0] for s in row]
        cols = {
            "input_ids": ids, "position_ids": pos, "subtree_end": end,
            "cu_seqlens_q": starts.astype(np.int32), "cu_seqlens_k": starts.astype(np.int32),
            "kv_index": np.arange(len(ids), dtype=np.int32),
            "token_index": np.concatenate([starts[i] + t[i] - 1 for i in range(len(row))]).astype(np.int32),
            "target_id": np.concatenate([s.input_ids[t[i]] for i, s in enumerate(row)]),
            "sampler_logprob": np.concatenate([s.sampler_logprobs[t[i]] for i, s in enumerate(row)]),
            "advantage": np.concatenate([np.full(len(t[i]), s.advantage, np.float32) for i, s in enumerate(row)]),
            "sample_index": np.concatenate([np.full(len(t[i]), i, np.int32) for i in range(len(row))]),
            "sample_id": np.array([s.sample_id for s in row]), "group_id": np.array([s.group_id for s in row]),
            "prompt_index": np.array([s.prompt_index for s in row]),
            "policy_version": np.zeros(len(row), np.int32),
            "num_tokens": np.array([s.num_tokens for s in row], np.int32),
            "num_trained": np.array([s.num_trained for s in row], np.int32),
        }
        parts = {p: pa.record_batch({n: cols[n] for n in names}) for p, names in ROW_PARTS.items()}
        packed.append(PackedRow(**parts, num_forwarded=len(ids), num_trained=len(cols["token_index"]),
                                num_raw=len(ids), num_samples=len(row), load=0))
    return packed


def tree_rows(samples: list[Sample], budget: int) -> list[PackedRow]:
    """One-rank micro-batches of the rust packer."""
    from grpo_core.packing import samples_to_arrow

    b = get_packer("rust").batcher(1, budget)
    return [mb[0] for mb in b.push(samples_to_arrow(samples)) + b.finish()]


def model(shape: dict, dtype: torch.dtype, arch: str = "qwen3") -> Policy:
    """A random model with tree attention, wrapped as the trainer's Policy."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    register_tree_attention()
    cfg = (Qwen3Config if arch == "qwen3" else LlamaConfig)(**shape)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg, attn_implementation=TREE_ATTENTION, dtype=dtype)
    return Policy(lm, chunk_size=2048).to(DEVICE)


def run_rows(policy: Policy, rows: list[PackedRow], budget: int, flex: FlexTreeMasks | None) -> dict:
    """Forward + backward of every row; times each one (synchronised), mask building excluded."""
    times, forwarded, trained = [], 0, 0
    for row in rows:
        rt = prepare(row, budget, flex)
        sync()
        t0 = time.perf_counter()
        out = policy.logprobs(rt)
        loss, _ = grpo_loss(out.logprobs, rt.sampler_logprob, rt.advantage, float(rt.num_terms),
                            LossSettings(score_centering=False))
        loss.backward()
        sync()
        times.append(time.perf_counter() - t0)
        forwarded += row.num_forwarded
        trained += row.num_trained
    return {"seconds": sum(times), "forwarded": forwarded, "trained": trained,
            "raw": sum(r.num_raw for r in rows), "rows": len(rows)}


def benchmark(args: argparse.Namespace) -> list[dict]:
    """Tree vs plain rows on the Qwen3-0.6B shape (``--tiny``: a small shape for a CPU smoke run)."""
    shape = TINY if args.tiny else QWEN3_06B
    policy = model(shape, torch.bfloat16 if DEVICE.type == "cuda" else torch.float32)
    if args.compile:
        apply_layer_wrappers(policy, compile_layers=True)
    n_params = sum(p.numel() for p in policy.parameters())
    lengths = dict(prompt_len=64, completion_len=(8, 64)) if args.tiny else {}
    samples = workload(args.groups, args.group_size, shape["vocab_size"], **lengths)
    flex = FlexTreeMasks(DEVICE) if DEVICE.type == "cuda" else None
    results = []
    for kind, rows in (("plain", plain_rows(samples, args.budget)), ("tree", tree_rows(samples, args.budget))):
        run_rows(policy, rows[:2], args.budget, flex)  # compile + warm up
        policy.zero_grad(set_to_none=True)
        r = run_rows(policy, rows, args.budget, flex)
        s = r["seconds"]
        results.append({
            "rows": kind, "compiled": args.compile, "num_rows": r["rows"], "samples": len(samples), "fwd_bwd_s": s,
            "forwarded_tokens_per_s": r["forwarded"] / s, "raw_tokens_per_s": r["raw"] / s,
            "trained_tokens_per_s": r["trained"] / s, "packing_ratio": r["raw"] / r["forwarded"],
            "mfu": 6 * n_params * r["forwarded"] / s / H200_BF16_PEAK,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else None,
        })
    return results


def equivalence() -> dict:
    """fp32 max |packed − alone| trained-token log-prob, FlexAttention on CUDA (SDPA mask on CPU)."""
    out = {}
    for arch in ("qwen3", "llama"):
        shape = TINY if arch == "qwen3" else {k: v for k, v in TINY.items() if k != "head_dim"}
        policy = model(shape, torch.float32, arch)
        samples = workload(3, 4, shape["vocab_size"], seed=1, prompt_len=64, completion_len=(16, 128))
        row = get_packer("rust").pack_row(samples, 4096)
        length = -(-row.num_forwarded // 128) * 128
        rt = prepare(row, length, FlexTreeMasks(DEVICE) if DEVICE.type == "cuda" else None)
        base = policy.base()
        with torch.no_grad():
            packed = policy.logprobs(rt).logprobs
            worst = 0.0
            base.config._attn_implementation = "sdpa"
            for i, s in enumerate(samples):
                ids = torch.as_tensor(s.input_ids, dtype=torch.long, device=DEVICE)[None]
                logp = torch.log_softmax(base(input_ids=ids).logits[0].float(), -1)
                t = torch.as_tensor(np.nonzero(s.completion_mask)[0], device=DEVICE)
                alone = logp[t - 1, ids[0, t]]
                mine = packed[torch.as_tensor(row.column("sample_index") == i, device=DEVICE)]
                worst = max(worst, (mine - alone).abs().max().item())
            base.config._attn_implementation = TREE_ATTENTION
        out[arch] = worst
    return {"check": "packed_vs_alone_fp32_max_abs_diff", "device": DEVICE.type, **out}


def main() -> None:
    """CLI."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=24)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--check", action="store_true", help="run the fp32 equivalence check first")
    p.add_argument("--tiny", action="store_true", help="small model and samples (CPU smoke run)")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (as the trainer does on CUDA)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    results = ([equivalence()] if args.check else []) + benchmark(args)
    for r in results:
        print(json.dumps(r) if args.json else r)


if __name__ == "__main__":
    main()
