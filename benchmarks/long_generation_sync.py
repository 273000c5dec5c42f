"""Does a long generation survive a weight sync intact? The real server, the run's own weight sync.

Starts the generation server of a run config (real vLLM on a GPU, or the embedded server with
``--cpu-smoke``) through ``grpo_core.serving.launch.provision``, loads the policy the trainer would
hold, perturbs it (as an optimizer step would) and, while one ``--tokens``-token generation is in
flight, pushes it with the trainer's own weight sync (``grpo_core.train.run.make_weight_sync``:
vLLM's IPC/NCCL weight transfer or the embedded server's folder update). Expected: the
generation ends with ``finish_reason: "length"`` and every token. For contrast it then does what
grpo-flow did before keep mode, a ``POST /pause`` with no mode, during a second generation:
vLLM 0.25.1 answers that one with ``finish_reason: "abort"`` after a few tokens.

    python benchmarks/long_generation_sync.py --config configs/gpu-1xh200.yaml --out $OUT     # H200
    python benchmarks/long_generation_sync.py --cpu-smoke --tokens 200 --out /tmp/lg          # CPU

Writes ``long_generation_sync.json`` under ``--out`` and prints it; exit code 0 when the sync kept
the generation intact while it was in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from grpo_core.config import RunConfig, load_config  # noqa: E402
from grpo_core.models import resolve_model_dir  # noqa: E402
from grpo_core.security.auth import bearer_headers, run_token  # noqa: E402
from grpo_core.serving.client import GenerationClient  # noqa: E402
from grpo_core.serving.launch import provision, teardown  # noqa: E402
from grpo_core.train.policy import Policy, build_policy  # noqa: E402
from grpo_core.train.run import make_weight_sync  # noqa: E402

PROMPT = [1, 9038, 2684, 28, 253, 1046, 314, 2117]
CPU_SMOKE = [
    "model.name=tiny-qwen3",
    "model.dtype=auto",
    "server.backend=embedded",
    "server.gpu_ids=null",
    "server.embedded_num_threads=1",
    "train.device=cpu",
    "train.gpu_ids=null",
]


def generated(url: str) -> float:
    """``vllm:generation_tokens_total`` (cumulative generated tokens of the server)."""
    text = httpx.get(url + "/metrics", headers=bearer_headers(run_token()), timeout=10).text
    found = re.search(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)", text, re.M)
    return float(found.group(1)) if found else 0.0


def trainer_policy(cfg: RunConfig) -> Policy:
    """The policy the trainer holds before sharding (``grpo_core.train.policy.build_policy`` with the run's
    model, ``train.dtype`` and device), so the sync reads the same module (``policy.base()``, parameter
    names, dtypes) as in a run."""
    tc = cfg.train
    device = torch.device("cuda" if tc.device == "cuda" else "cpu")
    return build_policy(
        str(resolve_model_dir(cfg.model)),
        cfg.model,
        dtype=getattr(torch, tc.dtype),
        device=device,
        lora=tc.lora,
        temperature=cfg.rollout.temperature,
        chunk_size=1024,
    )


def perturb(policy: torch.nn.Module, scale: float = 1e-3) -> None:
    """Move every weight by ``scale`` times its own standard deviation (a large optimizer step)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            noise = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
            p.add_(noise * scale * p.float().std().clamp_min(1e-3).to(p.dtype))


async def one_case(url: str, model: str, tokens: int, interrupt) -> dict:
    """Start a ``tokens``-token generation, run ``interrupt()`` once it is producing, report how it ended."""
    async with GenerationClient(url, timeout_s=600, max_retries=0) as client:
        start = generated(url)
        t0 = time.monotonic()
        task = asyncio.create_task(
            client.complete(
                PROMPT, model=model, max_tokens=tokens, temperature=1.0, seed=7, ignore_eos=True, num_logprobs=1
            )
        )
        while generated(url) <= start + 8 and not task.done():
            await asyncio.sleep(0.02)
        at_s = time.monotonic() - t0
        await asyncio.to_thread(interrupt)
        in_flight = not task.done()
        (out,) = await task
        return {
            "finish_reason": out.finish_reason,
            "tokens": len(out.token_ids),
            "asked": tokens,
            "interrupt_at_s": round(at_s, 3),
            "in_flight_after_interrupt": in_flight,
            "total_s": round(time.monotonic() - t0, 3),
        }


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "gpu-1xh200.yaml"))
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--out", type=Path, default=Path("runs/long-generation"))
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args(argv)
    work = args.out.resolve() / "run"  # servers' logs and the trainer output folder (synced weights)
    cfg = load_config(
        args.config,
        (CPU_SMOKE if args.cpu_smoke else [])
        + [
            "server.port=0",
            f"server.max_model_len={args.tokens + 64}",
            f"rollout.max_completion_length={args.tokens}",
            f"server.log_dir={work / 'servers'}",
            f"train.output_dir={work}",
            "train.lora.enabled=false",
            *args.set,
        ],
    )
    handles = provision(cfg)
    try:
        url = handles[0].url
        policy = trainer_policy(cfg)
        perturb(policy)
        sync = make_weight_sync(cfg.trainer_process(), [url])
        name = cfg.served_model_name()
        keep = asyncio.run(one_case(url, name, args.tokens, lambda: sync.sync(policy, 1, rank=0)))
        auth = bearer_headers(run_token())
        no_mode = asyncio.run(
            one_case(
                url,
                name,
                args.tokens,
                lambda: (
                    httpx.post(url + "/pause", headers=auth, timeout=60),
                    httpx.post(url + "/resume", headers=auth, timeout=60),
                ),
            )
        )
    finally:
        teardown(handles)
    ok = keep["finish_reason"] == "length" and keep["tokens"] == args.tokens and keep["in_flight_after_interrupt"]
    result = {
        "server": handles[0].spec.backend,
        "sync": type(sync).__name__,
        "keep_mode_sync": keep,
        "pause_without_mode": no_mode,
        "intact": ok,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long_generation_sync.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
