"""The router's ASGI app over a :class:`~grpo_core.serving.replicas.ReplicaSet` (see the package docstring):
generation routes by prefix affinity, control routes fanned out all or nothing, ``/health`` and ``/metrics``.
"""

import hashlib
import json
import logging
import os
from collections.abc import Hashable
from typing import Any

from grpo_core.security.auth import (
    CONTROL_KEY_ENV,
    INFERENCE_KEY_ENV,
    NONCE_ENV,
    ROLE_INFERENCE,
    bearer_role,
    identity_answer,
    listener_keys,
    run_token,
)
from grpo_core.serving.protocol import (
    AFFINITY_HEADER,
    CONTROL_PATHS,
    GENERATION_PATHS,
    HEALTH_PATH,
    IDENTITY_PATH,
    INFERENCE_PATHS,
    LOAD_LORA_PATH,
    METRICS_PATH,
    MODELS_PATH,
    NONCE_PATH,
    OPEN_PATHS,
    PAUSE_PATH,
    READS_STORAGE_PATHS,
    RESUME_PATH,
    UNLOAD_LORA_PATH,
    role_refusal,
)

logger = logging.getLogger(__name__)

#: Characters of the prompt (or the JSON of the messages) hashed into the affinity key.
PREFIX_CHARS = 1024


def affinity_key(body: dict[str, Any], header: str | None) -> Hashable:
    """The routing key of a generation request: ``(kind, digest, model)``.

    Args:
        body: the request's JSON body (``prompt`` text or token ids, or chat ``messages``; ``model``).
        header: the ``X-Affinity-Key`` header (e.g. a group id), or None.
    """
    model = body.get("model")
    if header:
        return ("key", header, model)
    prompt = body.get("prompt", body.get("messages"))
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, separators=(",", ":"))
    return ("prefix", hashlib.sha256(text[:PREFIX_CHARS].encode()).hexdigest(), model)


def _undo(path: str, body: dict[str, Any] | None):  # noqa: ANN202 - a client -> awaitable callable or None
    """The call that undoes control route ``path`` on the replicas that took it (None: nothing to undo)."""
    if path == LOAD_LORA_PATH and body and body.get("lora_name"):
        return lambda c: c.call("POST", UNLOAD_LORA_PATH, {"lora_name": body["lora_name"]})
    if path == PAUSE_PATH:
        return lambda c: c.call("POST", RESUME_PATH)
    if path == RESUME_PATH:
        return lambda c: c.call("POST", PAUSE_PATH, params={"mode": "keep"})
    return None


#: Fields a control route's JSON body must hold (strings), as vLLM's own request models require them.
CONTROL_FIELDS = {LOAD_LORA_PATH: ("lora_name", "lora_path"), UNLOAD_LORA_PATH: ("lora_name",)}


