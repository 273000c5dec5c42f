"""Rollout pacing against a server of known speed: does the token allowance keep the server busy?

On the H200 (``configs/gpu-1xh200.yaml``, real vLLM with CUDA graphs) the rollout kept on average 38 requests running
(polled per step; 11 over the whole run, 143 at most) out of ``server.max_num_seqs: 256``, KV usage stayed below 0.3%,
and the trainer waited 30 of every 32 s for samples. This benchmark runs the real rollout loop
(:func:`grpo_core.rollout.driver.drive` with its :class:`~grpo_core.rollout.pace.TokenAllowance`) against a real HTTP
server whose speed is a parameter (the tests' fake generation server, ``tests/support/fake_generation.py``), with a
consumer that acts like the trainer (it takes a step's raw tokens, "trains" for ``--train-s`` and reports the step), so
the pacing alone decides the load:

* the server answers each completion after ``length / --decode-tok-s`` seconds (lengths uniform in
  ``[--min-tokens, --max-tokens]``, from the request's seed), as a decode-bound server with room for every
  request would; it counts the requests it holds, sampled every 50 ms;
* rewards tie (the group is dropped) for a share ``1 - --kept`` of the prompts, as in the H200 run (about 2/3).

Printed: requests in flight at the server (mean, max), generated tok/s, steps, the consumer's wait per step,
and the allowance's limit; ``--json`` for one object. CPU only, no model weights (the tiny-qwen3 tokenizer).
On the 2-core development box the fake server and the loop share two cores, so the generated tok/s there is
bounded by the box (about 8k tok/s) rather than by the pacing; the requests in flight show what the allowance
admits (measured: about 200 on average, 390 at most, with the H200 run's parameters and ``--step-raw 30000``).

    .venv/bin/python benchmarks/rollout_pacing.py                       # H200-like: G=8, 56k raw tokens per step
    .venv/bin/python benchmarks/rollout_pacing.py --max-staleness 2 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]
from fake_generation import FakeGeneration  # noqa: E402 - the tests' fake generation server

from grpo_core.config import ModelConfig, RolloutConfig  # noqa: E402
from grpo_core.models import resolve_model_dir  # noqa: E402
from grpo_core.rollout.driver import drive  # noqa: E402
from grpo_core.rollout.loop import LoopRuntime, RolloutLoop  # noqa: E402
from grpo_core.rollout.pace import TokenAllowance  # noqa: E402
from grpo_core.rollout.queue import SampleQueue  # noqa: E402
from grpo_core.serving.client import GenerationClient  # noqa: E402
from grpo_core.serving.protocol import COMPLETIONS_PATH, METRICS_PATH, CompletionRequest  # noqa: E402
from grpo_core.serving.replicas import ReplicaSet  # noqa: E402


def timed_server(decode_tok_s: float, min_tokens: int) -> tuple[FakeGeneration, list[int]]:
    """The fake generation server (tests/support/fake_generation.py) answering each completion after
    ``length / decode_tok_s`` seconds, the length drawn from the request's seed; ``/metrics`` answers 404 (the
    concurrency cap stays at its ceiling). Returns it (``held``: requests in flight) and a one-item list of the
    tokens it generated so far."""
    generated, lock = [0], threading.Lock()

    def length(request) -> int:
        return random.Random(request.seed).randint(min(min_tokens, request.max_tokens), request.max_tokens)

    def complete(request, prompt, choice):
        n = length(request)
        with lock:
            generated[0] += n
        return [7] * n, [-1.0] * n, "length"

    server = FakeGeneration().start()
    server.script(METRICS_PATH, status=404)
    server.script(
        COMPLETIONS_PATH,
        hold_s=lambda r: length(CompletionRequest.model_validate(r.body)) / decode_tok_s,
    )
    server.complete_with(complete)
    return server, generated


def keep_pattern(completion_ids, keep, **_):
    """Rewards that vary inside a group whose row says ``keep`` (queued) and tie otherwise (dropped)."""
    return [float(i) if k else 0.0 for i, k in enumerate(keep)]


class CountingAllowance(TokenAllowance):
    """The allowance, also counting the raw tokens the consumer took."""

    taken = 0

    def dequeued(self, tokens: int) -> None:
        super().dequeued(tokens)
        self.taken += tokens


def consume(
    queue: SampleQueue,
    allowance: CountingAllowance,
    step_raw: int,
    train_s: float,
    stop: threading.Event,
    waits: list[float],
) -> None:
    """The trainer's side: take a step's raw tokens (everything queued, as the planner's pulls do), train, report."""
    version, base = 0, 0
    while not stop.is_set():
        t0 = time.monotonic()
        while allowance.taken - base < step_raw and not stop.is_set():
            queue.take(1, 0.2)
        if stop.is_set():
            return
        waits.append(time.monotonic() - t0)
        got, base = allowance.taken - base, allowance.taken
        time.sleep(train_s)
        version += 1
        allowance.report(version, got)


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig(name="tiny-qwen3")))
    server, generated = timed_server(args.decode_tok_s, args.min_tokens)
    rng = random.Random(0)
    rows = [{"prompt": f"What is {i} + {i + 1}?", "keep": rng.random() < args.kept} for i in range(100_000)]
    cfg = RolloutConfig(
        num_generations=args.g,
        max_completion_length=args.max_tokens,
        num_sampler_logprobs=0,
        max_staleness=args.max_staleness,
        max_concurrent_rollouts=args.max_concurrent,
    )
    allowance = CountingAllowance(cfg.max_staleness, args.first_step_tokens)
    queue = SampleQueue(allowance, with_topk=False)
    stop, waits, series = threading.Event(), [], []

    async def go() -> None:
        client = GenerationClient(server.url, max_connections=cfg.max_concurrent_rollouts, timeout_s=300, max_retries=0)
        runtime = LoopRuntime(
            tokenizer=tokenizer,
            server=ReplicaSet([client]),
            model_name="m",
            max_model_len=2048,
            dataset=rows,
            queue=queue,
            allowance=allowance,
            reward_functions=[keep_pattern],
        )
        task = asyncio.create_task(drive(RolloutLoop(cfg, runtime)))
        consumer = threading.Thread(
            target=consume, args=(queue, allowance, args.step_raw, args.train_s, stop, waits), daemon=True
        )
        consumer.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            assert not task.done(), task.exception()
            series.append((time.monotonic() - t0, server.held, allowance.limit))
            await asyncio.sleep(0.05)
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()

    generated0 = generated[0]
    asyncio.run(go())
    server.stop()
    steady = [n for t, n, _ in series if t >= args.seconds / 4]
    return {
        "decode_tok_s_per_request": args.decode_tok_s,
        "g": args.g,
        "kept": args.kept,
        "max_staleness": args.max_staleness,
        "step_raw_tokens": args.step_raw,
        "train_s": args.train_s,
        "seconds": args.seconds,
        "steps": len(waits),
        "in_flight_mean": statistics.fmean(steady),
        "in_flight_max": max(n for _, n, _ in series),
        "generated_tok_s": (generated[0] - generated0) / args.seconds,
        "consumer_wait_s_median": statistics.median(waits) if waits else float("nan"),
        "allowance_limit_last": series[-1][2],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--decode-tok-s", type=float, default=100.0, help="per request (vLLM decode on a small model)")
    p.add_argument("--min-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--g", type=int, default=8)
    p.add_argument("--kept", type=float, default=1 / 3, help="share of groups whose rewards differ")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--max-concurrent", type=int, default=512)
    p.add_argument("--step-raw", type=int, default=56_000, help="raw tokens the trainer takes per step")
    p.add_argument("--first-step-tokens", type=int, default=32_768)
    p.add_argument("--train-s", type=float, default=1.5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        width = max(map(len, result))
        for k, v in result.items():
            print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
