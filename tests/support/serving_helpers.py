"""Helpers of the serving tests: start real embedded servers, recompute log-probs independently."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from grpo_core.config import ModelConfig, RunConfig
from grpo_core.security.auth import bearer_headers, run_token
from grpo_core.serving.guard import ADAPTER_DIR_ENV, WEIGHTS_DIR_ENV
from grpo_core.serving.launch import ServerHandle, provision, teardown

TINY = "tiny-qwen3"


@contextmanager
def embedded_server(
    log_dir: Path, model: str = TINY, output_dir: Path | None = None, lora_r: int | None = None, **server: object
) -> Iterator[ServerHandle]:
    """Start one embedded replica on 127.0.0.1 (free port, 1 CPU thread) through ``provision``.

    It loads adapters and full weights only from ``<output_dir>/.vllm_lora`` and ``<output_dir>/.weights``
    (``output_dir`` default ``<log_dir>/run``; the folders are ``adapter_dir`` / ``weights_dir`` below).
    ``lora_r``: the rank of the trainer's LoRA adapter it must accept (``train.lora.r``).
    """
    settings = {
        "backend": "embedded",
        "port": 0,
        "embedded_num_threads": 1,
        "max_model_len": 256,
        "max_num_seqs": 64,
        "log_dir": log_dir,
        "startup_timeout_s": 180,
        **server,
    }
    lora = {"lora": {"enabled": True, "r": lora_r}} if lora_r is not None else {}
    config = RunConfig(
        model=ModelConfig(name=model),
        server=settings,
        train={"output_dir": output_dir or Path(log_dir) / "run", **lora},
        rollout={"max_completion_length": 64, "num_sampler_logprobs": 4},
    )
    handles = provision(config)
    try:
        yield handles[0]
    finally:
        teardown(handles)


def adapter_dir(handle: ServerHandle) -> Path:
    """The only folder ``handle``'s server loads LoRA adapters from."""
    return Path(handle.spec.env[ADAPTER_DIR_ENV])


def weights_dir(handle: ServerHandle) -> Path:
    """The only folder ``handle``'s server reads full weights from."""
    return Path(handle.spec.env[WEIGHTS_DIR_ENV])


def holds_version(url: str, version: int) -> None:
    """Tell ``url``'s guard it holds policy ``version``: the last call of every full-weight sync (a test playing the
    trainer sends it with ``report``/``synced``, or the guard refuses the rollout's requests for ``version``)."""
    httpx.post(
        url + "/grpo/stale", json={"stale": False, "version": version}, headers=bearer_headers(run_token()), timeout=10
    ).raise_for_status()


def run(coro):
    """Run a coroutine to completion in a fresh event loop."""
    return asyncio.run(coro)


def reference_logprobs(
    model: torch.nn.Module,
    prompt: list[int],
    output: list[int],
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """Processed log-probs of ``output`` given ``prompt``, from one unbatched forward pass.

    Written independently of ``grpo_core.serving.embedded.sampling``: log-softmax of logits / T
    renormalised over the candidate set (min-p relative to the top probability, then top-k,
    then top-p keeping the smallest prefix of descending probabilities whose mass reaches p).

    Returns:
        ``[len(output)]`` float32 log-probs (``-inf`` if a token fell outside the set).
    """
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature == 0:
        return logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)
    logits = logits / temperature
    keep = torch.ones_like(logits, dtype=torch.bool)
    if min_p > 0:
        probs = logits.softmax(-1)
        keep &= probs >= min_p * probs.max(-1, keepdim=True).values
    masked = logits.masked_fill(~keep, float("-inf"))
    if top_k > 0:
        keep &= masked >= masked.topk(top_k, -1).values[:, -1:]
    masked = logits.masked_fill(~keep, float("-inf"))
    if top_p < 1:
        probs, order = masked.softmax(-1).sort(-1, descending=True)
        mass_before = probs.cumsum(-1) - probs
        keep_sorted = mass_before < top_p
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    masked = logits.masked_fill(~keep, float("-inf"))
    return masked.log_softmax(-1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def generated_tokens(url: str) -> float:
    """The server's own count of generated tokens (``vllm:generation_tokens_total`` from ``/metrics``)."""
    text = httpx.get(url + "/metrics", headers=bearer_headers(run_token()), timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:generation_tokens_total"
    )


#: Routes a listener of the run answers without a token: liveness only.
OPEN_ROUTES = frozenset({("GET", "/health"), ("HEAD", "/health")})
#: Request headers that must not open a guarded route: none, a wrong bearer token, another scheme.
BAD_AUTH = ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": "Basic abc"})


def app_routes(app) -> list[tuple[str, str]]:
    """``(method, path)`` of every route of ``app``, read from ``app.routes`` (FastAPI's own docs routes included;
    a path parameter is filled with ``x``), so a route added later is checked without editing a test.

    Raises:
        AssertionError: a route without HTTP methods (a mount, a websocket): the caller cannot probe it this way.
    """
    import re

    found = []
    for route in app.routes:
        methods = getattr(route, "methods", None)
        assert methods, f"route {route!r} has no HTTP methods: probe it in its own test"
        found += [(method, re.sub(r"\{[^}]*\}", "x", route.path)) for method in sorted(methods)]
    return found


async def answers_without_token(app, routes: list[tuple[str, str]]) -> dict[tuple[str, str, str], int]:
    """Status of each route of ``routes`` asked in-process (ASGI) with each of :data:`BAD_AUTH`'s headers, keyed by
    ``(method, path, Authorization header)``."""
    status = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://listener") as http:
        for headers in BAD_AUTH:
            for method, path in routes:
                answer = await http.request(method, path, headers=headers)
                status[(method, path, headers.get("Authorization", "-"))] = answer.status_code
    return status