def control_body_problem(path: str, body: Any) -> str | None:
    """Why a control call's body is refused before it is fanned out (None when it is not): a body that is not a
    JSON object, or a LoRA load/unload without its string fields. The replicas would refuse it alike, but only
    after ``server.control_timeout_s`` of retries (kept for a store whose adapter files are not visible yet)."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        return f"the request body of {path} must be a JSON object, got {type(body).__name__}"
    missing = [f for f in CONTROL_FIELDS.get(path, ()) if not isinstance(body.get(f), str) or not body[f]]
    if missing:
        return f"{path} needs {' and '.join(repr(f) for f in missing)} (a non-empty string) in its JSON body"
    return None


def metrics_text(replicas: Any) -> str:
    """Prometheus text of the routing counts, in-flight requests and health per replica."""
    counts, policy = replicas.policy.counts, replicas.policy
    lines = ["# TYPE grpo_router_requests_total counter"]
    lines += [
        f'grpo_router_requests_total{{outcome="{k}"}} {v}'
        for k, v in (("hit", counts.hits), ("unmatched", counts.unmatched), ("spill", counts.spills))
    ]
    lines += [
        "# TYPE grpo_router_replica_down_total counter",
        f"grpo_router_replica_down_total {counts.replica_down}",
        "# TYPE grpo_router_inflight gauge",
    ]
    lines += [f'grpo_router_inflight{{replica="{i}"}} {n}' for i, n in enumerate(policy.inflight)]
    lines += ["# TYPE grpo_router_replica_healthy gauge"]
    lines += [f'grpo_router_replica_healthy{{replica="{i}"}} {int(ok)}' for i, ok in enumerate(policy.healthy)]
    return "\n".join(lines) + "\n"


def create_router_app(replicas: Any, api_key: str | None = None) -> Any:
    """The FastAPI app of the router over ``replicas`` (a ``ReplicaSet``).

    Every route but ``/health`` wants ``Authorization: Bearer`` with a control key — ``api_key`` (the servers' key,
    what the run's clients send to external servers), the run's control key (``GRPO_CONTROL_KEY``, or derived from
    ``GRPO_RUN_TOKEN``, which passes too) — or, on the generation routes only
    (``grpo_core.serving.protocol.INFERENCE_PATHS``), the inference key derived from one of them
    (``GRPO_INFERENCE_KEY``): 401 without one, 403 for the inference key elsewhere, naming the control key.
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask

    from grpo_core.errors import ServerRequestError, ServingError
    from grpo_core.serving.limits import BodyLimit
    from grpo_core.serving.replicas import ControlFanOutError

    app = FastAPI(title="grpo-flow router")

    def error(status: int, message: str, kind: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    # control: the servers' key and the router's own control key (or the run's token), each with the control key
    # derived from it; inference: the keys derived from those (generation routes only; 403 elsewhere)
    identity_key = os.environ.get(CONTROL_KEY_ENV) or run_token()
    control_keys, inference_keys = [], [t for t in (os.environ.get(INFERENCE_KEY_ENV),) if t]
    for secret in (t for t in (api_key, identity_key) if t):
        more_control, more_inference = listener_keys(secret)
        control_keys, inference_keys = control_keys + more_control, inference_keys + more_inference
    app.add_middleware(BodyLimit)  # inside the token check added next (the later middleware runs first)

    @app.middleware("http")
    async def check_token(request: Request, call_next: Any) -> Any:
        if request.url.path == IDENTITY_PATH and request.method == "GET" and identity_key:
            # the launcher's check that it reached the process it started, before it sends a token
            # (grpo_core.security.auth)
            status, body = identity_answer(request.url.query, identity_key, os.environ.get(NONCE_ENV, ""))
            return JSONResponse(body, status_code=status)
        if control_keys and request.url.path not in OPEN_PATHS:  # /health: probes need no token (as vLLM's --api-key)
            role = bearer_role(request.headers.get("authorization"), control_keys, inference_keys)
            if role is None:
                return error(401, "missing or wrong bearer token (Authorization: Bearer ...)", "AuthenticationError")
            if role == ROLE_INFERENCE and request.url.path not in INFERENCE_PATHS:
                return error(403, role_refusal(request.url.path), "Forbidden")
        return await call_next(request)

    @app.get(NONCE_PATH)
    async def nonce() -> dict[str, str]:  # the launcher's proof that it reached the process it started
        return {"nonce": os.environ.get(NONCE_ENV, "")}

    @app.get(HEALTH_PATH)
    async def health() -> Response:
        return Response(status_code=200 if await replicas.health() else 503)

    def failed(exc: ServingError) -> JSONResponse:
        """A replica's refusal (4xx) passed on as it is; no replica answering is 503 naming what was tried."""
        if isinstance(exc, ServerRequestError) and 400 <= exc.status < 500:
            return error(exc.status, str(exc), exc.error_type or "BadRequestError")
        return error(
            503,
            f"no generation replica answered ({len(replicas.urls)} behind this router; "
            f"{sum(replicas.policy.healthy)} healthy): {exc}",
            "ServiceUnavailableError",
        )

    async def json_body(request: Request) -> Any:
        """The request's JSON body (None when empty); raises ValueError on a body that is not JSON."""
        raw = await request.body()
        return json.loads(raw) if raw else None

    @app.get(MODELS_PATH)
    async def models() -> Response:
        try:
            return JSONResponse({"object": "list", "data": await replicas.models()})
        except ServingError as exc:
            return failed(exc)

    @app.get(METRICS_PATH)
    async def metrics() -> Response:
        return Response(metrics_text(replicas), media_type="text/plain; version=0.0.4")

    async def generate(request: Request) -> Response:
        try:
            body = await json_body(request)
        except ValueError as exc:
            return error(400, f"the request body is not JSON: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            return error(
                400, "the request body must be a JSON object (an OpenAI completion request)", "BadRequestError"
            )
        key = affinity_key(body, request.headers.get(AFFINITY_HEADER))

        async def send(client: Any) -> tuple[int, Any]:
            return replicas.clients.index(client), await client.open_stream("POST", request.url.path, body)

        try:
            replica, answer = await replicas.routed(key, send)
        except ServingError as exc:
            return failed(exc)
        media = answer.headers.get("content-type", "application/json")
        if body.get("stream"):
            replicas.policy.inflight[replica] += 1  # in flight until the last chunk is passed on

            async def done() -> None:
                replicas.policy.inflight[replica] -= 1
                await answer.aclose()

            return StreamingResponse(
                answer.aiter_raw(), status_code=answer.status_code, media_type=media, background=BackgroundTask(done)
            )
        content = await answer.aread()
        await answer.aclose()
        return Response(content, status_code=answer.status_code, media_type=media)

    async def control(request: Request) -> Response:
        try:
            body = await json_body(request)
        except ValueError as exc:
            return error(400, f"the request body is not JSON: {exc}", "BadRequestError")
        path, params = request.url.path, dict(request.query_params)
        problem = control_body_problem(path, body)
        if problem is not None:  # refused here at once: the replicas would refuse it alike after every retry
            return error(400, problem, "BadRequestError")
        absent: list[str] = []

        async def call(c: Any) -> None:
            try:
                await c.call("POST", path, body, params)
            except ServerRequestError as exc:  # an adapter a replica does not hold is as good as unloaded there
                if not (path == UNLOAD_LORA_PATH and exc.status == 404):
                    raise
                absent.append(c.base_url)

        try:
            await replicas.fan_out(path, call, _undo(path, body), reads_storage=path in READS_STORAGE_PATHS)
        except ControlFanOutError as exc:  # every replica refused alike: the request's fault, said as one server would
            return error(exc.common_refusal or 502, str(exc), "ControlFanOutError")
        if path == UNLOAD_LORA_PATH and len(set(absent)) == len(replicas.urls):
            return error(
                404, f"no replica holds the LoRA adapter {body['lora_name']!r} (each answered 404)", "NotFoundError"
            )
        return JSONResponse({"status": "ok", "replicas": len(replicas.urls)})

    for path in GENERATION_PATHS:
        app.add_api_route(path, generate, methods=["POST"])
    for path in CONTROL_PATHS:
        app.add_api_route(path, control, methods=["POST"])
    return app
