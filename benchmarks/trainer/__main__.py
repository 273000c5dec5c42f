"""Trainer throughput: tree rows vs plain rows × eager vs compiled × model shapes, and 1 vs 2 GPUs.

Two commands, each one configuration of the device and well under ten minutes on H200s:

* ``sweep`` (one GPU, one process): random-weight Qwen3 shapes (0.6B, 1.7B, 4B; bf16) run
  forward + backward of the GRPO loss through the trainer's own policy (fused log-prob
  head, tree attention) over rows of the same samples: tree rows from the packer (each
  group's prompt forwarded once) and plain rows (the samples back to back, nothing
  shared), every row padded to the token budget. Eager first, then with compiled layers
  and head (the compile of the budget length is the warm-up). Per configuration:
  forwarded / raw / trained tok/s, MFU (6 × parameters × forwarded tokens ÷ time ÷ bf16
  peak, as the trainer's ``perf/fwd_bwd_mfu``), peak memory, warm-up seconds, median step
  and max/median step. A fused-head check on the device comes first (bf16 vs fp32).
* ``ranks`` (torchrun, 1 and 2 GPUs): the real trainer (``python -m grpo_core.train``:
  FSDP2, AdamW, checkpoints) on the same samples from an Arrow file, ``--resume-at``
  steps, a checkpoint, then a resumed run to ``--steps``; from ``metrics.jsonl``: steady
  trained tok/s, MFU, warm-up seconds at the start and after the resume, steps that
  compiled anything, max/median step, and the scaling of 2 ranks over 1.

Both print a table and write JSON under ``--out`` (default ``$OUT`` when set).

Usage::

    python -m benchmarks.trainer sweep                       # one H200: 0.6b,1.7b,4b × plain/tree × eager/compiled
    python -m benchmarks.trainer ranks --nproc 1,2           # two H200s (it starts torchrun itself)
    python -m benchmarks.trainer sweep --shapes tiny --budget 512 --groups 4 --steps 3   # CPU smoke run
    python -m benchmarks.trainer ranks --shape tiny --budget 512 --groups 8 --steps 4 --resume-at 3  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    """CLI."""
    from .ranks import add_ranks_args, ranks
    from .sweep import add_sweep_args, sweep

    p = argparse.ArgumentParser(prog="python -m benchmarks.trainer", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, add in (("sweep", add_sweep_args), ("ranks", add_ranks_args)):
        q = sub.add_parser(name)
        q.add_argument("--groups", type=int, default=24, help="GRPO groups in the workload")
        q.add_argument("--group-size", type=int, default=8)
        q.add_argument("--budget", type=int, default=16384, help="token budget per row")
        q.add_argument("--topk", type=int, default=8, help="sampler top-k log-probs per token (score centering)")
        q.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON results")
        q.add_argument("--json", action="store_true", help="also print the results as JSON lines")
        add(q)
    args = p.parse_args()
    t0 = time.perf_counter()
    results = (sweep if args.command == "sweep" else ranks)(args)
    if args.json:
        for r in results:
            print(json.dumps(r))
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
