"""The trainer benchmarks' shared workload: model shapes, GRPO samples, tree and plain rows, timing, tables, JSON.

Imported by ``python -m benchmarks.trainer`` (``sweep``, ``ranks``) and ``python -m benchmarks.trainer.hybrid``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from grpo_core.packing import PackedRow, Sample, TokenLists, get_packer
from grpo_core.packing.base import ROW_PARTS
from grpo_core.train.loss import LossSettings
from grpo_core.train.rows import to_tensors

#: Model shapes (config.json of the Qwen/Qwen3-* checkpoints; weights random).
SHAPES = {
    "tiny": dict(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    "0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "1.7b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "4b": dict(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
#: Activation checkpointing per shape in ``auto`` mode: 4B's eager activations at 16k tokens outgrow 141 GB.
AUTO_CHECKPOINTING = {"4b": "selective"}
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s (H100/H200 SXM datasheet)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def qwen3_config(shape: str):
    """A ``Qwen3Config`` of one of :data:`SHAPES` (tied embeddings, as the small Qwen3 checkpoints)."""
    from transformers import Qwen3Config

    return Qwen3Config(**SHAPES[shape], max_position_embeddings=40960, tie_word_embeddings=True)


def sync() -> None:
    """Wait for queued device work (no-op on CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def workload(
    num_groups: int,
    group_size: int,
    vocab: int,
    prompt_len: int = 1024,
    completion_len: tuple[int, int] = (128, 1024),
    topk: int = 8,
    seed: int = 0,
) -> list[Sample]:
    """GRPO groups: one ``prompt_len`` prompt per group, completions of uniform length in ``completion_len``,
    sampler log-probs and (``topk`` > 0) top-k ids and log-probs per token.

    Sampler log-probs sit near ``-log(vocab)``, where a randomly initialised model's are, so that most
    importance ratios fall inside the MIS range and the loss and its gradient are not trivially zero.
    """
    rng = np.random.default_rng(seed)
    uniform = -float(np.log(vocab))
    out = []
    for g in range(num_groups):
        prompt = rng.integers(0, vocab, prompt_len)
        for _ in range(group_size):
            completion = rng.integers(0, vocab, int(rng.integers(completion_len[0], completion_len[1] + 1)))
            ids = np.concatenate([prompt, completion]).astype(np.int32)
            mask = np.r_[np.zeros(prompt_len, np.int8), np.ones(len(completion), np.int8)]
            lp = np.where(mask == 1, uniform + rng.normal(0.0, 0.3, len(mask)), 0).astype(np.float32)
            s = Sample(
                sample_id=len(out),
                group_id=g,
                prompt_index=g,
                input_ids=ids,
                completion_mask=mask,
                sampler_logprobs=lp,
                advantage=float(rng.normal()),
            )
            if topk:
                top_ids = rng.integers(0, vocab, (len(ids), topk)).astype(np.int32)
                top_lp = np.sort(uniform + rng.normal(0.0, 0.3, (len(ids), topk)), 1)[:, ::-1].astype(np.float32)
                s.sampler_topk = TokenLists(
                    np.arange(len(ids) + 1, dtype=np.int32) * topk, top_ids.ravel(), top_lp.ravel()
                )
            out.append(s)
    return out


def packer_name() -> str:
    """``rust`` when packer_rs imports, else the python reference backend (same rows)."""
    try:
        get_packer("rust")
        return "rust"
    except Exception:  # noqa: BLE001 - no native extension on this machine: the reference packer is exact too
        return "python"


def tree_rows(samples: list[Sample], budget: int) -> list[PackedRow]:
    """One-rank micro-batches of the packer: prefix-trie rows."""
    b = get_packer(packer_name()).batcher(1, budget)
    return [mb[0] for mb in b.push(_arrow(samples)) + b.finish()]


def _arrow(samples):
    from grpo_core.packing import samples_to_arrow

    return samples_to_arrow(samples)


def plain_rows(samples: list[Sample], budget: int) -> list[PackedRow]:
    """Samples back to back (first fit in order), each attending to itself only: each sample packed alone
    as a one-sample trie, rows concatenated."""
    packer = get_packer(packer_name())
    rows, cur, n = [], [], 0
    for s in samples:
        if cur and n + s.num_tokens > budget:
            rows.append(cur)
            cur, n = [], 0
        cur.append(s)
        n += s.num_tokens
    rows.append(cur)
    return [_concat([packer.pack_row([s], budget) for s in row]) for row in rows]


def _concat(parts: list[PackedRow]) -> PackedRow:
    """Rows side by side: positions and subtree ends shifted, sample indices renumbered."""
    import pyarrow as pa

    offsets = np.cumsum([0] + [p.num_forwarded for p in parts])
    shift = {"subtree_end": "tok", "kv_index": "tok", "token_index": "tok", "sample_index": "sample"}
    batches = {}
    for part in ROW_PARTS:
        cols = {}
        for name in getattr(parts[0], part).schema.names:
            arrays = []
            for i, p in enumerate(parts):
                col = getattr(p, part).column(name)
                if name in shift and not pa.types.is_list(col.type):
                    a = col.to_numpy()
                    arrays.append(pa.array(a + (offsets[i] if shift[name] == "tok" else i)).cast(col.type))
                elif name in ("cu_seqlens_q", "cu_seqlens_k"):
                    a = col.to_numpy()
                    arrays.append(pa.array((a if i == 0 else a[1:]) + offsets[i]).cast(col.type))
                else:
                    arrays.append(col)
            cols[name] = pa.concat_arrays(arrays)
        batches[part] = pa.record_batch(cols)
    return PackedRow(
        **batches,
        num_forwarded=int(offsets[-1]),
        num_trained=sum(p.num_trained for p in parts),
        num_raw=sum(p.num_raw for p in parts),
        num_samples=len(parts),
        load=sum(p.load for p in parts),
    )


def prepare(row: PackedRow, length: int, flex):
    """A row's tensors on the device padded to ``length``; a FlexAttention block mask on CUDA (``flex``)."""
    rt = to_tensors(row, DEVICE, length)
    if flex is not None:
        rt.tree_mask = flex.build(rt.tree_mask.subtree_end, length)
    return rt


def step(policy, rt, settings: LossSettings) -> float:
    """Forward + backward of one row through the policy's fused head; seconds (synchronised)."""
    sync()
    t0 = time.perf_counter()
    policy.grpo_loss(rt, settings, float(max(rt.num_terms, 1))).loss.backward()
    sync()
    policy.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def run_rows(
    policy, rows: list[PackedRow], budget: int, flex, settings: LossSettings = LossSettings(score_centering=False)
) -> dict:
    """Every row padded to ``budget`` and timed alone (row building excluded: the trainer overlaps it).

    Returns:
        ``seconds`` (sum), ``step_times_s``, token totals ``forwarded`` / ``trained`` / ``raw``, ``rows``.
    """
    times = [step(policy, prepare(row, budget, flex), settings) for row in rows]
    return {
        "seconds": sum(times),
        "step_times_s": times,
        "forwarded": sum(r.num_forwarded for r in rows),
        "trained": sum(r.num_trained for r in rows),
        "raw": sum(r.num_raw for r in rows),
        "rows": len(rows),
    }


def summarise(times: list[float]) -> dict:
    """Median step and the slowest step over the median."""
    med = statistics.median(times)
    return {"median_step_s": med, "max_over_median": max(times) / med}


def write_json(out_dir: str | None, name: str, results) -> None:
    """``results`` as ``<out_dir>/<name>`` (no-op without a folder)."""
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / name).write_text(json.dumps(results, indent=1))


def print_table(results: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """A plain text table: ``columns`` = (key, header, format)."""
    rows = [
        [("" if r.get(k) is None else (f.format(r[k]) if f else str(r[k]))) for k, _, f in columns] for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, (_, h, _) in enumerate(columns)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
