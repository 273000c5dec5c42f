"""Weight-sync timing on the real servers of a run config: ``perf/weight_sync_*`` per sync, and a check that the
weights arrived (issue 25, item 5). ``scripts/gpu_main_job.sh sync`` runs it on a GPU host (real vLLM 0.25.1).

Starts the config's servers (``grpo_core.serving.launch.provision``: every replica of ``server.num_replicas``), loads
the policy the trainer would hold and pushes it with the trainer's own weight sync
(``grpo_core.train.run.make_weight_sync``: vLLM's IPC/NCCL transfer from the persistent packed buffer, or the embedded
server's folder update), ``--syncs`` times while ``--load`` generations per replica keep the engines busy, perturbing
the weights before each (an optimizer step). The check (greedy, 16 tokens, on every replica): the perturbed weights
change the continuation, and syncing the original weights back gives the first continuation exactly.

    python benchmarks/gpu_sync_timing.py --config configs/gpu-1xh200.yaml --out $OUT      # GPU
    python benchmarks/gpu_sync_timing.py --cpu-smoke --syncs 3 --load 0 --out /tmp/st    # CPU: the plumbing only

Prints a table (median over the syncs after the first, which sets up) and writes ``sync_timing.json`` under
``--out``; exit code 0 when the check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.long_generation_sync import CPU_SMOKE, PROMPT, perturb, trainer_policy  # noqa: E402
from grpo_core.config import load_config  # noqa: E402
from grpo_core.serving.client import GenerationClient  # noqa: E402
from grpo_core.serving.launch import provision, teardown  # noqa: E402
from grpo_core.train.run import make_weight_sync  # noqa: E402


async def greedy(urls: list[str], model: str) -> list[list[int]]:
    """16 greedy tokens after PROMPT from every replica."""

    async def one(url: str) -> list[int]:
        async with GenerationClient(url, timeout_s=120, max_retries=1) as client:
            (out,) = await client.complete(PROMPT, model=model, max_tokens=16, temperature=0.0, ignore_eos=True)
            return list(out.token_ids)

    return list(await asyncio.gather(*(one(u) for u in urls)))


def background_load(urls: list[str], model: str, per_replica: int, stop: threading.Event) -> threading.Thread:
    """``per_replica`` generations of 256 tokens in flight on every replica until ``stop`` (0: none)."""

    async def worker(url: str) -> None:
        async with GenerationClient(url, timeout_s=600, max_retries=2) as client:
            while not stop.is_set():
                try:
                    await client.complete(PROMPT, model=model, max_tokens=256, temperature=1.0, ignore_eos=True)
                except Exception:  # noqa: BLE001 - load only: a request cut short is not what is measured
                    await asyncio.sleep(0.1)

    async def run() -> None:
        await asyncio.gather(*(worker(u) for u in urls for _ in range(per_replica)))

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    if per_replica > 0:
        thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "gpu-1xh200.yaml"))
    p.add_argument("--syncs", type=int, default=8, help="timed syncs (default 8; the first one sets up)")
    p.add_argument("--load", type=int, default=32, help="generations in flight per replica during the syncs")
    p.add_argument("--out", type=Path, default=Path("runs/sync-timing"))
    p.add_argument("--cpu-smoke", action="store_true", help="the embedded server on CPU (the plumbing only)")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE config overrides")
    args = p.parse_args(argv)
    if args.syncs < 2:
        p.error("--syncs must be >= 2")
    work = args.out.resolve() / "run"
    overrides = [
        "server.port=0",
        f"server.log_dir={work / 'servers'}",
        f"train.output_dir={work}",
        "train.lora.enabled=false",
    ]
    cfg = load_config(args.config, (CPU_SMOKE if args.cpu_smoke else []) + overrides + args.set)
    if cfg.server.backend == "vllm" and cfg.server.weight_transfer_backend is None:
        p.error(
            f"{args.config}: server.weight_transfer_backend is null (a LoRA config: only the adapter travels, "
            "through files); this benchmark times full-weight syncs: use a config with 'ipc' or 'nccl', and "
            "`scripts/gpu_main_job.sh e2e=1xh200-lora` for the adapter's sync"
        )
    handles = provision(cfg)
    rows: list[dict[str, float]] = []
    try:
        urls = [h.url for h in handles]
        model = cfg.served_model_name()
        policy = trainer_policy(cfg)
        original = {n: t.detach().clone() for n, t in policy.state_dict().items()}
        sync = make_weight_sync(cfg.trainer_process(), urls)
        first = asyncio.run(greedy(urls, model))
        stop = threading.Event()
        loader = background_load(urls, model, args.load, stop)
        try:
            for version in range(1, args.syncs + 1):
                perturb(policy, scale=0.5 if version == 1 else 1e-3)
                rows.append(sync.sync(policy, version, rank=0))
                if version == 1:
                    moved = asyncio.run(greedy(urls, model))
        finally:
            stop.set()
            if loader.is_alive():
                loader.join(timeout=120)
        policy.load_state_dict(original)
        sync.sync(policy, args.syncs + 1, rank=0)
        back = asyncio.run(greedy(urls, model))
    finally:
        teardown(handles)
    ok = back == first and all(m != f for m, f in zip(moved, first))
    keys = sorted({k for r in rows for k in r if k.startswith("perf/")})
    steady = rows[1:]
    median = {k: sorted(r[k] for r in steady if k in r)[len(steady) // 2] for k in keys}
    result = {
        "servers": len(urls),
        "backend": handles[0].spec.backend,
        "sync": type(sync).__name__,
        "params": sum(t.numel() for t in original.values()),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_per_replica": args.load,
        "first_sync": rows[0],
        "median_after_first": median,
        "syncs": rows,
        "weights_arrived": ok,
    }
    print(f"{result['sync']} to {len(urls)} {result['backend']} server(s), {args.load} generations in flight each")
    print("| metric | first sync | median of the rest |\n|---|---|---|")
    for k in keys:
        print(f"| {k} | {rows[0].get(k, float('nan')):.4f} | {median[k]:.4f} |")
    print(f"weights arrived (greedy check on every replica): {ok}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sync_timing.json").write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
