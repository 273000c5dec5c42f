"""Packing benchmark: the rust and python backends (and TRL 1.16's packer, when
installed) plan and pack the same synthetic GRPO workloads under one token budget.

Timed: planning + packing together, through the public ``grpo_core.packing`` API
(samples pushed as Arrow record batches, then ``finish``), so FFI and Arrow
conversion costs count. Sample generation and Arrow encoding are not timed.

Usage::

    .venv/bin/python benchmarks/packing.py            # rich table, < 3 min on 2 cores
    .venv/bin/python benchmarks/packing.py --json     # one JSON object per backend per workload
    .venv/bin/python benchmarks/packing.py --input samples.arrow   # Sample-schema Arrow IPC file
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import psutil
import pyarrow as pa

from grpo_core.packing import Sample, get_packer, read_samples_ipc, samples_from_arrow, samples_to_arrow

VOCAB = 32_000


def _sample(ids: list[np.ndarray], trained: list[bool], rng: np.random.Generator, **meta) -> Sample:
    """A sample from pieces of token ids; ``trained[i]`` marks piece ``i`` as completion."""
    input_ids = np.concatenate(ids).astype(np.int32)
    mask = np.concatenate([np.full(len(p), int(t), np.int8) for p, t in zip(ids, trained)])
    logprobs = np.where(mask == 1, -rng.exponential(1.0, len(mask)), 0.0).astype(np.float32)
    return Sample(input_ids=input_ids, completion_mask=mask, sampler_logprobs=logprobs, **meta)


def _tokens(rng: np.random.Generator, low: int, high: int) -> np.ndarray:
    return rng.integers(0, VOCAB, rng.integers(low, high + 1), dtype=np.int32)


def make_grpo_workload(num_groups: int, group_size: int, system_prompt_len: int, seed: int) -> list[Sample]:
    """Single-turn GRPO groups: a prompt and ``group_size`` independent completions.

    Args:
        num_groups: groups (prompts).
        group_size: rollouts per group (G).
        system_prompt_len: tokens of a system prompt shared by every group (0: none).
        seed: random seed; the same seed gives the same samples.

    Returns:
        ``num_groups * group_size`` samples; prompts of 256-1024 tokens (after the
        system prompt), completions of 64-2048 tokens, uniform lengths.
    """
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_prompt_len, system_prompt_len)
    samples = []
    for g in range(num_groups):
        prompt = np.concatenate([system, _tokens(rng, 256, 1024)])
        advantages = rng.standard_normal(group_size).astype(np.float32)
        for k in range(group_size):
            samples.append(
                _sample(
                    [prompt, _tokens(rng, 64, 2048)],
                    [False, True],
                    rng,
                    sample_id=len(samples),
                    group_id=g,
                    prompt_index=g,
                    advantage=float(advantages[k]),
                )
            )
    return samples


def make_multiturn_workload(num_groups: int, group_size: int, seed: int) -> list[Sample]:
    """Multi-turn tool-use groups whose samples fork mid-conversation.

    Each rollout has 2-4 turns (reasoning 64-512 tokens + answer 16-128, then a
    tool output of 32-256 untrained tokens). It yields one sample per turn: the
    prompt, the earlier turns with their reasoning stripped (as chat templates do),
    and this turn in full (trained). So a rollout's samples share the prompt and
    the conversation so far, and fork where the latest turn's reasoning begins.

    Args:
        num_groups: groups (prompts, 256-1024 tokens).
        group_size: rollouts per group (G).
        seed: random seed.

    Returns:
        about ``3 * num_groups * group_size`` samples.
    """
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(num_groups):
        prompt = _tokens(rng, 256, 1024)
        advantages = rng.standard_normal(group_size).astype(np.float32)
        for k in range(group_size):
            history: list[np.ndarray] = [prompt]
            for _ in range(rng.integers(2, 5)):
                reasoning, answer = _tokens(rng, 64, 512), _tokens(rng, 16, 128)
                samples.append(
                    _sample(
                        [*history, reasoning, answer],
                        [False] * len(history) + [True, True],
                        rng,
                        sample_id=len(samples),
                        group_id=g,
                        prompt_index=g,
                        advantage=float(advantages[k]),
                    )
                )
                history += [answer, _tokens(rng, 32, 256)]
    return samples


class PeakRss:
    """Peak resident set size above the starting one, sampled every 5 ms by psutil."""

    def __init__(self) -> None:
        self._proc = psutil.Process(os.getpid())
        self._stop = threading.Event()
        self.start_bytes = self.peak_bytes = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak_bytes = max(self.peak_bytes, self._proc.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._proc.memory_info().rss)

    @property
    def peak_mb(self) -> float:
        """Peak RSS increase in MiB."""
        return (self.peak_bytes - self.start_bytes) / 2**20


def pack_with_grpo_flow(backend: str, batches: Sequence[pa.RecordBatch], num_ranks: int, token_budget: int):
    """Push every Arrow batch into a batcher of ``backend``, then finish.

    Returns:
        ``(rows, dropped_oversize_count, num_partial)``: ``rows`` is one list of
        ``(forwarded, raw, load, num_samples)`` per micro-batch; the last
        ``num_partial`` (0 or 1) micro-batches come from ``finish``.
    """
    batcher = get_packer(backend).batcher(num_ranks, token_budget)
    micro_batches = []
    for batch in batches:
        micro_batches += batcher.push(batch)
    last = batcher.finish()
    rows = [[(r.num_forwarded, r.num_raw, r.load, r.num_samples) for r in mb] for mb in micro_batches + last]
    return rows, batcher.dropped_oversize_count, len(last)


def trl_available() -> bool:
    """Whether TRL 1.16.0's async GRPO packer can be imported (imports it, outside any timing)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        import trl
        from trl.experimental.async_grpo import async_grpo_trainer  # noqa: F401
    except ImportError:
        return False
    return trl.__version__ == "1.16.0"


