"""Duty cycle of a run against simulated engines: where an asynchronous step's time goes (issue 25, item 2).

The real rollout loop (:func:`grpo_core.rollout.driver.drive`, its token allowance and concurrency cap) generates
against simulated engines (:mod:`grpo_core.serving.simulated`: a decode step costs ``a + b x running``, default
``h200`` calibration from ``benchmarks/results/engine_calibration_h200_2026-12-05_1-2engines.json``), and a consumer
acts as the trainer without training anything: it takes a step's tokens from the sample queue (everything queued,
as the planner's pulls do), drops samples more than ``max_staleness`` versions behind the step's version when it
assembles the step (the trained-time rule, DESIGN.md §5), "trains" for ``--train-s``, then syncs the weights with
the real round trip on every engine in parallel (``/pause?mode=keep`` → ``/start_weight_update`` →
``/update_weights``, which the engine holds ``--sync-s`` → ``/finish_weight_update`` → ``/reset_prefix_cache`` →
``/resume``) and reports the step to the allowance. ``--gather-s`` models the trainer's gather of the full weights,
which the vLLM sync does before it pauses any engine (the engines keep generating): the step takes it, the engines do
not stand still for it; ``--sync-s`` is then the paused copy alone.

Printed per row, over the steady state (after ``--warmup-s``): engine busy / paused / idle share of wall (mean over
engines, measured on the engines' clock; ``busy model`` is the share the cost model accounts for, the rest of busy is
the host's lateness), the trainer's wait share, samples dropped as stale at step assembly, trained tokens per second
(completion tokens of trained samples), signal tokens per second (those with a non-zero advantage) and raw tokens per
second (prompt + completion of trained samples). Rates are in simulated seconds (wall rates x ``--time-scale``).

The shape comes from a config (``--config``, default ``configs/gpu-1xh200.yaml``: G, ``max_staleness``, the
concurrency cap, ``max_completion_length``, ``batch_group_prompts``, ``seed``, ``first_step_tokens``, step tokens =
``packing.token_budget`` x ``gradient_accumulation_steps`` x ranks, ``server.max_num_seqs`` and ``max_model_len``);
``--engines 1,2,4`` prints a row per engine count (same seed), ``--calibration`` picks a and b.

    .venv/bin/python benchmarks/simulated_run.py                                   # 1, 2, 4 engines, h200 fit
    .venv/bin/python benchmarks/simulated_run.py --engines 1 --calibration h200-client-bound --sync-s 0.9
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from grpo_core.serving.simulated.cost import CALIBRATIONS  # noqa: E402


@dataclass
class Spec:
    """One run of the benchmark (times in simulated seconds; multiplied by ``time_scale`` on the wall)."""

    engines: int = 1
    calibration: str = "h200"
    config: str = "configs/gpu-1xh200.yaml"
    lengths: str = "lognormal:120:0.6"
    kept: float = 1 / 3
    train_s: float = 0.35
    sync_s: float = 0.90
    gather_s: float = 0.0  # the trainer's gather before the pause (generation goes on); 0: inside sync_s
    seconds: float = 60.0
    warmup_s: float = 15.0
    time_scale: float = 4.0
    max_num_seqs: int | None = None  # per engine; default the config's server.max_num_seqs
    step_tokens: int | None = None  # forwarded tokens per step; default token_budget x accumulation x ranks
    seed: int = 0
    in_process: bool = False  # engines in a thread of this process (tests) instead of their own process
    min_steps: int = 0  # the window goes on until this many steps ended in it (a slow host), ...
    min_steps_timeout_s: float = 300.0  # ... for at most this many more wall seconds
    overrides: dict = field(default_factory=dict)  # rollout config fields over the config's


@dataclass
class _Held:
    """A group the consumer pulled and has not trained yet."""

    version: int
    raw: int
    forwarded: int
    trained: int
    signal: int
    samples: int


def _groups(batches: list[pa.RecordBatch]) -> list[_Held]:
    """Per group of the pulled batches: its version and token counts (forwarded counts the shared prompt once)."""
    out: dict[int, _Held] = {}
    for batch in batches:
        cols = batch.to_pydict()
        for gid, ids, mask, adv, ver in zip(
            cols["group_id"],
            cols["input_ids"],
            cols["completion_mask"],
            cols["advantage"],
            cols["policy_version"],
            strict=True,
        ):
            m = np.asarray(mask)
            prompt = int(np.argmax(m)) if m.any() else len(m)
            held = out.setdefault(gid, _Held(int(ver), 0, prompt, 0, 0, 0))
            held.raw += len(ids)
            held.forwarded += len(ids) - prompt
            held.trained += int(m.sum())
            held.signal += int(m.sum()) if adv != 0 else 0
            held.samples += 1
    return list(out.values())


class Consumer:
    """The trainer's side (see the module docstring); counts what it trains and drops, and when it waited."""

    def __init__(self, queue, allowance, replicas, spec: Spec, step_tokens: int, max_staleness: int) -> None:
        self.queue, self.allowance, self.replicas, self.spec = queue, allowance, replicas, spec
        self.step_tokens, self.max_staleness = step_tokens, max_staleness
        self.version = 0
        self.held: deque[_Held] = deque()
        self.steps: list[dict] = []  # per step: end time and counts
        self.waits: list[tuple[float, float]] = []  # (start, end) monotonic
        self.syncs: list[tuple[float, float]] = []
        self.max_trained_staleness = 0

    async def run(self) -> None:
        """Steps forever (cancel to stop)."""
        scale = self.spec.time_scale
        while True:
            t0 = time.monotonic()
            step = await self._assemble()
            self.waits.append((t0, time.monotonic()))
            await asyncio.sleep(self.spec.train_s * scale)
            self.version += 1
            s0 = time.monotonic()
            # the full weights are gathered into the packed buffer before any engine is paused (the vLLM sync since
            # issue 25 item 5); the engines go on generating meanwhile
            await asyncio.sleep(self.spec.gather_s * scale)
            await self.replicas.fan_out("weight sync", self._sync)  # the run's one control fan-out
            self.syncs.append((s0, time.monotonic()))
            held_raw = sum(g.raw for g in self.held)
            self.allowance.report(self.version, step["raw"], held_raw)
            self.steps.append({**step, "end": time.monotonic()})

    async def _assemble(self) -> dict:
        """Pull until a step's forwarded tokens are held; drop stale groups; take whole groups up to the budget."""
        step = {"raw": 0, "forwarded": 0, "trained": 0, "signal": 0, "stale_samples": 0, "stale_tokens": 0}
        taken: list[_Held] = []
        while True:
            while self.held:
                group = self.held[0]
                if self.version - group.version > self.max_staleness:
                    self.held.popleft()
                    step["stale_samples"] += group.samples
                    step["stale_tokens"] += group.raw
                    continue
                if taken and step["forwarded"] + group.forwarded > self.step_tokens:
                    break
                self.held.popleft()
                taken.append(group)
                for key in ("raw", "forwarded", "trained", "signal"):
                    step[key] += getattr(group, key)
            if step["forwarded"] >= self.step_tokens or (taken and self.held):
                break
            batches, _, _, _ = await asyncio.to_thread(self.queue.take, 1, 0.2)
            self.held.extend(_groups(batches))
        self.max_trained_staleness = max([self.max_trained_staleness] + [self.version - g.version for g in taken])
        return step

    async def _sync(self, client) -> None:
        """The full-weight round trip on one engine."""
        await client.pause("keep")
        await client.start_weight_update()
        await client.update_weights({"simulated": True})
        await client.finish_weight_update()
        await client.resume()


