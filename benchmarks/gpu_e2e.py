"""The main job end to end on GPUs with real vLLM: ``grpo train`` per topology, figures from each run's own metrics.

Each run is the ``grpo-train`` flow started by the CLI (``python -m flows.cli train --config
configs/gpu-*.yaml``), which provisions vLLM, the rollout process and the FSDP2 trainer itself.
While it runs, this script samples GPU memory (``nvidia-smi``) and vLLM's ``/metrics`` once a
second; afterwards it reads the run's ``metrics.jsonl`` and reports, per run: generated, trained
and forwarded tokens/s, step time, ``perf/rollout_wait_s``, weight-sync seconds, peak GPU memory,
vLLM KV-cache usage and running requests over time, ``sampling/importance_sampling_ratio/mean``
overall and at staleness 0, turns the server aborted (0 expected: every pause keeps), and the
reward curve. Prints a table; writes ``summary.json`` and one PNG per run under ``--out``.

    python benchmarks/gpu_e2e.py --runs 1xh200,1xh200-lora --steps 30 --out $OUT   # one H200
    python benchmarks/gpu_e2e.py --runs 2xh200 --steps 30 --out $OUT                # two H200s
    python benchmarks/gpu_e2e.py --cpu-smoke --runs 1xh200 --out /tmp/e2e           # CPU: embedded server, tiny model

Steady-state rates leave out the first ``--warmup-steps`` steps (compilation, vLLM warm-up). A run over
``--timeout-s``, or this script stopped by SIGTERM or Ctrl-C, gets SIGINT (as Ctrl-C: the flow records its crash and
stops its processes; SIGKILL after ``--stop-grace-s``); the steps it trained are still summarized, ``summary.json`` is
written after every run, and a stopped script starts no further run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from grpo_core.run.children import signal_group, start_child, stop_child  # noqa: E402
from grpo_core.run.lifeline import interruptible  # noqa: E402
from grpo_core.security.auth import TOKEN_ENV, bearer_headers, ensure_run_token, run_token  # noqa: E402
from grpo_core.serving.client import parse_metrics  # noqa: E402
from grpo_core.tracking.metrics import JsonlSink  # noqa: E402

RUNS = {
    "1xh200": "configs/gpu-1xh200.yaml",
    "1xh200-lora": "configs/gpu-1xh200-lora.yaml",
    "2xh200": "configs/gpu-2xh200.yaml",
    "qwen3-0.6b-random": "configs/gpu-qwen3-0.6b-random.yaml",
}
#: Overrides that turn a GPU config into a CPU smoke run of the same code path (embedded server, tiny model).
CPU_SMOKE = [
    "model.name=tiny-qwen3",
    "model.dtype=auto",
    "server.backend=embedded",
    "server.gpu_ids=null",
    "server.port=0",
    "server.max_model_len=256",
    "server.max_num_seqs=32",
    "server.embedded_num_threads=1",
    "train.device=cpu",
    "train.gpu_ids=null",
    "rollout.max_completion_length=24",
    "rollout.dataset_size=64",
    "rollout.first_step_tokens=1024",
    "packing.token_budget=512",
    "train.gradient_accumulation_steps=1",
    "rollout.reward_functions=[grpo_core.demo_rewards:even_token_reward]",
]


class Sampler(threading.Thread):
    """Once a second: GPU memory used per GPU (MiB, nvidia-smi) and vLLM's KV usage / running / waiting requests."""

    def __init__(self, vllm_url: str | None):
        super().__init__(daemon=True)
        self.vllm_url, self.stop_event, self.t0 = vllm_url, threading.Event(), time.monotonic()
        self.gpu_peak_mib: dict[str, float] = {}
        self.series: list[dict] = []

    def run(self) -> None:
        while not self.stop_event.wait(1.0):
            point = {"t_s": round(time.monotonic() - self.t0, 1)}
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
                for line in out.strip().splitlines():
                    index, used = (x.strip() for x in line.split(","))
                    self.gpu_peak_mib[index] = max(self.gpu_peak_mib.get(index, 0.0), float(used))
                    point[f"gpu{index}_mib"] = float(used)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
            if self.vllm_url:
                try:
                    snap = parse_metrics(
                        httpx.get(self.vllm_url + "/metrics", headers=bearer_headers(run_token()), timeout=2).text
                    )
                    point.update(
                        kv_usage=snap.kv_cache_usage_frac,
                        running=snap.num_requests_running,
                        waiting=snap.num_requests_waiting,
                    )
                except (httpx.HTTPError, ValueError):
                    pass
            self.series.append(point)


