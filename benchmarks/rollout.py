"""Rollout throughput: groups/min and generated tokens/s of the rollout engine against one server.

Starts a generation server (the embedded one on CPU, by default SmolLM2-135M-Instruct), then
the rollout process (started as a run starts it) on a reasoning-gym task, and pulls every sample
through ``FlightSource`` (Arrow Flight) as a trainer that never lags would. Timed: from the
first pull to the end of the stream; server and rollout start-up are not timed. CPU seconds
of the rollout process and of the server over that window show where the time goes; the
1-minute load average says how busy the machine was (shared machines skew the figures).

With ``--config`` the server and the rollout are the ones of a run config (real vLLM on a GPU host), the
server is started once, and each ``--variant`` (comma-separated ``key=value`` overrides of that config) runs
the rollout against it for ``--seconds``: the rollout engine at full speed, without a trainer, per setting.
Besides the CPU seconds of the rollout process, those of vLLM's API server (the process ``vllm serve`` runs
in) and of its engine core (its child processes) are reported apart, and vLLM's running requests are polled
from ``/metrics`` every 0.5 s: a process near one CPU second per second is the bottleneck.

Usage::

    .venv/bin/python benchmarks/rollout.py                    # table
    .venv/bin/python benchmarks/rollout.py --json             # one JSON object
    .venv/bin/python benchmarks/rollout.py --model tiny-qwen3 --num-prompts 32
    python benchmarks/rollout.py --config configs/gpu-1xh200.yaml --seconds 30 \
        --variant rollout.num_sampler_logprobs=8 --variant rollout.num_sampler_logprobs=0   # H200
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from common import git_commit

from grpo_core.config import RunConfig, load_config
from grpo_core.packing import samples_from_arrow
from grpo_core.rollout import start_rollout_process
from grpo_core.security.auth import bearer_headers, run_token
from grpo_core.serving.client import parse_metrics
from grpo_core.serving.launch import provision, teardown
from grpo_core.transport.flight_client import FlightSource


def run_config(args: argparse.Namespace, log_dir: Path) -> RunConfig:
    """The benchmark's run config (embedded server on loopback, reasoning-gym prompts)."""
    return RunConfig(
        model={"name": args.model},
        server={
            "backend": "embedded",
            "port": 0,
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "embedded_num_threads": args.threads,
            "log_dir": log_dir,
            "startup_timeout_s": 600,
        },
        rollout={
            "dataset": f"reasoning_gym:{args.task}",
            "dataset_size": args.num_prompts,
            "dataset_seed": 0,
            "num_generations": args.num_generations,
            "max_completion_length": args.max_completion_length,
            "num_sampler_logprobs": args.num_sampler_logprobs,
            "temperature": 1.0,
            "first_step_tokens": 1 << 20,
            "concurrency_poll_s": 2.0,
        },
    )


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds used so far by a process (0 once it is gone)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def _children_cpu_s(pid: int) -> float:
    """CPU seconds of a process's descendants (vLLM's engine core and its workers)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    return sum(_cpu_s(child.pid) for child in children)


def _prefix_cache(text: str) -> tuple[float, float]:
    """``(queried, hit)`` prompt tokens of vLLM's prefix cache so far (``vllm:prefix_cache_queries_total``,
    ``vllm:prefix_cache_hits_total``); zeros where the server has no such counters (the embedded one)."""
    queried = hit = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_queries_total"):
            queried += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_hits_total"):
            hit += float(line.rsplit(" ", 1)[1])
    return queried, hit


def reset_prefix_caches(urls: list[str]) -> None:
    """``POST /reset_prefix_cache`` on every replica, so that a variant's prefix-cache hits are its own (the
    variants replay the same prompts; a cache still holding the previous variant's prefixes would count them).

    Raises:
        httpx.HTTPStatusError: a replica refused the reset.
    """
    with httpx.Client(headers=bearer_headers(run_token()), timeout=30) as client:
        for url in urls:
            client.post(url + "/reset_prefix_cache").raise_for_status()


class RunningPoller:
    """Polls every replica's ``/metrics`` every ``period_s`` in a thread: running requests summed over the
    replicas (mean, max), KV usage (max) and the prefix-cache hit rate of the polled window.

    The embedded server and vLLM both export ``vllm:num_requests_running`` (``parse_metrics``)."""

    def __init__(self, urls: list[str], period_s: float = 0.5) -> None:
        self.urls, self.period_s = urls, period_s
        self.running: list[float] = []
        self.kv: list[float] = []
        self.cache: dict[str, list[tuple[float, float]]] = {url: [] for url in urls}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        with httpx.Client(headers=bearer_headers(run_token()), timeout=5) as client:
            while not self._stop.wait(self.period_s):
                running, kv = 0.0, 0.0
                try:
                    for url in self.urls:
                        text = client.get(url + "/metrics").text
                        snap = parse_metrics(text)
                        running += snap.num_requests_running
                        kv = max(kv, snap.kv_cache_usage_frac)
                        self.cache[url].append(_prefix_cache(text))
                except (httpx.HTTPError, ValueError):
                    continue
                self.running.append(running)
                self.kv.append(kv)

    def stop(self) -> dict:
        """Stop polling; returns the running requests (mean, max), KV usage (max) and the prefix-cache hit
        fraction of the prompt tokens queried in the window (all replicas, and per replica)."""
        self._stop.set()
        self._thread.join(timeout=10)
        mean = sum(self.running) / len(self.running) if self.running else 0.0
        per_replica = []
        for points in self.cache.values():
            queried, hit = (
                (points[-1][0] - points[0][0], points[-1][1] - points[0][1]) if len(points) > 1 else (0.0, 0.0)
            )
            per_replica.append((queried, hit))
        queried = sum(q for q, _ in per_replica)
        return {
            "server_running_mean": round(mean, 1),
            "server_running_max": max(self.running, default=0.0),
            "kv_usage_max": round(max(self.kv, default=0.0), 4),
            "prefix_cache_hit_frac": round(sum(h for _, h in per_replica) / queried, 4) if queried else None,
            "prefix_cache_hit_frac_per_replica": [round(h / q, 4) if q else None for q, h in per_replica],
        }


def measure(
    config: RunConfig, server_urls: list[str], server_pids: list[int], run_dir: Path, seconds: float | None = None
) -> dict:
    """Pull every sample of the run (or for ``seconds``); returns the figures, CPU seconds of the rollout
    process, the server processes and the servers' child processes included."""
    started = start_rollout_process(config, server_urls, run_dir)
    process = started.process
    source = FlightSource(
        started.wait_location(),
        max_staleness=config.rollout.max_staleness,
        timeout_s=600,
        process=process,
        error_path=started.error_path,
    )
    samples = trained = 0

    def server_cpu() -> tuple[float, float]:
        return sum(map(_cpu_s, server_pids)), sum(map(_children_cpu_s, server_pids))

    try:
        source.wait_running()
        source.metrics()  # starts the generated-token rate window now
        poller = RunningPoller(server_urls)
        start = time.perf_counter()
        cpu_start = _cpu_s(process.pid), *server_cpu()
        while True:
            left = None if seconds is None else seconds - (time.perf_counter() - start)
            batch = source.pull(0, timeout_s=600 if left is None else max(0.1, left))
            for s in samples_from_arrow(batch.samples):
                samples += 1
                trained += s.num_trained
            if batch.exhausted or (left is not None and time.perf_counter() - start >= seconds):
                break
        wall_s = time.perf_counter() - start
        cpu_end = _cpu_s(process.pid), *server_cpu()
        rollout_cpu_s, server_cpu_s, server_children_cpu_s = (b - a for a, b in zip(cpu_start, cpu_end, strict=True))
        metrics = source.metrics()
        polled = poller.stop()
    finally:
        source.close()
        started.stop()
    groups = metrics.get("rollout/group_count", 0.0)
    router = {
        k.removeprefix("router/"): round(v, 4)
        for k, v in metrics.items()
        if k in ("router/affinity_hit_frac", "router/unmatched_frac", "router/spill_frac")
    }
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
        **polled,
        **router,
        "rollout_process_cpu_s": round(rollout_cpu_s, 2),
        "server_cpu_s": round(server_cpu_s, 2),
        "server_children_cpu_s": round(server_children_cpu_s, 2),
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