def _shape(spec: Spec) -> dict:
    """The run's shape from the config file (rollout fields, step tokens, engine limits)."""
    from grpo_core.config import load_config

    cfg = load_config(str(ROOT / spec.config) if not Path(spec.config).is_absolute() else spec.config)
    r = cfg.rollout
    fields = {
        "num_generations": r.num_generations,
        "max_completion_length": r.max_completion_length,
        "num_sampler_logprobs": r.num_sampler_logprobs,
        "max_staleness": r.max_staleness,
        "max_concurrent_rollouts": r.max_concurrent_rollouts,
        "batch_group_prompts": r.batch_group_prompts,
        "seed": r.seed,
        "first_step_tokens": r.first_step_tokens,
        "temperature": r.temperature,
        "reward_workers": 0,
        **spec.overrides,
    }
    ranks = cfg.train.num_ranks
    budget = cfg.packing.token_budget
    if spec.step_tokens is None and budget is None:
        raise ValueError(f"{spec.config}: packing.token_budget is unset; pass Spec.step_tokens")
    step_tokens = spec.step_tokens or (budget or 0) * cfg.train.gradient_accumulation_steps * ranks
    return {
        "rollout": fields,
        "step_tokens": step_tokens,
        "max_num_seqs": spec.max_num_seqs or cfg.server.max_num_seqs,
        "max_model_len": cfg.server.max_model_len,
    }


