"""Rollout pacing against a server of known speed: does the token allowance keep the server busy?

On the H200 (``configs/gpu-1xh200.yaml``, real vLLM with CUDA graphs) the rollout kept on average 38 requests
running (polled per step; 11 over the whole run, 143 at most) out of ``server.max_num_seqs: 256``, KV usage stayed
below 0.3%, and the trainer waited 30 of every 32 s for samples. This benchmark runs the real rollout loop
(:func:`grpo_core.rollout.driver.drive` with its :class:`~grpo_core.rollout.pace.TokenAllowance`) against a
real HTTP server whose speed is a parameter, with a consumer that acts like the trainer (it takes a step's raw
tokens, "trains" for ``--train-s`` and reports the step), so the pacing alone decides the load:

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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from grpo_core.config import ModelConfig, RolloutConfig  # noqa: E402
from grpo_core.models import resolve_model_dir  # noqa: E402
from grpo_core.rollout.driver import drive  # noqa: E402
from grpo_core.rollout.loop import LoopRuntime, RolloutLoop  # noqa: E402
from grpo_core.rollout.pace import TokenAllowance  # noqa: E402
from grpo_core.rollout.queue import SampleQueue  # noqa: E402
from grpo_core.serving.client import GenerationClient  # noqa: E402
from grpo_core.serving.replicas import ReplicaSet  # noqa: E402


class TimedServer(ThreadingHTTPServer):
    """``/v1/completions`` answering after ``length / decode_tok_s`` seconds; counts requests in flight."""

    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, decode_tok_s: float, min_tokens: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.decode_tok_s, self.min_tokens = decode_tok_s, min_tokens
        self.lock = threading.Lock()
        self.in_flight = 0
        self.generated = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: TimedServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self._answer(404, b"")  # no /metrics: the concurrency cap stays at its ceiling

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        length = random.Random(body["seed"]).randint(min(srv.min_tokens, body["max_tokens"]), body["max_tokens"])
        with srv.lock:
            srv.in_flight += 1
        time.sleep(length / srv.decode_tok_s)
        with srv.lock:
            srv.in_flight -= 1
            srv.generated += length
        ids = [7] * length
        choice = {
            "index": 0,
            "text": "x" * length,
            "token_ids": ids,
            "prompt_token_ids": body["prompt"],
            "logprobs": {"token_logprobs": [-1.0] * length},
            "finish_reason": "length",
        }
        self._answer(200, json.dumps({"choices": [choice]}).encode())

    def _answer(self, status: int, data: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the loop ended
            pass


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
    server = TimedServer(args.decode_tok_s, args.min_tokens)
    threading.Thread(target=server.serve_forever, daemon=True).start()
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
            series.append((time.monotonic() - t0, server.in_flight, allowance.limit))
            await asyncio.sleep(0.05)
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()

    generated0 = server.generated
    asyncio.run(go())
    server.shutdown()
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
        "generated_tok_s": (server.generated - generated0) / args.seconds,
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
