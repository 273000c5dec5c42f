"""FastAPI app of one simulated engine: the vLLM HTTP surface the rollout and the weight sync use.

Routes, with vLLM 0.25.1's paths and JSON shapes (``grpo_core.serving.protocol``; ``shared/vllm-h200/README.md``):
``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` (token-id prompts only, ``n``, ``max_tokens``,
``ignore_eos``, ``stop_token_ids``, ``logprobs``, ``return_token_ids``, ``return_tokens_as_token_ids``; finish
reasons ``stop``/``length``/``abort``), ``GET /metrics`` (``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:num_preemptions``,
``vllm:generation_tokens``, ``vllm:prompt_tokens``, ``vllm:cache_config_info``), ``POST /pause?mode=`` (no mode
aborts, as vLLM), ``POST /resume``, ``GET /is_paused``, the full-weight sequence ``/init_weight_transfer_engine``
→ ``/start_weight_update`` (pauses in keep mode unless paused) → ``/update_weights`` (any ``update_info``; takes
``update_s``, advances the served version) → ``/finish_weight_update`` (resumes what start paused) →
``/reset_prefix_cache``, ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, ``POST /grpo/stale``
(the guard's fence: ``version`` sets the served version), ``GET /server_info``, ``GET /get_world_size``, and the
simulator's own ``GET /sim/stats`` (:meth:`~grpo_core.serving.simulated.engine.SimEngine.stats`).

No run guard: no token is checked; the servers bind loopback unless told otherwise
(:mod:`grpo_core.serving.simulated.server`). Text prompts are refused (there is no tokenizer) and completion
``text`` is empty.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from grpo_core.serving.guard import STALE_PATH
from grpo_core.serving.protocol import (
    CompletionRequest,
    LoadLoraRequest,
    UnloadLoraRequest,
    UpdateWeightsRequest,
    completion_response,
    error_response,
)
from grpo_core.serving.simulated.engine import PAUSE_MODES, SimEngine, SimSequence


class _Collector:
    """vLLM's metric names read from the engine at scrape time."""

    def __init__(self, engine: SimEngine, index: int) -> None:
        self.engine, self.index = engine, index

    def collect(self) -> Any:
        stats, engine = self.engine.stats(), self.engine
        labels, values = ["engine", "model_name"], [str(self.index), engine.settings.model_name]
        for name, value in (
            ("vllm:num_requests_running", stats["running"]),
            ("vllm:num_requests_waiting", stats["waiting"]),
            ("vllm:kv_cache_usage_perc", stats["kv_usage"]),
        ):
            gauge = GaugeMetricFamily(name, name, labels=labels)
            gauge.add_metric(values, value)
            yield gauge
        for name, value in (
            ("vllm:num_preemptions", 0),
            ("vllm:prompt_tokens", stats["prompt_tokens"]),
            ("vllm:generation_tokens", stats["generated_tokens"]),
        ):
            counter = CounterMetricFamily(name, name, labels=labels)
            counter.add_metric(values, value)
            yield counter
        size = str(engine.settings.kv_budget_tokens)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV cache",
            labels=["engine", "block_size", "num_gpu_blocks", "kv_cache_size_tokens"],
        )
        info.add_metric([str(self.index), "1", size, size], 1.0)
        yield info


def _sequences(engine: SimEngine, request: CompletionRequest) -> list[SimSequence] | JSONResponse:
    """The request's choices, or a vLLM-shaped 400."""
    if request.stream or request.echo:
        return error_response("stream and echo are not supported by the simulated engine", 400)
    prompt = request.prompt
    if not prompt or isinstance(prompt, str) or isinstance(prompt[0], str):
        return error_response("the simulated engine takes token-id prompts only", 400, param="prompt")
    # token ids only past the check above (pydantic parsed list[int] or list[list[int]])
    prompts = [cast(list[int], p) for p in prompt] if isinstance(prompt[0], list) else [cast(list[int], prompt)]
    settings, seqs = engine.settings, []
    for ids in prompts:
        max_tokens = request.max_tokens or max(settings.max_model_len - len(ids), 1)
        if not ids:
            return error_response("Prompt cannot be empty", 400, param="prompt")
        bad = next((t for t in ids if not 0 <= t < settings.vocab_size), None)
        if bad is not None:
            return error_response(f"Token id {bad} is out of vocabulary", 400, param="prompt")
        if len(ids) + max_tokens > settings.max_model_len:  # vLLM 0.25.1's wording
            return error_response(
                f"This model's maximum context length is {settings.max_model_len} tokens. However, you requested "
                f"{max_tokens} output tokens and your prompt contains {len(ids)} input tokens, for a total of "
                f"{len(ids) + max_tokens} tokens. Please reduce the length of the input prompt or the number of "
                "requested output tokens.",
                400,
                param="input_tokens",
            )
        for choice in range(request.n):
            seqs.append(
                engine.new_sequence(
                    ids,
                    max_tokens,
                    seed=None if request.seed is None else request.seed + choice,
                    num_logprobs=request.logprobs,
                    stop_token_ids=frozenset(request.stop_token_ids or ()),
                    ignore_eos=request.ignore_eos,
                )
            )
    return seqs