def to_trl_samples(samples: Sequence[Sample]) -> list[dict]:
    """Sample dicts as TRL's ``TokenBudgetBatcher`` reads them (torch tensors)."""
    import torch

    return [
        {
            "input_ids": torch.from_numpy(s.input_ids.astype(np.int64)),
            "completion_mask": torch.from_numpy(s.completion_mask.astype(np.int64)),
            "old_log_probs": torch.from_numpy(s.sampler_logprobs),
            "advantage": s.advantage,
            "group_id": s.group_id,
        }
        for s in samples
    ]


def pack_with_trl(samples: Sequence[dict], num_ranks: int, token_budget: int):
    """TRL 1.16 ``TokenBudgetBatcher`` planning and ``TreeRow.pack`` of every row.

    TRL never emits its last partial micro-batch, so its rows cover fewer samples.

    Returns:
        ``(rows, dropped_oversize_count)`` as :func:`pack_with_grpo_flow`.
    """
    from collections import defaultdict

    from trl.experimental.async_grpo.async_grpo_trainer import TokenBudgetBatcher

    metrics: dict[str, list] = defaultdict(list)
    rows = []
    for mb in TokenBudgetBatcher(samples, num_ranks, token_budget, metrics):
        for row in mb:
            row.pack()
        rows.append([(len(r.tokens), sum(len(s["input_ids"]) for s in r.samples), r.load, len(r.samples)) for r in mb])
    return rows, len(metrics["batch/dropped_oversize_total"]), 0


def summarize(rows: list[list[tuple]], dropped: int, num_partial: int, seconds: float, token_budget: int) -> dict:
    """Aggregate packing figures over all micro-batches.

    Returns:
        ``samples``; ``raw_tokens``; ``raw_tokens_per_s`` and ``samples_per_s``
        (over the timed planning + packing); ``packing_ratio`` (total raw ÷ total
        forwarded tokens); ``row_fill_frac`` (mean over rows of forwarded ÷
        budget); ``row_imbalance`` (mean over micro-batches of max ÷ mean row
        load, 1.0 = balanced); ``rows``; ``dropped_oversize_count``; and
        ``packing_ratio_closed`` / ``row_imbalance_closed`` over the micro-batches
        closed mid-stream only (what TRL emits: it drops its last partial one),
        None when none closed.
    """
    flat = [r for mb in rows for r in mb]
    raw = sum(r[1] for r in flat)
    samples = sum(r[3] for r in flat)
    imbalance = [max(r[2] for r in mb) / (sum(r[2] for r in mb) / len(mb)) for mb in rows]
    closed = [r for mb in rows[: len(rows) - num_partial] for r in mb]
    return {
        "samples": samples,
        "raw_tokens": raw,
        "raw_tokens_per_s": raw / seconds,
        "samples_per_s": samples / seconds,
        "packing_ratio": raw / max(sum(r[0] for r in flat), 1),
        "row_fill_frac": float(np.mean([r[0] / token_budget for r in flat])),
        "row_imbalance": float(np.mean(imbalance)),
        "rows": len(flat),
        "dropped_oversize_count": dropped,
        "packing_ratio_closed": sum(r[1] for r in closed) / sum(r[0] for r in closed) if closed else None,
        "row_imbalance_closed": float(np.mean(imbalance[: len(rows) - num_partial])) if closed else None,
    }


def measure(run: Callable[[], tuple], token_budget: int, repeat: int = 1) -> dict:
    """Time ``run`` (planning + packing) ``repeat`` times and watch its peak RSS.

    Returns:
        :func:`summarize` of its rows at the median time, plus ``seconds`` (that
        median) and ``peak_rss_mb`` (the largest peak RSS increase, MiB).
    """
    seconds, peak_mb = [], 0.0
    for _ in range(repeat):
        with PeakRss() as rss:
            start = time.perf_counter()
            rows, dropped, num_partial = run()
            seconds.append(time.perf_counter() - start)
        peak_mb = max(peak_mb, rss.peak_mb)
    median = float(np.median(seconds))
    return summarize(rows, dropped, num_partial, median, token_budget) | {"seconds": median, "peak_rss_mb": peak_mb}


def groups_prefix(samples: Sequence[Sample], num_groups: int) -> list[Sample]:
    """The samples of the first ``num_groups`` distinct groups, in stream order."""
    keep: set[int] = set()
    out = []
    for s in samples:
        if s.group_id not in keep and len(keep) >= num_groups:
            continue
        keep.add(s.group_id)
        out.append(s)
    return out


