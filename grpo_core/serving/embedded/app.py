"""FastAPI app of the embedded server: vLLM's HTTP API on the batched transformers engine.

Routes (same paths and JSON shapes as vLLM 0.25.1, see ``shared/vllm-h200/README.md``):
``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``GET /metrics``,
``POST /pause``, ``POST /resume``, ``GET /is_paused``, ``POST /v1/load_lora_adapter``,
``POST /v1/unload_lora_adapter``, ``GET /server_info``, ``GET /get_world_size``,
``POST /reset_prefix_cache`` and the weight-update sequence ``POST /init_weight_transfer_engine``
→ ``/start_weight_update`` → ``/update_weights {"update_info": {"path": DIR}}`` →
``/finish_weight_update``. Every route but ``/health`` needs the run's bearer token
(``grpo_core.serving.guard``). The embedded server reads full weights from a checkpoint-format
folder on disk instead of vLLM's NCCL/IPC tensors; ``start`` pauses decoding and
``finish`` resumes it, so in-flight sequences continue on the new weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from grpo_core.errors import ServingError
from grpo_core.serving.embedded.engine import Engine, PauseMode, Sequence
from grpo_core.serving.embedded.weights import AdapterError, WeightManager
from grpo_core.serving.guard import RunGuardMiddleware
from grpo_core.serving.protocol import (
    COMPLETIONS_PATH,
    FINISH_WEIGHT_UPDATE_PATH,
    HEALTH_PATH,
    INIT_WEIGHT_TRANSFER_PATH,
    IS_PAUSED_PATH,
    LOAD_LORA_PATH,
    METRICS_PATH,
    MODELS_PATH,
    PAUSE_PATH,
    RESET_PREFIX_CACHE_PATH,
    RESUME_PATH,
    SERVER_INFO_PATH,
    START_WEIGHT_UPDATE_PATH,
    UNLOAD_LORA_PATH,
    UPDATE_WEIGHTS_PATH,
    WORLD_SIZE_PATH,
    CompletionRequest,
    LoadLoraRequest,
    StartWeightUpdateRequest,
    UnloadLoraRequest,
    UpdateWeightsRequest,
    completion_response,
    error_response,
)
from grpo_core.serving.sampling_defaults import NEUTRAL

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """Everything the routes need: engine, tokenizer, weight manager and static facts.

    ``default_sampling`` holds the values used for sampling fields a request leaves out (vLLM's
    default sampling parameters: ``{}`` with ``--generation-config vllm``, the model's
    ``generation_config.json`` with ``auto``).
    """

    engine: Engine
    tokenizer: Any
    weights: WeightManager
    model_name: str
    model_path: str
    max_logprobs: int
    max_loras: int
    generation_config: str = "vllm"
    default_sampling: dict[str, Any] = field(default_factory=dict)
    paused_by_weight_update: bool = False
    guard: dict[str, Any] = field(default_factory=dict, repr=False)
    """Keyword arguments of ``RunGuardMiddleware`` (token, nonce, max_pause_s, adapter_dir, weights_dir);
    a missing one comes from the environment (``grpo_core.serving.guard``)."""
    text_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize"), repr=False
    )
    """The one thread that tokenizes prompts and detokenizes completions, off the event loop (a long prompt
    would stall every request, ``/health`` included); one, so the tokenizer is never used by two threads."""


class _EngineCollector:
    """Prometheus collector reading the engine's gauges and counters at scrape time, with vLLM's names."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Any:
        engine, labels = self.state.engine, ["engine", "model_name"]
        values = ["0", self.state.model_name]
        stats = engine.stats()
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", stats["running"]),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats["waiting"]),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats["kv_usage"]),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, value)
            yield gauge
        for name, doc, value in (
            ("vllm:num_preemptions", "Cumulative number of preemptions.", engine.num_preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", engine.num_prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", engine.num_generation_tokens),
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(values, value)
            yield counter
        info_labels = ["engine", "block_size", "num_gpu_blocks", "kv_cache_size_tokens"]
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache.", labels=info_labels)
        size = engine.kv_cache_size_tokens
        info.add_metric(["0", "1", str(size), str(size)], 1.0)
        yield info


def _model_cards(state: ServerState) -> dict[str, Any]:
    created = int(time.time())
    base = {
        "id": state.model_name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": state.model_path,
        "parent": None,
        "max_model_len": state.engine.max_model_len,
    }
    loras = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": path,
            "parent": state.model_name,
            "max_model_len": None,
        }
        for name, path in state.weights.adapters.items()
    ]
    return {"object": "list", "data": [base, *loras]}