def _stop_flow(proc: subprocess.Popen, grace_s: float) -> int:
    """Stop the flow's process group as Ctrl-C does (SIGINT: the flow records its crash and stops vLLM, rollout and
    trainer), SIGKILL after ``grace_s``; further SIGINT/SIGTERM to this script are ignored meanwhile, so the
    stop always completes. Returns the flow's exit code."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal_group(proc.pid, signal.SIGINT)
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            stop_child(proc, timeout_s=0)
            return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_flow(name: str, args: argparse.Namespace) -> dict:
    """One ``grpo train`` run under a wall-clock limit; returns its figures (and ``error`` when it failed;
    ``stopped_at_window``: still running at ``--timeout-s``, stopped by this script, which is not a failure;
    ``interrupted``: this script was stopped during the run)."""
    out_dir = Path(args.work) / name
    sets = (
        [
            f"train.max_steps={args.steps}",
            "tracking.log_model=false",
            f"train.output_dir={out_dir}",
            f"tracking.dir={Path(args.work) / 'mlflow'}",
        ]
        + (CPU_SMOKE if args.cpu_smoke else [])
        + args.set
    )
    cmd = [sys.executable, "-m", "flows.cli", "train", "--config", str(ROOT / RUNS[name])]
    cmd += [x for s in sets for x in ("--set", s)]
    port = None if args.cpu_smoke else 8000  # the GPU configs serve vLLM replica 0 on server.port 8000
    sampler = Sampler(f"http://127.0.0.1:{port}" if port else None)
    sampler.start()
    started = time.monotonic()
    log = Path(args.work) / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    interrupted = stopped_at_window = False
    with log.open("w") as f:
        # The run's token comes from here (the flow uses GRPO_RUN_TOKEN when set), so the sampler may read /metrics.
        # SIGINT's default action in the flow, which _stop_flow relies on, even when this script is a background job
        proc = start_child(
            cmd, stdout=f, cwd=ROOT, env={**os.environ, TOKEN_ENV: ensure_run_token()}, preexec_fn=interruptible
        )
        try:
            code = proc.wait(timeout=args.timeout_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:  # over time, or this benchmark was stopped
            interrupted = isinstance(exc, KeyboardInterrupt)
            stopped_at_window = not interrupted
            code = _stop_flow(proc, args.stop_grace_s)
        finally:
            if proc.poll() is None:  # an error of this script itself: the flow must not outlive it
                _stop_flow(proc, args.stop_grace_s)
    sampler.stop_event.set()
    result = {
        "run": name,
        "exit_code": code,
        "wall_s": round(time.monotonic() - started, 1),
        "gpu_peak_mib": sampler.gpu_peak_mib,
        "vllm_series": sampler.series,
        "interrupted": interrupted,
        "stopped_at_window": stopped_at_window,
    }
    metrics = sorted(out_dir.glob("*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    if metrics:
        result.update(figures(JsonlSink.read(metrics[-1]), args.warmup_steps))
    if code != 0 and not stopped_at_window:  # a window stop ends in 130 too, with the servers' shutdown noise
        result["error"] = log.read_text(errors="replace")[-4000:]
    (Path(args.out) / f"{name}_timeline.txt").write_text(timeline(log, out_dir))
    return result


#: Log lines that mark a start-up phase or a step (flow, server, rollout and trainer logs).
TIMELINE = re.compile(
    r"Beginning flow run|Finished in state|healthy|Application startup complete|started the rollout"
    r"|Flight server listening|compiled length bucket|step \d+:|checkpoint step|Traceback"
    r"|Error|rank \d+.*(loaded|ready)|Starting vLLM|torch.compile|CUDA graph|init engine|KV cache"
)


def timeline(log: Path, out_dir: Path) -> str:
    """The start-up phases and steps of one run, one line each with its time: the flow's log (which carries the
    server, rollout and trainer output) and the rollout's own log, filtered by :data:`TIMELINE`."""
    lines = [f"== {log}"] + [x[:300] for x in log.read_text(errors="replace").splitlines() if TIMELINE.search(x)]
    for rollout_log in sorted(out_dir.glob("*/rollout.log")):
        lines += [f"== {rollout_log}"] + [
            x[:300] for x in rollout_log.read_text(errors="replace").splitlines() if TIMELINE.search(x)
        ][:200]
    return "\n".join(lines) + "\n"