def _engine_args(spec: Spec, shape: dict, vocab: int, eos: int) -> list[str]:
    seqs = shape["max_num_seqs"]
    return [
        f"--engines={spec.engines}",
        f"--calibration={spec.calibration}",
        f"--time-scale={spec.time_scale}",
        f"--max-num-seqs={seqs}",
        f"--max-model-len={shape['max_model_len']}",
        f"--kv-budget-tokens={seqs * shape['max_model_len']}",
        f"--vocab-size={vocab}",
        f"--eos-token-id={eos}",
        f"--lengths={spec.lengths}",
        f"--update-s={spec.sync_s}",
        f"--seed={spec.seed}",
        "--model-name=m",
    ]


class _Engines:
    """The simulated engines, in their own process (default) or in a thread of this one."""

    def __init__(self, spec: Spec, args: list[str]) -> None:
        self.spec, self.args, self.proc, self.sim = spec, args, None, None
        self.urls: list[str] = []

    def __enter__(self) -> _Engines:
        if self.spec.in_process:
            from grpo_core.serving.simulated.__main__ import build, parse_args
            from grpo_core.serving.simulated.server import SimulatedServers

            cost, settings = build(parse_args(self.args))
            self.sim = SimulatedServers(self.spec.engines, cost, settings).start()
            self.urls = self.sim.urls
            return self
        cmd = [sys.executable, "-m", "grpo_core.serving.simulated", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ})
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.proc.wait(10)
            raise RuntimeError(f"simulated engines did not start (exit {self.proc.returncode}): {' '.join(cmd)}")
        self.urls = json.loads(line)["urls"]
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sim is not None:
            self.sim.stop()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)