def _add_generation_routes(app: FastAPI, engine: SimEngine, index: int) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created, name = int(time.time()), engine.settings.model_name
        base = {"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": name, "parent": None}
        cards = [{**base, "max_model_len": engine.settings.max_model_len}]
        cards += [
            {**base, "id": lora, "root": path, "parent": name, "max_model_len": None}
            for lora, path in engine.adapters.items()
        ]
        return {"object": "list", "data": cards}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: CompletionRequest, raw: Request) -> dict[str, Any] | JSONResponse:
        name = request.model or engine.settings.model_name
        if name != engine.settings.model_name and name not in engine.adapters:
            return error_response(f"The model `{name}` does not exist.", 404, param="model")
        seqs = _sequences(engine, request)
        if isinstance(seqs, JSONResponse):
            return seqs
        engine.submit(seqs)
        done = asyncio.gather(*(seq.done.wait() for seq in seqs))
        while not done.done():  # a client that gave up frees its slots
            await asyncio.wait({done}, timeout=1.0)
            if not done.done() and await raw.is_disconnected():
                engine.abort(seqs)
                return error_response("client disconnected", 499)
        return completion_response(request, name, seqs, lambda t: f"token_id:{t}", lambda _ids: "")  # type: ignore[arg-type]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(engine, index))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/sim/stats")
    async def sim_stats() -> dict[str, float]:
        return engine.stats()


def _add_control_routes(app: FastAPI, engine: SimEngine) -> None:
    paused_by_update = [False]

    @app.post("/pause", response_model=None)
    async def pause(mode: str = "abort", wait_for_inflight_requests: bool = False) -> dict[str, str] | JSONResponse:
        mode = "wait" if wait_for_inflight_requests else mode
        if mode not in PAUSE_MODES:
            return error_response(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", 400, param="mode")
        await engine.pause(mode)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict[str, str]:
        engine.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": engine.paused}

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/start_weight_update")
    async def start_weight_update() -> dict[str, str]:
        if not engine.paused and engine.pause_mode is None:
            await engine.pause("keep")
            paused_by_update[0] = True
        return {"status": "ok"}

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest) -> dict[str, Any]:  # noqa: ARG001 - any update_info
        return {"status": "ok", "version": await engine.update_weights()}

    @app.post("/finish_weight_update")
    async def finish_weight_update() -> dict[str, str]:
        if paused_by_update[0]:
            paused_by_update[0] = False
            engine.resume()
        return {"status": "ok"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        return Response(status_code=200)

    @app.post(STALE_PATH)
    async def stale(body: dict[str, Any]) -> dict[str, str]:
        if not body.get("stale") and isinstance(body.get("version"), int):
            engine.version = body["version"]
        return {"status": "ok"}

    @app.post("/v1/load_lora_adapter", response_model=None)
    async def load_lora_adapter(body: LoadLoraRequest) -> Response:
        await engine.load_adapter(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", status_code=200)

    @app.post("/v1/unload_lora_adapter", response_model=None)
    async def unload_lora_adapter(body: UnloadLoraRequest) -> Response:
        if engine.adapters.pop(body.lora_name, None) is None:
            return error_response(f"The lora adapter '{body.lora_name}' cannot be found.", 404, param="lora_name")
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", status_code=200)

    @app.get("/get_world_size")
    async def get_world_size() -> dict[str, int]:
        return {"world_size": 1}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        s, c = engine.settings, engine.cost
        return {
            "backend": "simulated",
            "max_model_len": s.max_model_len,
            "max_num_seqs": s.max_num_seqs,
            "kv_cache_size_tokens": s.kv_budget_tokens,
            "cost_model": {"a_s": c.a_s, "b_s": c.b_s, "c_s": c.c_s, "time_scale": c.time_scale},
            "enable_lora": True,
        }


def create_app(engine: SimEngine, index: int = 0) -> FastAPI:
    """The FastAPI app serving ``engine`` (routes in the module docstring); ``index`` labels its metrics."""
    app = FastAPI(title="grpo-flow simulated engine")
    _add_generation_routes(app, engine, index)
    _add_control_routes(app, engine)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:] if isinstance(p, str)) or None
        return error_response(f"{first.get('msg', 'invalid request')} (parameter={param or 'body'})", 400, param=param)

    return app