def _prompts(request: CompletionRequest, tokenizer: Any) -> list[list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if prompt and isinstance(prompt[0], str):
        return [tokenizer.encode(p) for p in prompt]
    if prompt and isinstance(prompt[0], list):
        return [list(p) for p in prompt]
    return [list(prompt)]


def _check_prompt(state: ServerState, ids: list[int], max_tokens: int) -> str | None:
    max_len, vocab = state.engine.max_model_len, len(state.tokenizer)
    if not ids:
        return "Prompt cannot be empty"
    if any(t < 0 or t >= vocab for t in ids):
        return f"Token id {next(t for t in ids if t < 0 or t >= vocab)} is out of vocabulary"
    if len(ids) + max_tokens > max_len:  # vLLM 0.25.1's wording
        return (
            f"This model's maximum context length is {max_len} tokens. However, you requested {max_tokens} "
            f"output tokens and your prompt contains {len(ids)} input tokens, for a total of "
            f"{len(ids) + max_tokens} tokens. Please reduce the length of the input prompt or the number of "
            "requested output tokens."
        )
    return None


def _sampling(state: ServerState, request: CompletionRequest) -> dict[str, Any] | JSONResponse:
    """The request's sampling fields, each from the request or else the server's defaults (as vLLM fills them)."""
    values = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        given = getattr(request, name)
        values[name] = given if given is not None else state.default_sampling.get(name, NEUTRAL[name])
    values["presence_penalty"], values["frequency_penalty"] = request.presence_penalty, request.frequency_penalty
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        if values[name] != NEUTRAL[name]:
            return error_response(
                f"{name}={values[name]} is not supported by the embedded server (only "
                f"{NEUTRAL[name]}); the trainer's log-probs assume no penalty",
                400,
                param=name,
            )
    return values


def _sequences(state: ServerState, request: CompletionRequest, adapter: str | None) -> list[Sequence] | JSONResponse:
    if request.stream or request.echo:
        return error_response("stream and echo are not supported by the embedded server", 400)
    if request.logprobs is not None and request.logprobs > state.max_logprobs:
        return error_response(
            f"Requested sample logprobs of {request.logprobs}, which is greater than max allowed: {state.max_logprobs}",
            400,
            param="logprobs",
        )
    sampling = _sampling(state, request)
    if isinstance(sampling, JSONResponse):
        return sampling
    seqs = []
    for ids in _prompts(request, state.tokenizer):
        max_tokens = (
            request.max_tokens
            or state.default_sampling.get("max_tokens")
            or max(state.engine.max_model_len - len(ids), 1)
        )
        problem = _check_prompt(state, ids, max_tokens)
        if problem:
            return error_response(problem, 400, param="input_tokens" if "context length" in problem else "prompt")
        for choice in range(request.n):
            seqs.append(
                Sequence(
                    prompt_ids=ids,
                    max_tokens=max_tokens,
                    temperature=sampling["temperature"],
                    top_k=max(sampling["top_k"], 0),
                    top_p=sampling["top_p"],
                    min_p=sampling["min_p"],
                    seed=None if request.seed is None else request.seed + choice,
                    stop_token_ids=frozenset(request.stop_token_ids or ()),
                    ignore_eos=request.ignore_eos,
                    num_logprobs=request.logprobs,
                    adapter=adapter,
                )
            )
    return seqs


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.get(HEALTH_PATH)
    async def health() -> Response:
        return Response(status_code=200)

    @app.get(MODELS_PATH)
    async def models() -> dict[str, Any]:
        return _model_cards(state)

    @app.post(COMPLETIONS_PATH, response_model=None)
    async def completions(request: CompletionRequest, raw: Request) -> dict[str, Any] | JSONResponse:
        name = request.model or state.model_name
        if name != state.model_name and name not in state.weights.adapters:
            return error_response(f"The model `{name}` does not exist.", 404, param="model")
        adapter = None if name == state.model_name else name
        loop = asyncio.get_running_loop()  # tokenizing (and the prompt checks) off the event loop
        seqs = await loop.run_in_executor(state.text_pool, _sequences, state, request, adapter)
        if isinstance(seqs, JSONResponse):
            return seqs
        if not state.weights.submit(adapter, seqs):  # unloaded since the check above
            return error_response(f"The model `{name}` does not exist.", 404, param="model")
        done = asyncio.gather(*(asyncio.wrap_future(seq.future) for seq in seqs))
        while not done.done():  # a client that gave up (timeout, retry) frees its slots
            await asyncio.wait({done}, timeout=1.0)
            if not done.done() and await raw.is_disconnected():
                state.engine.abort(seqs)
                return error_response("client disconnected", 499)
        await done
        tok = state.tokenizer
        return await loop.run_in_executor(
            state.text_pool,
            completion_response,
            request,
            name,
            seqs,
            tok.convert_ids_to_tokens,
            # vLLM's detokenizer never runs WordPiece space clean-up; neither do we.
            lambda ids: tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False),
        )

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(state))

    @app.get(METRICS_PATH)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _add_control_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.post(PAUSE_PATH)
    async def pause(
        mode: PauseMode = "abort",
        wait_for_inflight_requests: bool = False,
        clear_cache: bool = True,  # noqa: ARG001 - vLLM's query parameter, accepted and ignored
    ) -> dict[str, str]:
        # vLLM 0.25.1's query parameters: no mode aborts every in-flight request (finish_reason "abort");
        # the deprecated wait_for_inflight_requests means mode=wait; clear_cache has no cache to clear here.
        await asyncio.to_thread(engine.pause, "wait" if wait_for_inflight_requests else mode)
        return {"status": "paused"}

    @app.post(RESUME_PATH)
    async def resume() -> dict[str, str]:
        engine.resume()
        return {"status": "resumed"}

    @app.get(IS_PAUSED_PATH)
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": engine.paused}