def _prompts(n: int, seed: int) -> list[dict]:
    """chain_sum-like prompts (two or three terms of one or two digits, like configs/gpu-1xh200.yaml's dataset)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        terms = rng.integers(0, 100, size=int(rng.integers(2, 4)))
        rows.append(
            {
                "prompt": f"Calculate {' + '.join(map(str, terms))}. Think step by step, then give the final "
                "number inside <answer></answer> tags."
            }
        )
    return rows


def _window(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of ``intervals`` inside ``[t0, t1]``."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in intervals)


async def _engine_stats(clients) -> list[dict]:
    return [(await c.call("GET", "/sim/stats")).json() for c in clients]


def run(spec: Spec) -> dict:
    """One run; the steady-state figures as a dict (keys in :func:`format_rows`)."""
    from transformers import AutoTokenizer

    from grpo_core.config import ModelConfig, RolloutConfig
    from grpo_core.models import resolve_model_dir
    from grpo_core.rollout.driver import drive
    from grpo_core.rollout.loop import LoopRuntime, RolloutLoop
    from grpo_core.rollout.pace import TokenAllowance
    from grpo_core.rollout.queue import SampleQueue
    from grpo_core.serving.client import GenerationClient
    from grpo_core.serving.replicas import ReplicaSet
    from grpo_core.serving.simulated.reward import KeptShareReward

    shape = _shape(spec)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig(name="tiny-qwen3")))
    cfg = RolloutConfig(**shape["rollout"])
    args = _engine_args(spec, shape, len(tokenizer), tokenizer.eos_token_id)
    allowance = TokenAllowance(cfg.max_staleness, cfg.first_step_tokens)
    queue = SampleQueue(allowance, with_topk=cfg.num_sampler_logprobs > 0)
    scale = spec.time_scale

    async def go(urls: list[str]) -> dict:
        clients = [GenerationClient(u, max_connections=cfg.max_concurrent_rollouts, max_retries=2) for u in urls]
        control = [GenerationClient(u, max_retries=2) for u in urls]
        runtime = LoopRuntime(
            tokenizer=tokenizer,
            server=ReplicaSet(clients),
            model_name="m",
            max_model_len=shape["max_model_len"],
            dataset=_prompts(200_000, spec.seed),
            queue=queue,
            allowance=allowance,
            reward_functions=[KeptShareReward(spec.kept, spec.seed)],
        )
        consumer = Consumer(queue, allowance, ReplicaSet(control), spec, shape["step_tokens"], cfg.max_staleness)
        t_start = time.monotonic()
        tasks = [asyncio.create_task(drive(RolloutLoop(cfg, runtime))), asyncio.create_task(consumer.run())]
        await _sleep_watching(tasks, spec.warmup_s * scale)
        t0, before = time.monotonic(), await _engine_stats(control)
        await _sleep_watching(tasks, spec.seconds * scale)
        deadline = time.monotonic() + spec.min_steps_timeout_s
        while sum(1 for s in consumer.steps if s["end"] > t0) < spec.min_steps:  # a slow host: wait for steps
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {spec.min_steps} steps within {spec.min_steps_timeout_s} s more")
            await _sleep_watching(tasks, 0.1)
        t1, after = time.monotonic(), await _engine_stats(control)
        # requests cut off by the teardown are retried and logged by the client: not the run's, so not shown
        client_log = logging.getLogger("grpo_core.serving.client")
        level = client_log.level
        client_log.setLevel(logging.ERROR)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in clients + control:
            await c.aclose()
        client_log.setLevel(level)
        return _figures(spec, shape, consumer, before, after, t0, t1, t_start)

    with _Engines(spec, args) as engines:
        return asyncio.run(go(engines.urls))


async def _sleep_watching(tasks: list[asyncio.Task], seconds: float) -> None:
    """Sleep ``seconds``, raising at once if a task ended (the loop or the consumer failed)."""
    done, _ = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        task.result()
        raise RuntimeError("the rollout loop or the consumer stopped early")


def _figures(spec: Spec, shape: dict, consumer: Consumer, before, after, t0: float, t1: float, t_start: float) -> dict:
    """Steady-state shares and rates from the engine counters and the consumer's records."""
    wall = t1 - t0
    shares = {}
    for key in ("busy_s", "paused_s", "idle_s", "modeled_busy_s"):
        per_engine = [(a[key] - b[key]) / (a["clock_s"] - b["clock_s"]) for a, b in zip(after, before, strict=True)]
        shares[key.removesuffix("_s")] = float(np.mean(per_engine))
    steps = [s for s in consumer.steps if t0 < s["end"] <= t1]
    span = (steps[-1]["end"] - steps[0]["end"]) if len(steps) > 1 else float("nan")
    counted = steps[1:]  # rates over whole steps: from the first step's end to the last's

    def rate(key: str) -> float:
        return sum(s[key] for s in counted) / span * spec.time_scale if counted else float("nan")

    sim_s = wall / spec.time_scale
    generated = sum(a["generated_tokens"] - b["generated_tokens"] for a, b in zip(after, before, strict=True))
    return {
        "engines": spec.engines,
        "calibration": spec.calibration,
        "engine_busy_frac": shares["busy"],
        "engine_busy_model_frac": shares["modeled_busy"],
        "engine_paused_frac": shares["paused"],
        "engine_idle_frac": shares["idle"],
        "trainer_wait_frac": _window(consumer.waits, t0, t1) / wall,
        "step_s": span / max(len(counted), 1) / spec.time_scale if counted else float("nan"),
        "steps": len(steps),
        "stale_dropped_samples": sum(s["stale_samples"] for s in steps),
        "max_trained_staleness": consumer.max_trained_staleness,
        "trained_tokens_per_s": rate("trained"),
        "signal_tokens_per_s": rate("signal"),
        "raw_tokens_per_s": rate("raw"),
        "generated_tokens_per_s": generated / sim_s,
        "mean_running_per_engine": float(
            np.mean(
                [
                    (a["sum_running"] - b["sum_running"]) / max(a["num_steps"] - b["num_steps"], 1)
                    for a, b in zip(after, before, strict=True)
                ]
            )
        ),
        "engine_counters": [
            {k: a[k] - b[k] for k in ("num_steps", "sum_running", "prompt_tokens", "busy_s", "modeled_busy_s")}
            | {"clock_s": a["clock_s"] - b["clock_s"]}
            for a, b in zip(after, before, strict=True)
        ],
        "spec": asdict(spec),
        "step_tokens": shape["step_tokens"],
    }