def _mean(values: list[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(values) if values else float("nan")


def figures(records: list[dict], warmup: int) -> dict:
    """Steady-state figures of one run from its per-step metrics (DESIGN.md §7 names)."""
    steady = [r for r in records if r.get("step", 0) > warmup] or records

    def col(key: str, rs: list[dict] = steady) -> list:
        return [r[key] for r in rs if key in r]

    step_s = sum(col("perf/step_s"))

    def rate(key: str) -> float:
        return sum(col(key)) / step_s if step_s else float("nan")

    staleness0 = col("sampling/importance_sampling_ratio/staleness0_mean", records)
    fresh = [
        (
            r["sampling/importance_sampling_ratio/staleness0_mean"],
            r.get("sampling/importance_sampling_ratio/staleness0_token_count", 1.0),
        )
        for r in records
        if "sampling/importance_sampling_ratio/staleness0_mean" in r
    ]
    fresh_tokens = sum(n for _, n in fresh)
    return {
        "steps": records[-1]["step"] if records else 0,
        "generated_tokens_per_s": _mean(col("rollout/generated_tokens_per_s")),
        "trained_tokens_per_s": rate("batch/trained_tokens_per_step"),
        "forwarded_tokens_per_s": rate("batch/forwarded_tokens_per_step"),
        "step_s_median": statistics.median(col("perf/step_s")) if col("perf/step_s") else float("nan"),
        "rollout_wait_s_mean": _mean(col("perf/rollout_wait_s")),
        "weight_sync_s_mean": _mean(col("perf/weight_sync_s")),
        **{
            f"weight_sync_{p}_s_mean": _mean(col(f"perf/weight_sync_{p}_s"))
            for p in ("gather", "pause", "update", "settle")
        },
        # logged once per start (the first step): start-up figures of the run
        "time_to_first_step_s": _mean(col("perf/time_to_first_step_s", records)),
        "compile_warmup_s": _mean(col("perf/compile_warmup_s", records)),
        "is_ratio_mean": _mean(col("sampling/importance_sampling_ratio/mean", records)),
        # every staleness-0 token weighs the same (a step with few fresh tokens is a noisy mean, not a vote)
        "is_ratio_staleness0_mean": sum(m * n for m, n in fresh) / fresh_tokens if fresh_tokens else float("nan"),
        "staleness0_tokens": fresh_tokens,
        "is_ratio_staleness0_max_dev": max((abs(v - 1) for v in staleness0), default=float("nan")),
        "staleness_mean": _mean(col("sample/staleness_mean", records)),
        "kv_usage_mean": _mean(col("rollout/vllm_kv_cache_usage_frac")),
        "running_requests_mean": _mean(col("rollout/vllm_running_requests")),
        "aborted_turns": sum(col("rollout/aborted_turn_count", records)),
        "aborted_groups": sum(col("rollout/aborted_group_count", records)),
        "reward_first5": _mean(col("reward", records)[:5]),
        "reward_last5": _mean(col("reward", records)[-5:]),
        "per_step": [
            {
                k: r.get(k)
                for k in (
                    "step",
                    "reward",
                    "perf/step_s",
                    "perf/trained_tokens_per_s",
                    "sampling/importance_sampling_ratio/mean",
                    "sampling/importance_sampling_ratio/staleness0_mean",
                    "sampling/importance_sampling_ratio/staleness0_token_count",
                    "sampling/importance_sampling_ratio/min",
                    "sampling/importance_sampling_ratio/max",
                    "sampling/sampling_logp_difference/mean",
                    "sampling/sampling_logp_difference/max",
                    "perf/rollout_wait_s",
                    "rollout/backpressure_s",
                    "rollout/concurrency",
                    "rollout/queued_tokens",
                    "rollout/token_allowance",
                    "rollout/group_count",
                    "rollout/duration_s",
                    "rollout/score_s",
                    "router/replica_down_count",
                    "rollout/vllm_retry_count",
                    "rollout/vllm_kv_cache_usage_frac",
                    "rollout/vllm_running_requests",
                    "rollout/concurrency_cap",
                )
            }
            for r in records
        ],
    }


def plot(result: dict, path: Path) -> None:
    """Reward per step, and vLLM KV usage / running requests and GPU memory over time, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    steps = [p for p in result.get("per_step", []) if p.get("reward") is not None]
    a.plot([p["step"] for p in steps], [p["reward"] for p in steps], marker=".")
    a.set(xlabel="step", ylabel="mean reward", title=f"{result['run']}: reward")
    series = [p for p in result["vllm_series"] if "kv_usage" in p]
    if series:  # sampled once a second from vLLM's /metrics
        t, xlabel = [p["t_s"] for p in series], "wall time (s)"
        kv, running = [p["kv_usage"] for p in series], [p["running"] for p in series]
    else:  # the rollout's own /metrics polls, one value per logged step
        rows = [p for p in result.get("per_step", []) if p.get("rollout/vllm_kv_cache_usage_frac") is not None]
        t, xlabel = [p["step"] for p in rows], "step"
        kv = [p["rollout/vllm_kv_cache_usage_frac"] for p in rows]
        running = [p.get("rollout/vllm_running_requests") for p in rows]
    b.plot(t, kv, label="KV-cache usage (frac)")
    b2 = b.twinx()
    b2.plot(t, running, color="tab:orange", label="running requests")
    b.set(xlabel=xlabel, ylabel="KV usage", title="generation server load")
    b2.set_ylabel("running requests")
    fig.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def table(results: list[dict]) -> str:
    """The printed comparison table."""
    cols = [
        ("run", "run", "{}"),
        ("exit", "exit_code", "{}"),
        ("steps", "steps", "{}"),
        ("wall s", "wall_s", "{:.0f}"),
        ("gen tok/s", "generated_tokens_per_s", "{:.0f}"),
        ("train tok/s", "trained_tokens_per_s", "{:.0f}"),
        ("fwd tok/s", "forwarded_tokens_per_s", "{:.0f}"),
        ("step s", "step_s_median", "{:.2f}"),
        ("wait s", "rollout_wait_s_mean", "{:.2f}"),
        ("sync s", "weight_sync_s_mean", "{:.3f}"),
        ("IS r st0", "is_ratio_staleness0_mean", "{:.4f}"),
        ("IS r", "is_ratio_mean", "{:.4f}"),
        ("KV use", "kv_usage_mean", "{:.2f}"),
        ("running", "running_requests_mean", "{:.0f}"),
        ("aborted", "aborted_turns", "{:.0f}"),
        ("reward 5→5", None, None),
        ("peak MiB", None, None),
    ]
    lines = [" | ".join(h for h, _, _ in cols)]
    for r in results:
        cells = []
        for _, key, fmt in cols:
            if key is None:
                continue
            value = r.get(key, "-")
            cells.append(
                fmt.format(value) if isinstance(value, int | float) and not isinstance(value, bool) else str(value)
            )
        cells.append(f"{r.get('reward_first5', float('nan')):.2f}→{r.get('reward_last5', float('nan')):.2f}")
        cells.append(",".join(f"{k}:{v:.0f}" for k, v in sorted(r["gpu_peak_mib"].items())) or "-")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs, table, JSON and PNGs; exit code 1 if any run failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="1xh200,1xh200-lora", help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=420, help="wall-clock limit per run")
    p.add_argument(
        "--stop-grace-s",
        type=float,
        default=30,
        help="after the SIGINT that stops a run (over time, or this script stopped), SIGKILL it this late",
    )
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/gpu-e2e")))
    p.add_argument("--work", default=str(ROOT / "runs" / "gpu-e2e"), help="run folders and logs")
    p.add_argument("--cpu-smoke", action="store_true", help="embedded server and tiny model on CPU (same code path)")
    p.add_argument("--set", action="append", default=[], help="extra config override for every run")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"unknown run {unknown}; choose from {list(RUNS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    (ROOT / "runs" / "prefect").mkdir(parents=True, exist_ok=True)  # PREFECT_HOME of the CLI's embedded API
    # SIGTERM (a wrapping `timeout`) stops the running flow as Ctrl-C does; the figures measured so far are kept.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    results = []
    for name in names:
        result = run_flow(name, args)
        results.append(result)
        print(f"{name}: exit {result['exit_code']} after {result['wall_s']} s", flush=True)
        summary = args.out / "summary.json"  # written after every run (whole or not at all): a stop loses nothing
        previous = json.loads(summary.read_text()) if summary.exists() else {}
        previous[name] = result
        partial = summary.with_suffix(".json.tmp")
        partial.write_text(json.dumps(previous, indent=1, default=str))
        os.replace(partial, summary)
        plot(result, args.out / f"{name}.png")
        if result["interrupted"]:
            print(f"stopped during {name}: the runs after it were not started", flush=True)
            break
    print(table(results))
    for r in results:
        if r["stopped_at_window"]:
            print(
                f"--- {r['run']} still running at --timeout-s {args.timeout_s:g}: stopped after {r.get('steps', 0)} "
                f"steps (figures above are of those steps)"
            )
        if "error" in r:
            print(f"--- {r['run']} failed; log tail:\n{r['error'][-2500:]}")
    return 1 if any(("error" in r) or r["interrupted"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