def bench_workload(name: str, samples: list[Sample], args: argparse.Namespace) -> list[dict]:
    """Run every backend on ``samples``; the python reference on the first ``args.python_groups`` groups."""
    subsets = {"rust": samples, "python": groups_prefix(samples, args.python_groups)}
    results = []
    for backend, subset in subsets.items():
        batches = [samples_to_arrow(subset[i : i + args.batch_size]) for i in range(0, len(subset), args.batch_size)]
        if backend == "rust":  # warm-up (first-call allocations), untimed
            pack_with_grpo_flow(backend, batches[:2], args.ranks, args.budget)
        repeat = args.rust_repeat if backend == "rust" else 1
        res = measure(
            lambda backend=backend, batches=batches: pack_with_grpo_flow(backend, batches, args.ranks, args.budget),
            args.budget,
            repeat,
        )
        results.append({"workload": name, "backend": backend} | res)
    if trl_available() and not args.no_trl:
        trl_samples = to_trl_samples(groups_prefix(samples, args.trl_groups))
        res = measure(lambda: pack_with_trl(trl_samples, args.ranks, args.budget), args.budget)
        results.append({"workload": name, "backend": "trl-1.16"} | res)
    return results


def load_workloads(args: argparse.Namespace) -> dict[str, list[Sample]]:
    """The synthetic workloads, or the samples of ``--input``."""
    if args.input:
        return {os.path.basename(args.input): samples_from_arrow(read_samples_ipc(args.input))}
    n, g, seed = args.groups, args.group_size, args.seed
    return {
        "grpo": make_grpo_workload(n, g, 0, seed),
        "grpo+system": make_grpo_workload(n, g, 512, seed + 1),
        "multiturn": make_multiturn_workload(n, g, seed + 2),
    }


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    """A rich table of the results, with the speed-up of rust over each backend."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Packing: token budget {args.budget}, {args.ranks} ranks, seed {args.seed}")
    for col in (
        "workload",
        "backend",
        "samples",
        "raw tokens",
        "raw tok/s",
        "samples/s",
        "rust ×",
        "packing ratio",
        "(closed)",
        "row fill",
        "row imbalance",
        "(closed)",
        "rows",
        "dropped",
        "peak RSS MiB",
    ):
        table.add_column(col, justify="left" if col in ("workload", "backend") else "right")
    rust = {r["workload"]: r["raw_tokens_per_s"] for r in results if r["backend"] == "rust"}
    for r in results:
        table.add_row(
            r["workload"],
            r["backend"],
            f"{r['samples']:,}",
            f"{r['raw_tokens']:,}",
            f"{r['raw_tokens_per_s']:,.0f}",
            f"{r['samples_per_s']:,.0f}",
            f"{rust[r['workload']] / r['raw_tokens_per_s']:.0f}×",
            f"{r['packing_ratio']:.3f}",
            _fmt(r["packing_ratio_closed"]),
            f"{r['row_fill_frac']:.3f}",
            f"{r['row_imbalance']:.3f}",
            _fmt(r["row_imbalance_closed"]),
            str(r["rows"]),
            str(r["dropped_oversize_count"]),
            f"{r['peak_rss_mb']:.1f}",
        )
    Console(width=220).print(table)
    print(
        f"python runs the first {args.python_groups} groups of each workload and TRL the first {args.trl_groups} "
        "(see `samples`); TRL never emits its last partial micro-batch, so its figures omit it; "
        "(closed): rust/python figures over the micro-batches closed mid-stream only, like TRL's. "
        f"Timed: planning + packing (Arrow push + finish; TRL: TokenBudgetBatcher + TreeRow.pack); rust: median of "
        f"{args.rust_repeat} runs after an untimed warm-up, python and TRL: one run. "
        "peak RSS: increase over the RSS at the start of the run, sampled every 5 ms (psutil) in this process."
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run every workload and print the table or JSON lines."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", help="Arrow IPC file of the Sample schema (replaces the synthetic workloads)")
    p.add_argument("--json", action="store_true", help="print one JSON object per backend per workload")
    p.add_argument("--groups", type=int, default=200, help="groups per synthetic workload")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per group (G)")
    p.add_argument("--python-groups", type=int, default=50, help="groups the slow python reference packs")
    p.add_argument("--trl-groups", type=int, default=200, help="groups TRL packs")
    p.add_argument("--rust-repeat", type=int, default=5, help="timed rust runs; the median is reported")
    p.add_argument("--no-trl", action="store_true", help="skip TRL even when it is installed")
    p.add_argument("--budget", type=int, default=16384, help="token budget of a row (tokens)")
    p.add_argument("--ranks", type=int, default=8, help="data-parallel ranks (rows per micro-batch)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per pushed Arrow record batch")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", module="trl")
    results = []
    for name, samples in load_workloads(args).items():
        results += bench_workload(name, samples, args)
    if args.json:
        for r in results:
            print(json.dumps(r))
    else:
        print_table(results, args)


if __name__ == "__main__":
    main()