COLUMNS = (
    ("engines", "engines", "{}"),
    ("calibration", "a+b·n", "{}"),
    ("engine_busy_frac", "busy", "{:.0%}"),
    ("engine_busy_model_frac", "busy model", "{:.0%}"),
    ("engine_paused_frac", "paused", "{:.0%}"),
    ("engine_idle_frac", "idle", "{:.0%}"),
    ("trainer_wait_frac", "trainer wait", "{:.0%}"),
    ("step_s", "step s", "{:.2f}"),
    ("mean_running_per_engine", "running/engine", "{:.0f}"),
    ("stale_dropped_samples", "stale drops", "{}"),
    ("max_trained_staleness", "max staleness", "{}"),
    ("trained_tokens_per_s", "trained tok/s", "{:,.0f}"),
    ("signal_tokens_per_s", "signal tok/s", "{:,.0f}"),
    ("raw_tokens_per_s", "raw tok/s", "{:,.0f}"),
    ("generated_tokens_per_s", "generated tok/s", "{:,.0f}"),
)


def format_rows(rows: list[dict]) -> str:
    """A Markdown table of the rows."""
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt.format(r[k]) for k, _, fmt in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run a row per engine count and print the table (or ``--json``)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--engines", default="1,2,4", help="engine counts per GPU, comma-separated (a row each)")
    p.add_argument("--calibration", choices=sorted(CALIBRATIONS), default="h200")
    p.add_argument("--config", default="configs/gpu-1xh200.yaml", help="the run shape")
    p.add_argument("--lengths", default="lognormal:120:0.6", help="completion lengths (fixed:L | uniform:LO:HI | ...)")
    p.add_argument("--kept", type=float, default=1 / 3, help="share of groups whose rewards differ")
    p.add_argument("--train-s", type=float, default=0.35, help="simulated seconds of a step's training")
    p.add_argument("--sync-s", type=float, default=0.90, help="simulated seconds of one engine's weight update")
    p.add_argument(
        "--gather-s",
        type=float,
        default=0.0,
        help="simulated seconds of the trainer's gather before the pause (engines keep generating); 0: in --sync-s",
    )
    p.add_argument("--seconds", type=float, default=60.0, help="simulated seconds of steady state measured")
    p.add_argument("--warmup-s", type=float, default=15.0, help="simulated seconds before measuring")
    p.add_argument("--time-scale", type=float, default=4.0, help="wall seconds per simulated second")
    p.add_argument("--max-num-seqs", type=int, help="per engine (default the config's server.max_num_seqs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        counts = [int(x) for x in args.engines.split(",")]
    except ValueError:
        p.error(f"--engines: comma-separated integers expected, got {args.engines!r}")
    if any(c < 1 for c in counts):
        p.error("--engines: counts must be >= 1")
    if not 0 <= args.kept <= 1:
        p.error(f"--kept must be in [0, 1], got {args.kept}")
    rows = []
    for count in counts:
        spec = Spec(
            engines=count,
            calibration=args.calibration,
            config=args.config,
            lengths=args.lengths,
            kept=args.kept,
            train_s=args.train_s,
            sync_s=args.sync_s,
            gather_s=args.gather_s,
            seconds=args.seconds,
            warmup_s=args.warmup_s,
            time_scale=args.time_scale,
            max_num_seqs=args.max_num_seqs,
            seed=args.seed,
        )
        rows.append(run(spec))
        if args.json:
            sys.stdout.write(json.dumps(rows[-1]) + "\n")
    if not args.json:
        sys.stdout.write(format_rows(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
