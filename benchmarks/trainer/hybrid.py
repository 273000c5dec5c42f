"""Trainer throughput of a Gated DeltaNet hybrid on one GPU: tree rows vs plain rows, Qwen3.5-2B shape.

A random model of Qwen3.5-2B's language-model shape (24 layers, 18 Gated DeltaNet + 6 gated
full-attention, hidden 2048; bf16) runs forward + backward of the GRPO loss over one-row
micro-batches of the same GRPO samples, packed two ways (``benchmarks/trainer/workload.py``'s workload and
row builders): tree rows from the packer (a group's prompt forwarded once; the DeltaNet layers follow
the trie) and plain padding-free rows (every sample its own root segment). ``--check`` first
measures, in fp32 on the same device, max |packed − alone| over every trained token's log-prob of a
random Qwen3.5-shaped model with group-shared prompts and two-turn forks. The Gated DeltaNet
kernel is FLA's when the ``fla`` package is importable, else transformers' PyTorch reference
(reported as ``gdn_kernel``).

Usage (GPU)::

    python -m benchmarks.trainer.hybrid --check --json
    python -m benchmarks.trainer.hybrid --tiny --check     # CPU smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import numpy as np
import torch

from grpo_core.models import qwen3_5_config, random_model
from grpo_core.packing import Sample, get_packer
from grpo_core.train.attention import TREE_ATTENTION, FlexTreeMasks, register_tree_attention
from grpo_core.train.policy import Policy
from grpo_core.train.recurrent import install_tree_recurrence

from .workload import DEVICE, H200_BF16_PEAK, plain_rows, prepare, run_rows, sync, tree_rows, workload

#: Qwen3.5-2B's language model (Qwen/Qwen3.5-2B config.json, text_config).
QWEN35_2B = dict(
    vocab_size=248320,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    tie_word_embeddings=True,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
)
TINY = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    max_position_embeddings=8192,
)


def model(shape: dict, dtype: torch.dtype) -> Policy:
    """A random Qwen3.5 language model with tree attention and tree recurrence, as the trainer's Policy."""
    register_tree_attention()
    lm = random_model(qwen3_5_config(shape), seed=0, init_dtype=dtype, attn_implementation=TREE_ATTENTION)
    install_tree_recurrence(lm)
    return Policy(lm, chunk_size=2048).to(DEVICE)


def gdn_kernel() -> str:
    """Which chunked delta-rule kernel transformers resolved: ``fla`` (Triton) or ``torch`` (reference)."""
    return "fla" if importlib.util.find_spec("fla") is not None else "torch"


def benchmark(args: argparse.Namespace) -> list[dict]:
    """Tree vs plain rows (``--tiny``: a small shape and short samples for a CPU smoke run)."""
    shape = TINY if args.tiny else QWEN35_2B
    policy = model(shape, torch.bfloat16 if DEVICE.type == "cuda" else torch.float32)
    if args.gradient_checkpointing:
        policy.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(p.numel() for p in policy.parameters())
    lengths = dict(prompt_len=64, completion_len=(8, 64)) if args.tiny else {}
    samples = workload(args.groups, args.group_size, shape["vocab_size"], **lengths)
    flex = FlexTreeMasks(DEVICE) if DEVICE.type == "cuda" else None
    results = []
    for kind, rows in (("plain", plain_rows(samples, args.budget)), ("tree", tree_rows(samples, args.budget))):
        run_rows(policy, rows[:1], args.budget, flex)  # warm up
        policy.zero_grad(set_to_none=True)
        if DEVICE.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        r = run_rows(policy, rows, args.budget, flex)
        s = r["seconds"]
        results.append(
            {
                "model": "qwen3.5-2b-shape" if not args.tiny else "qwen3.5-tiny",
                "rows": kind,
                "gdn_kernel": gdn_kernel(),
                "num_rows": r["rows"],
                "samples": len(samples),
                "fwd_bwd_s": s,
                "forwarded_tokens_per_s": r["forwarded"] / s,
                "raw_tokens_per_s": r["raw"] / s,
                "trained_tokens_per_s": r["trained"] / s,
                "packing_ratio": r["raw"] / r["forwarded"],
                "mfu": 6 * n_params * r["forwarded"] / s / H200_BF16_PEAK,
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else None,
            }
        )
    return results


def _forks(rng, vocab: int) -> list[Sample]:
    """Two groups sharing a system prompt; forks at random depths, some past the 64-token kernel chunk;
    a two-turn conversation continuing one sample and another forking after its tool result."""
    system, samples = rng.integers(0, vocab, 40).tolist(), []
    for g in range(2):
        prompt = system + rng.integers(0, vocab, 30).tolist()
        for _ in range(4):
            completion = rng.integers(0, vocab, int(rng.integers(5, 150))).tolist()
            samples.append(
                Sample.build(
                    prompt + completion, [0] * len(prompt) + [1] * len(completion), sample_id=len(samples), group_id=g
                )
            )
    tool = rng.integers(0, vocab, 12).tolist()
    for _ in range(2):
        turn = rng.integers(0, vocab, int(rng.integers(5, 80))).tolist()
        first = samples[1]
        samples.append(
            Sample.build(
                list(first.input_ids) + tool + turn,
                list(first.completion_mask) + [0] * 12 + [1] * len(turn),
                sample_id=len(samples),
                group_id=0,
            )
        )
    return samples


def equivalence() -> dict:
    """fp32 max |packed − alone| trained-token log-prob of a random Qwen3.5-shaped model on this device."""
    policy = model(TINY, torch.float32)
    samples = _forks(np.random.default_rng(1), TINY["vocab_size"])
    row = get_packer("rust").pack_row(samples, 8192)
    length = -(-row.num_forwarded // 128) * 128
    rt = prepare(row, length, FlexTreeMasks(DEVICE) if DEVICE.type == "cuda" else None)
    base = policy.base()
    worst = 0.0
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        packed = policy.logprobs(rt).logprobs
        sync()
        seconds = time.perf_counter() - t0
        base.config._attn_implementation = "sdpa"
        for i, s in enumerate(samples):
            ids = torch.as_tensor(s.input_ids, dtype=torch.long, device=DEVICE)[None]
            logp = torch.log_softmax(base(input_ids=ids).logits[0].float(), -1)
            t = torch.as_tensor(np.nonzero(s.completion_mask)[0], device=DEVICE)
            mine = packed[torch.as_tensor(row.column("sample_index") == i, device=DEVICE)]
            worst = max(worst, (mine - logp[t - 1, ids[0, t]]).abs().max().item())
        base.config._attn_implementation = TREE_ATTENTION
    return {
        "check": "qwen3.5_packed_vs_alone_fp32_max_abs_diff",
        "device": DEVICE.type,
        "gdn_kernel": gdn_kernel(),
        "max_abs_diff": worst,
        "trained_tokens": row.num_trained,
        "packing_ratio": row.packing_ratio,
        "packed_forward_s": seconds,
    }


def main() -> None:
    """CLI."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.trainer.hybrid", description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--check", action="store_true", help="run the fp32 equivalence check first")
    p.add_argument("--tiny", action="store_true", help="small model and samples (CPU smoke run)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute each decoder layer in backward")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    results = ([equivalence()] if args.check else []) + benchmark(args)
    for r in results:
        print(json.dumps(r) if args.json else r)


if __name__ == "__main__":
    main()
