"""Engine calibration: one generation engine's decode-step time against running sequences, and K engines on one GPU.

The throughput model of issue 25 says one vLLM engine serving a small model spends ``a + b × running sequences``
per decode step (host-side work; the GPU mostly waits), so that several engines with fewer sequences each generate
more. This benchmark measures it on the servers a run starts (``grpo_core.serving.launch.provision`` on a run config,
``configs/gpu-1xh200.yaml`` by default, with the model and replica count overridden):

* **sweep**: for each concurrency N, N requests start together, each for exactly T tokens (``ignore_eos``, random
  prompts of ``--prompt-tokens`` ids, G requests per prompt as a group's rollouts are), once with T = ``--short`` and
  once with T = ``--tokens``; the decode-step time is ``(wall_long − wall_short) / (long − short)`` (prefill, HTTP
  and start-up cancel), generated tok/s is ``N × long / wall_long``. A least-squares line through the step times
  gives ``a`` (ms) and ``b`` (µs per running sequence).
* **variants** at a few N: each rollout seeded (``seed``: vLLM samples seeded rows one by one), and one request of
  ``n = G`` per group instead of G requests.
* **engines**: ``--engines 1,2,4`` starts K replicas on GPU 0 (memory split: ``--memory`` / K each; started one after
  another, as ``provision`` starts replicas that share a GPU) and sends the same total concurrency spread over them
  by group (plain, and with ``n = G`` when ``--variants`` has ``n``); aggregate generated tok/s against the model's
  prediction ``N / (a + b × N / K)``.

On a GPU host with the vLLM bundle (``scripts/gpu_main_job.sh calib``)::

    python benchmarks/engine_calibration.py --model random-smollm2-135m --engines 1,2 --out /tmp/calib.json

On CPU (``--backend embedded``, a tiny model, small sizes) it only checks that the benchmark runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from grpo_core.config import RunConfig, load_config
from grpo_core.security.auth import bearer_headers, ensure_run_token
from grpo_core.serving.client import GenerationClient
from grpo_core.serving.launch import ServerHandle, provision, teardown


def engine_config(args: argparse.Namespace, engines: int, log_dir: Path) -> RunConfig:
    """The run config of ``--config`` with the calibration's model, replicas on GPU 0 and memory split."""
    overrides = [
        f"model.name={args.model}",
        f"server.backend={args.backend}",
        f"server.num_replicas={engines}",
        f"server.log_dir={log_dir}",
        f"server.max_num_seqs={args.max_num_seqs}",
        f"server.max_model_len={args.prompt_tokens + args.tokens + 8}",
        *args.set,
    ]
    if args.backend == "vllm":
        overrides += [
            f"server.gpu_ids={json.dumps([0] * engines)}",
            f"server.gpu_memory_utilization={round(args.memory / engines, 4)}",
        ]
    return load_config(args.config, overrides)