def config_runs(args: argparse.Namespace, log_dir: Path) -> list[tuple[str, RunConfig]]:
    """``(label, config)`` per ``--variant`` of ``--config`` (with ``--set``); without variants, the config itself.

    The server settings of every variant must equal the first's: the server is started once.

    Raises:
        ConfigError: a bad config, override or variant (naming the field).
        SystemExit: a variant changes the server settings.
    """
    base = [*args.set, f"server.log_dir={log_dir}", "rollout.first_step_tokens=1048576"]
    runs = [
        (v or "as configured", load_config(args.config, base + [o for o in (v or "").split(",") if o]))
        for v in (args.variant or [""])
    ]

    def started(cfg: RunConfig) -> object:  # what provision() reads; the routing settings are the rollout's
        return cfg.server.model_copy(update={"route_imbalance": 0})

    for label, cfg in runs[1:]:
        if started(cfg) != started(runs[0][1]):
            raise SystemExit(f"--variant {label!r} changes server settings; the server is started once")
    return runs


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
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads of the embedded server (1 avoids OpenMP spinning on a shared machine)",
    )
    p.add_argument("--config", help="a run config file: its server and rollout (the options above are ignored)")
    p.add_argument("--set", action="append", default=[], help="override of --config, key=value (repeatable)")
    p.add_argument(
        "--variant", action="append", help="comma-separated overrides of --config, one measurement each (repeatable)"
    )
    p.add_argument("--seconds", type=float, help="measure this long per variant (default: the whole dataset)")
    p.add_argument("--out", type=Path, help="with --config: also write the report to this JSON file")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.config:
            runs = config_runs(args, Path(tmp))
        else:
            runs = [("flags", run_config(args, Path(tmp)))]
        handles = provision(runs[0][1])
        results = []
        try:
            for i, (label, config) in enumerate(runs):
                reset_prefix_caches([h.url for h in handles])
                figures = measure(
                    config,
                    [h.url for h in handles],
                    [h.process.pid for h in handles],
                    Path(tmp) / f"rollout{i}",
                    args.seconds,
                )
                results.append({"variant": label, **figures})
                if args.config and not args.json:
                    print(json.dumps(results[-1]), flush=True)
        finally:
            teardown(handles)
    if args.config:
        server = runs[0][1].server
        report = {
            "hardware": f"cpu x{os.cpu_count()}",
            "config": args.config,
            "set": args.set,
            "server": f"{server.backend} max_num_seqs={server.max_num_seqs}",
            "commit": git_commit(),
            "results": results,
        }
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
        print(json.dumps(report) if args.json else json.dumps(report, indent=1))
        return
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "config", "set", "variant", "seconds", "out")}
    result = {
        "hardware": f"cpu x{os.cpu_count()}",
        "server": "embedded",
        "commit": git_commit(),
        **settings,
        **results[0],
    }
    del result["variant"]
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
