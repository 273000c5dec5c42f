"""Prefix-affinity routing over 1, 2 and 3 embedded replicas: affinity hits, unmatched, spills, generated tok/s.

For each replica count N in ``--replicas`` it starts N embedded replicas (``--model``, ``--threads`` torch
threads each) through ``grpo_core.serving.launch.provision`` and sends ``--groups`` groups of G =
``--group-size`` requests through one :class:`~grpo_core.serving.replicas.ReplicaSet` (the rollout's
router), ``--groups-in-flight`` groups at a time as the rollout's concurrency cap would allow. Each group
has its own random ``--prompt-len``-token prompt; every request generates ``--max-tokens`` tokens
(``ignore_eos``, distinct seeds). Hits, unmatched and spills are fractions of all requests (the ceiling of
hits with one prefill per group is (G - 1) / G = 87.5% at G = 8); tok/s is generated tokens over the wall
time of the whole run. Goals (issue 13): hits >= 87%, spills <= 1%, and 2 replicas >= 1.8x the tok/s of one
on a host with a core per replica thread.

Usage::

    .venv/bin/python benchmarks/routing.py            # table
    .venv/bin/python benchmarks/routing.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from common import git_commit

from grpo_core.config import ModelConfig, RunConfig
from grpo_core.serving.launch import provision, teardown
from grpo_core.serving.replicas import ReplicaSet, RouteCounts


def parse_args() -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-qwen3", help="registry name or folder (default: tiny-qwen3)")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3], help="replica counts to run")
    p.add_argument("--groups", type=int, default=48, help="groups sent per replica count")
    p.add_argument("--group-size", type=int, default=8, help="G: requests per group")
    p.add_argument("--groups-in-flight", type=int, default=6, help="groups running at once")
    p.add_argument("--prompt-len", type=int, default=96, help="prompt tokens per group")
    p.add_argument("--max-tokens", type=int, default=32, help="generated tokens per request")
    p.add_argument("--route-imbalance", type=int, default=8, help="server.route_imbalance")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p.parse_args()


async def drive(rs: ReplicaSet, args: argparse.Namespace, model: str, tag: str = "run") -> tuple[int, float]:
    """Send every group (affinity key ``(tag, group)``); returns (generated tokens, wall seconds)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(args.prompt_len)] for _ in range(args.groups)]
    slots = asyncio.Semaphore(args.groups_in_flight)

    async def group(g: int) -> int:
        async with slots:
            outs = await asyncio.gather(
                *(
                    rs.complete(
                        prompts[g],
                        affinity_key=(tag, g),
                        model=model,
                        max_tokens=args.max_tokens,
                        seed=i,
                        ignore_eos=True,
                    )
                    for i in range(args.group_size)
                )
            )
            return sum(len(o[0].token_ids) for o in outs)

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(group(g) for g in range(args.groups))))
    return tokens, time.perf_counter() - start


def one(args: argparse.Namespace, num_replicas: int, log_dir: Path) -> dict:
    """Start ``num_replicas`` replicas, run the groups, stop them; one table row."""
    config = RunConfig(
        model=ModelConfig(name=args.model),
        server={
            "backend": "embedded",
            "port": 0,
            "num_replicas": num_replicas,
            "embedded_num_threads": args.threads,
            "max_model_len": args.prompt_len + args.max_tokens + 16,
            "max_num_seqs": 64,
            "log_dir": log_dir,
            "startup_timeout_s": 600,
        },
        rollout={"max_completion_length": args.max_tokens, "num_sampler_logprobs": 0},
        train={"score_centering": False},
    )
    handles = provision(config)
    try:

        async def go() -> tuple[int, float, object]:
            async with ReplicaSet([h.url for h in handles], route_imbalance=args.route_imbalance) as rs:
                warm = argparse.Namespace(**{**vars(args), "groups": num_replicas})
                await drive(rs, warm, config.served_model_name(), tag="warm-up")
                rs.policy.counts = RouteCounts()  # count the measured run only
                tokens, wall = await drive(rs, args, config.served_model_name())
                return tokens, wall, rs.policy.counts

        tokens, wall, counts = asyncio.run(go())
    finally:
        teardown(handles)
    return {
        "replicas": num_replicas,
        "requests": counts.total,
        "hit_frac": counts.hits / counts.total,
        "unmatched_frac": counts.unmatched / counts.total,
        "spill_frac": counts.spills / counts.total,
        "generated_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
    }


def main() -> None:
    """Run every replica count and print the table (or JSON)."""
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [one(args, n, Path(tmp) / f"n{n}") for n in args.replicas]
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup_vs_first"] = row["tokens_per_s"] / base
    meta = {
        "commit": git_commit(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "model": args.model,
        "group_size": args.group_size,
        "groups": args.groups,
        "groups_in_flight": args.groups_in_flight,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "threads_per_replica": args.threads,
    }
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"routing: G={args.group_size}, {args.groups} groups, {args.model}, "
        f"{args.threads} thread(s)/replica on {os.cpu_count()} CPUs, commit {meta['commit']}"
    )
    for col in ("replicas", "requests", "hits", "unmatched", "spills", "generated tok/s", "x first"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["replicas"]),
            str(r["requests"]),
            f"{r['hit_frac']:.1%}",
            f"{r['unmatched_frac']:.1%}",
            f"{r['spill_frac']:.1%}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['speedup_vs_first']:.2f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