async def burst(
    urls: list[str], model: str, concurrency: int, tokens: int, args: argparse.Namespace, variant: str, rng
) -> tuple[float, int]:
    """Start ``concurrency`` rollouts together (groups of ``--group-size`` share a prompt; groups go round-robin over
    the engines); returns (wall seconds until the last ends, generated tokens).

    Each request goes through the rollout's own client (``GenerationClient.complete``, aiohttp, every sampling field
    sent: top-k off, top-p 1, temperature 1), with ``ignore_eos`` so that each continuation is exactly ``tokens``
    long, and no retries (a failed request fails the burst instead of being timed twice)."""
    g = args.group_size
    groups = max(1, concurrency // g)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(groups)]
    ensure_run_token()  # the servers provision started check the run's key; the clients send it
    clients = [GenerationClient(url, max_connections=concurrency + 8, timeout_s=900.0, max_retries=0) for url in urls]
    try:
        jobs = []
        for k, prompt in enumerate(prompts):
            client = clients[k % len(clients)]
            sample = {"model": model, "max_tokens": tokens, "ignore_eos": True}
            if variant == "n":
                jobs.append(client.complete(prompt, n=g, **sample))
            else:
                for i in range(g):
                    jobs.append(client.complete(prompt, seed=k * g + i if variant == "seed" else None, **sample))
        start = time.perf_counter()
        answers = await asyncio.gather(*jobs)
        wall_s = time.perf_counter() - start
        return wall_s, sum(len(c.token_ids) for completions in answers for c in completions)
    finally:
        for client in clients:
            await client.aclose()


def reset(urls: list[str]) -> None:
    """Empty every engine's prefix cache (each burst's prompts are new anyway; this keeps the KV cache free)."""
    with httpx.Client(headers=bearer_headers(ensure_run_token()), timeout=60) as client:
        for url in urls:
            client.post(url + "/reset_prefix_cache")


def measure(urls: list[str], model: str, n: int, variant: str, args: argparse.Namespace, rng) -> dict:
    """One concurrency point: short and long bursts; the decode-step time and generated tok/s."""
    reset(urls)
    short_s, _ = asyncio.run(burst(urls, model, n, args.short, args, variant, rng))
    reset(urls)
    long_s, generated = asyncio.run(burst(urls, model, n, args.tokens, args, variant, rng))
    step_ms = (long_s - short_s) / (args.tokens - args.short) * 1000
    return {
        "variant": variant,
        "engines": len(urls),
        "running": n,
        "step_ms": round(step_ms, 3),
        "generated_tokens_per_s": round(generated / long_s, 1),
        "wall_long_s": round(long_s, 3),
        "wall_short_s": round(short_s, 3),
    }


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns (a, b)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - b * mx, b


def served_model(handles: list[ServerHandle]) -> str:
    """The model name the replicas serve (``/v1/models``)."""
    with httpx.Client(headers=bearer_headers(ensure_run_token()), timeout=30) as client:
        return client.get(handles[0].url + "/v1/models").json()["data"][0]["id"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; prints one table and writes ``--out`` (JSON)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/gpu-1xh200.yaml")
    p.add_argument("--set", action="append", default=[], help="override of --config, key=value (repeatable)")
    p.add_argument("--backend", default="vllm", choices=["vllm", "embedded"])
    p.add_argument("--model", default="random-smollm2-135m")
    p.add_argument("--engines", default="1", help="comma-separated engine counts on GPU 0, e.g. 1,2,4")
    p.add_argument("--concurrency", default="8,16,32,64,128,256,512", help="running sequences of the sweep")
    p.add_argument("--engine-concurrency", default="256,512", help="total running sequences with K > 1 engines")
    p.add_argument("--variants", default="seed,n", help="variants measured at --variant-concurrency (1 engine)")
    p.add_argument("--variant-concurrency", default="64,256")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rollout of the long burst")
    p.add_argument("--short", type=int, default=32, help="tokens per rollout of the short burst")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--memory", type=float, default=0.6, help="GPU memory fraction of all engines together")
    p.add_argument("--fit", help="a, b of an earlier sweep (ms,us), for predictions when 1 is not in --engines")
    p.add_argument("--log-dir", default="runs/engine-calibration")
    p.add_argument("--out", help="write the rows and the fit as JSON here")
    args = p.parse_args(argv)
    rng = random.Random(0)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    rows: list[dict] = []
    fit: dict = {}
    if args.fit:
        a_ms, b_us = (float(x) for x in args.fit.split(","))
        fit.update(a_ms=a_ms, b_us=b_us)
    result = {"model": args.model, "backend": args.backend, "rows": rows, "fit": fit}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))

    for engines in ints(args.engines):
        log_dir = Path(args.log_dir) / f"engines-{engines}"
        log_dir.mkdir(parents=True, exist_ok=True)
        config = engine_config(args, engines, log_dir)
        started = time.perf_counter()
        handles = provision(config)
        urls = [h.url for h in handles]
        print(f"{engines} engine(s) healthy after {time.perf_counter() - started:.0f} s", flush=True)
        try:
            model = served_model(handles)
            if engines == 1:
                for n in ints(args.concurrency):
                    rows.append(measure(urls, model, n, "plain", args, rng))
                    print(rows[-1], flush=True)
                    save()
                a, b = fit_line([(r["running"], r["step_ms"]) for r in rows if r["variant"] == "plain"])
                fit.update(a_ms=round(a, 3), b_us=round(b * 1000, 2))
                for variant in [v for v in args.variants.split(",") if v]:
                    for n in ints(args.variant_concurrency):
                        rows.append(measure(urls, model, n, variant, args, rng))
                        print(rows[-1], flush=True)
                        save()
            else:
                for variant in ["plain", *(v for v in args.variants.split(",") if v == "n")]:
                    for n in ints(args.engine_concurrency):
                        row = measure(urls, model, n, variant, args, rng)
                        if fit and variant == "plain":
                            step_s = (fit["a_ms"] + fit["b_us"] / 1000 * n / engines) / 1000
                            row["predicted_tokens_per_s"] = round(n / step_s, 1)
                        rows.append(row)
                        print(row, flush=True)
                        save()
        finally:
            teardown(handles)
    print(
        f"\nengine calibration: {args.model} ({args.backend}); fit a = {fit.get('a_ms')} ms, b = {fit.get('b_us')} µs"
    )
    print(f"{'variant':8} {'engines':>7} {'running':>7} {'step ms':>8} {'gen tok/s':>10} {'predicted':>10}")
    for r in rows:
        print(
            f"{r['variant']:8} {r['engines']:7d} {r['running']:7d} {r['step_ms']:8.2f} "
            f"{r['generated_tokens_per_s']:10.0f} {r.get('predicted_tokens_per_s', ''):>10}"
        )
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
