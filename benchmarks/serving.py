"""Generation throughput of the embedded server vs a naive one-request-at-a-time ``generate`` loop.

Starts the embedded server (SmolLM2-135M-Instruct by default, float32 on CPU) through
``grpo_core.serving.launch.provision``, then, with the server idle in between, measures:

- ``embedded cN``: N concurrent requests (N in ``--concurrency``) of ``--max-tokens`` new
  tokens each (``ignore_eos``, temperature 1, distinct seeds, ``logprobs=0`` as the rollout
  asks), sent through ``GenerationClient``; generated tokens / wall time of the burst.
- ``naive``: the same model in this process, ``model.generate`` with sampling, one request at
  a time (``--naive-requests`` of them, ``min_new_tokens`` = ``max_new_tokens``), same threads.

Both sides use ``--threads`` torch threads. Prints a rich table, or one JSON object with ``--json``.

Usage::

    .venv/bin/python benchmarks/serving.py            # table
    .venv/bin/python benchmarks/serving.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from common import git_commit

from grpo_core.config import ModelConfig, RunConfig
from grpo_core.serving.client import GenerationClient
from grpo_core.serving.launch import provision, teardown

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a short poem about the sea.",
    "How do I sort a list in Python?",
    "What causes the seasons on Earth?",
    "Give three tips for learning a language.",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
]


def prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` chat prompts (token ids), cycling through ``QUESTIONS``."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for i in range(count)
    ]


async def burst(url: str, model: str, batch: list[list[int]], max_tokens: int) -> dict:
    """Send all prompts at once; returns generated tokens, wall seconds and tokens/s."""
    async with GenerationClient(url, max_connections=len(batch), timeout_s=3600) as client:
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(
                client.complete(p, model=model, max_tokens=max_tokens, seed=i, ignore_eos=True)
                for i, p in enumerate(batch)
            )
        )
        wall = time.perf_counter() - start
    tokens = sum(len(o[0].token_ids) for o in outs)
    return {"generated_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def naive_loop(model_name: str, batch: list[list[int]], max_tokens: int, threads: int) -> dict:
    """``model.generate`` one request at a time in this process."""
    import torch

    from grpo_core.models import load_model

    torch.set_num_threads(threads)
    model, _ = load_model(ModelConfig(name=model_name))
    tokens, start = 0, time.perf_counter()
    for i, prompt in enumerate(batch):
        torch.manual_seed(i)
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
        )
        tokens += out.shape[1] - ids.shape[1]
    wall = time.perf_counter() - start
    return {"generated_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def run(args: argparse.Namespace) -> dict:
    """Start the server, run the bursts, then the naive loop; returns all figures."""
    from grpo_core.models import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(name=args.model))
    with tempfile.TemporaryDirectory() as tmp:
        config = RunConfig(
            model={"name": args.model},
            server={
                "backend": "embedded",
                "port": 0,
                "max_model_len": args.max_model_len,
                "max_num_seqs": max(args.concurrency),
                "embedded_num_threads": args.threads,
                "log_dir": Path(tmp),
                "startup_timeout_s": 600,
            },
            rollout={"max_completion_length": args.max_tokens},
        )
        handles = provision(config)
        try:
            url = handles[0].url
            asyncio.run(burst(url, args.model, prompts(tokenizer, 2), 8))  # warm-up
            results = {
                f"embedded_c{c}": asyncio.run(burst(url, args.model, prompts(tokenizer, c), args.max_tokens))
                for c in args.concurrency
            }
        finally:
            teardown(handles)
    results["naive"] = naive_loop(args.model, prompts(tokenizer, args.naive_requests), args.max_tokens, args.threads)
    for row in results.values():
        row["speedup_vs_naive"] = row["tokens_per_s"] / results["naive"]["tokens_per_s"]
    return {
        "benchmark": "serving",
        "model": args.model,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "commit": git_commit(),
        "results": results,
    }


def print_table(report: dict) -> None:
    """A rich table of the figures."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Generation, {report['model']}, {report['max_tokens']} new tokens, "
        f"{report['threads']} threads ({report['hardware']}, {report['commit']})"
    )
    for column in ("setting", "generated tokens", "wall s", "tokens/s", "× naive"):
        table.add_column(column, justify="right")
    for name, row in report["results"].items():
        table.add_row(
            name,
            str(row["generated_tokens"]),
            f"{row['wall_s']:.1f}",
            f"{row['tokens_per_s']:.1f}",
            f"{row['speedup_vs_naive']:.2f}",
        )
    Console().print(table)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run, print."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--naive-requests", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, server and naive loop")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
