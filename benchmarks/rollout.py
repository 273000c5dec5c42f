"""Rollout throughput: groups/min and generated tokens/s of the rollout engine against one server.

Starts a generation server (the embedded one on CPU, by default SmolLM2-135M-Instruct), then
the rollout process (started as a run starts it) on a reasoning-gym task, and pulls every sample
through ``FlightSource`` (Arrow Flight) as a trainer that never lags would. Timed: from the
first pull to the end of the stream; server and rollout start-up are not timed. CPU seconds
of the rollout process and of the server over that window show where the time goes; the
1-minute load average says how busy the machine was (shared machines skew the figures).

Usage::

    .venv/bin/python benchmarks/rollout.py                    # table
    .venv/bin/python benchmarks/rollout.py --json             # one JSON object
    .venv/bin/python benchmarks/rollout.py --model tiny-qwen3 --num-prompts 32
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from grpo_core.config import RunConfig  # noqa: E402
from grpo_core.packing import samples_from_arrow  # noqa: E402
from grpo_core.rollout import start_rollout_process  # noqa: E402
from grpo_core.serving.vllm import provision, teardown  # noqa: E402
from grpo_core.transport.flight_client import FlightSource  # noqa: E402

from common import git_commit  # noqa: E402


def run_config(args: argparse.Namespace, log_dir: Path) -> RunConfig:
    """The benchmark's run config (embedded server on loopback, reasoning-gym prompts)."""
    return RunConfig(
        model={"name": args.model},
        server={"backend": "embedded", "port": 0, "max_model_len": args.max_model_len,
                "max_num_seqs": args.max_num_seqs,
                "embedded_num_threads": args.threads, "log_dir": log_dir, "startup_timeout_s": 600},
        rollout={"dataset": f"reasoning_gym:{args.task}", "dataset_size": args.num_prompts, "dataset_seed": 0,
                 "num_generations": args.num_generations, "max_completion_length": args.max_completion_length,
                 "num_sampler_logprobs": args.num_sampler_logprobs, "temperature": 1.0,
                 "first_step_tokens": 1 << 20, "concurrency_poll_s": 2.0},
    )


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds used so far by a process."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def measure(config: RunConfig, server_url: str, server_pid: int, run_dir: Path) -> dict:
    """Pull every sample of the run; returns the figures (CPU seconds of the rollout process and the server too)."""
    started = start_rollout_process(config, [server_url], run_dir)
    process = started.process
    source = FlightSource(started.wait_location(), max_staleness=config.rollout.max_staleness, timeout_s=600,
                          process=process, error_path=started.error_path)
    samples = trained = 0
    try:
        source.wait_running()
        source.metrics()  # starts the generated-token rate window now
        start = time.perf_counter()
        cpu_start = _cpu_s(process.pid), _cpu_s(server_pid)
        while True:
            batch = source.pull(0, timeout_s=600)
            for s in samples_from_arrow(batch.samples):
                samples += 1
                trained += s.num_trained
            if batch.exhausted:
                break
        wall_s = time.perf_counter() - start
        rollout_cpu_s, server_cpu_s = (_cpu_s(process.pid) - cpu_start[0], _cpu_s(server_pid) - cpu_start[1])
        metrics = source.metrics()
    finally:
        source.close()
    groups = metrics.get("rollout/group_count", 0.0)
    return {
        "wall_s": round(wall_s, 2),
        "groups": int(groups),
        "groups_per_min": round(groups / wall_s * 60, 2),
        "generated_tokens_per_s": round(metrics.get("rollout/generated_tokens_per_s", 0.0), 1),
        "samples": samples,
        "trained_tokens": trained,
        "completion_mean_length": round(metrics.get("completions/mean_length", 0.0), 1),
        "reward": round(metrics.get("reward", float("nan")), 3),
        "frac_reward_zero_std": round(metrics.get("frac_reward_zero_std", float("nan")), 3),
        "concurrency_cap": metrics.get("rollout/concurrency_cap"),
        "kv_cache_usage_frac": round(metrics.get("rollout/vllm_kv_cache_usage_frac", 0.0), 3),
        "rollout_process_cpu_s": round(rollout_cpu_s, 2),
        "server_cpu_s": round(server_cpu_s, 2),
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }


def print_table(result: dict) -> None:
    """A two-column table of the figures."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rollout throughput")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, str(value))
    Console().print(table)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--task", default="basic_arithmetic", help="reasoning-gym task")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--num-sampler-logprobs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads of the embedded server (1 avoids OpenMP spinning on a shared machine)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        config = run_config(args, Path(tmp))
        handles = provision(config)
        try:
            result = measure(config, handles[0].url, handles[0].process.pid, Path(tmp) / "rollout")
        finally:
            teardown(handles)
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    result = {"hardware": f"cpu x{os.cpu_count()}", "server": "embedded", "commit": git_commit(), **settings, **result}
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