def _add_weight_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.post(INIT_WEIGHT_TRANSFER_PATH)
    async def init_weight_transfer_engine() -> dict[str, str]:
        return {"status": "ok"}

    @app.post(START_WEIGHT_UPDATE_PATH)
    async def start_weight_update(body: StartWeightUpdateRequest | None = None) -> dict[str, str]:
        if body is not None and not body.is_checkpoint_format:
            raise ServingError("the embedded server only takes checkpoint-format weights")
        if not engine.paused:
            await asyncio.to_thread(engine.pause, "keep")
            state.paused_by_weight_update = True
        return {"status": "ok"}

    @app.post(UPDATE_WEIGHTS_PATH)
    async def update_weights(body: UpdateWeightsRequest) -> dict[str, Any]:
        path = body.update_info.get("path")
        if not isinstance(path, str):
            return error_response('update_info must be {"path": "<checkpoint folder>"}', 400, param="update_info")
        count = await asyncio.to_thread(state.weights.load_full_weights, path)
        return {"status": "ok", "num_tensors": count}

    @app.post(FINISH_WEIGHT_UPDATE_PATH)
    async def finish_weight_update() -> dict[str, str]:
        if state.paused_by_weight_update:
            state.paused_by_weight_update = False
            engine.resume()
        return {"status": "ok"}


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.post(RESET_PREFIX_CACHE_PATH)
    async def reset_prefix_cache(reset_running_requests: bool = False) -> Response:  # noqa: ARG001 - vLLM's
        # No prefix cache is shared between sequences here; each keeps its own KV (computed by the weights
        # that were current when its tokens were decoded, as vLLM's kept requests without a reset).
        return Response(status_code=200)

    @app.get(WORLD_SIZE_PATH)
    async def get_world_size() -> dict[str, int]:
        return {"world_size": 1}

    @app.get(SERVER_INFO_PATH)
    async def server_info() -> dict[str, Any]:
        return {
            "backend": "embedded",
            "max_model_len": engine.max_model_len,
            "max_num_seqs": engine.max_num_seqs,
            "generation_config": state.generation_config,
            "default_sampling_params": state.default_sampling,
            "kv_cache_size_tokens": engine.kv_cache_size_tokens,
            "enable_lora": True,
            "max_loras": state.max_loras,
            "max_lora_rank": state.weights.max_lora_rank,
        }


def _add_lora_routes(app: FastAPI, state: ServerState) -> None:
    @app.post(LOAD_LORA_PATH, response_model=None)
    async def load_lora_adapter(body: LoadLoraRequest) -> Response:
        await asyncio.to_thread(state.weights.load_adapter, body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", status_code=200)

    @app.post(UNLOAD_LORA_PATH, response_model=None)
    async def unload_lora_adapter(body: UnloadLoraRequest) -> Response:
        await asyncio.to_thread(state.weights.unload_adapter, body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", status_code=200)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:] if isinstance(p, str)) or None
        message = f"{first.get('msg', 'invalid request')} (parameter={param or 'body'}, value={first.get('input')!r})"
        if param == "max_tokens" and isinstance(first.get("input"), int):  # vLLM 0.25.1's wording
            message = (
                f"max_tokens must be at least 1, got {first['input']}. (parameter=max_tokens, value={first['input']})"
            )
        return error_response(message, 400, param=param)

    @app.exception_handler(AdapterError)
    async def adapter_error(_request: Request, exc: AdapterError) -> JSONResponse:
        return error_response(str(exc), exc.status, param="lora_name")

    @app.exception_handler(ServingError)
    async def serving_error(_request: Request, exc: ServingError) -> JSONResponse:
        return error_response(str(exc), 400)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request %s failed", request.url.path)
        return error_response(f"{type(exc).__name__}: {exc}", 500)


def create_app(state: ServerState) -> FastAPI:
    """Build the FastAPI app for a started engine (see module docstring for the routes).

    Every route but ``/health`` needs the run's bearer token, adapters and full weights load only from
    the run's folders, and a pause ends after ``max_pause_s`` (``grpo_core.serving.guard``).

    Raises:
        RuntimeError: no run token (``GRPO_RUN_TOKEN``) is given or set.
    """
    app = FastAPI(title="grpo-flow embedded generation server")
    app.add_middleware(RunGuardMiddleware, **state.guard)
    _add_generation_routes(app, state)
    _add_control_routes(app, state)
    _add_weight_routes(app, state)
    _add_info_routes(app, state)
    _add_lora_routes(app, state)
    _add_error_handlers(app)
    return app
