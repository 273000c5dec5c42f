"""The replicas as one OpenAI-compatible URL: ``python -m grpo_core.serving.router --url URL --url URL ...``.

For clients outside the rollout process (evaluation, a TRL-style single-endpoint trainer). It runs the
same :class:`~grpo_core.serving.routing.ReplicaSet` as the rollout: completions and chat completions are
routed by prefix affinity (the ``X-Affinity-Key`` header when given, else a hash of the model name and
the first :data:`PREFIX_CHARS` characters of the prompt or messages), streamed answers included; control
calls (``/pause``, ``/resume``, LoRA load/unload, weight updates, ``/reset_prefix_cache``) fan out to
every replica all or nothing (a LoRA load that fails somewhere is unloaded where it succeeded; a pause is
resumed); ``/health`` is 200 only when every replica is healthy; ``/metrics`` has the routing counts.

Why not ``vllm-router`` (PyPI): it is a separate Rust binary whose ``cache_aware`` policy matches text
prefixes, with no notion of a policy version in the key (every adapter version of one prompt would share
a home), and it forwards a LoRA load to workers without an all-or-nothing rollback; the rollout also
needs the routing counts in its own metric window. This proxy is a thin face over the routing the
rollout already uses, so both follow one policy.

Every request to the router but ``/health`` must carry ``Authorization: Bearer`` with the run's token
(``$GRPO_RUN_TOKEN``) or the servers' key (``$GRPO_SERVER_API_KEY``, ``server.api_key``); neither is ever a
command-line argument that ``ps`` would show. Requests go on to the replicas with ``server.api_key``, else the
run's token.
"""

import argparse
import asyncio
import hashlib
import json
import logging
import os
import sys
import urllib.parse
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from grpo_core.config import SERVER_API_KEY_ENV
from grpo_core.run.layout import ROUTER_LOG, ROUTER_PORT
from grpo_core.security.auth import (
    IDENTITY_PATH,
    NONCE_ENV,
    NONCE_PATH,
    OPEN_PATHS,
    TOKEN_ENV,
    authorized,
    identity_answer,
    run_token,
)

logger = logging.getLogger(__name__)

#: Characters of the prompt (or the JSON of the messages) hashed into the affinity key.
PREFIX_CHARS = 1024
#: Generation routes, routed by affinity.
ROUTED = ("/v1/completions", "/v1/chat/completions")
#: Control routes fanned out to every replica, with the call that undoes each on the replicas that took it.
CONTROL = (
    "/pause",
    "/resume",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/reset_prefix_cache",
)


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
    if path == "/v1/load_lora_adapter" and body and body.get("lora_name"):
        return lambda c: c.call("POST", "/v1/unload_lora_adapter", {"lora_name": body["lora_name"]})
    if path == "/pause":
        return lambda c: c.call("POST", "/resume")
    if path == "/resume":
        return lambda c: c.call("POST", "/pause", params={"mode": "keep"})
    return None


#: Control routes that load files a replica may not see yet on shared storage: their 400s are retried.
READS_STORAGE = ("/v1/load_lora_adapter", "/update_weights")

#: Fields a control route's JSON body must hold (strings), as vLLM's own request models require them.
CONTROL_FIELDS = {"/v1/load_lora_adapter": ("lora_name", "lora_path"), "/v1/unload_lora_adapter": ("lora_name",)}


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

    Every route but ``/health`` wants ``Authorization: Bearer`` with ``api_key`` (the servers' key, what the run's
    clients send to external servers) or the run's own token (``GRPO_RUN_TOKEN``), when either is set.
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask

    from grpo_core.errors import ServerRequestError, ServingError
    from grpo_core.serving.limits import BodyLimit
    from grpo_core.serving.routing import ControlFanOutError

    app = FastAPI(title="grpo-flow router")

    def error(status: int, message: str, kind: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    tokens = [t for t in (api_key, run_token()) if t]
    app.add_middleware(BodyLimit)  # inside the token check added next (the later middleware runs first)

    @app.middleware("http")
    async def check_token(request: Request, call_next: Any) -> Any:
        if request.url.path == IDENTITY_PATH and request.method == "GET" and run_token():
            # the launcher's check that it reached the process it started, before it sends a token
            # (grpo_core.security.auth)
            status, body = identity_answer(request.url.query, run_token() or "", os.environ.get(NONCE_ENV, ""))
            return JSONResponse(body, status_code=status)
        if tokens and request.url.path not in OPEN_PATHS:  # /health: probes need no token (as vLLM's --api-key)
            given = request.headers.get("authorization")
            if not any(authorized(given, t) for t in tokens):
                return error(401, "missing or wrong bearer token (Authorization: Bearer ...)", "AuthenticationError")
        return await call_next(request)

    @app.get(NONCE_PATH)
    async def nonce() -> dict[str, str]:  # the launcher's proof that it reached the process it started
        return {"nonce": os.environ.get(NONCE_ENV, "")}

    @app.get("/health")
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

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            return JSONResponse({"object": "list", "data": await replicas.models()})
        except ServingError as exc:
            return failed(exc)

    @app.get("/metrics")
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
        key = affinity_key(body, request.headers.get("x-affinity-key"))

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
                if not (path == "/v1/unload_lora_adapter" and exc.status == 404):
                    raise
                absent.append(c.base_url)

        try:
            await replicas.fan_out(path, call, _undo(path, body), reads_storage=path in READS_STORAGE)
        except ControlFanOutError as exc:  # every replica refused alike: the request's fault, said as one server would
            return error(exc.common_refusal or 502, str(exc), "ControlFanOutError")
        if path == "/v1/unload_lora_adapter" and len(set(absent)) == len(replicas.urls):
            return error(
                404, f"no replica holds the LoRA adapter {body['lora_name']!r} (each answered 404)", "NotFoundError"
            )
        return JSONResponse({"status": "ok", "replicas": len(replicas.urls)})

    for path in ROUTED:
        app.add_api_route(path, generate, methods=["POST"])
    for path in CONTROL:
        app.add_api_route(path, control, methods=["POST"])
    return app


def start_router(server: Any, urls: list[str], token: str, tls: Any = None) -> Any:
    """Start the router process in front of ``urls`` on ``server.router_port`` and wait until it answers with its
    launch's nonce (``wait_healthy``: its ``/health`` is the replicas' together).

    The tokens reach it through the environment (``GRPO_RUN_TOKEN``, ``$GRPO_SERVER_API_KEY``), never its command
    line.

    Args:
        server: the ``ServerConfig`` (``router_port``, ``host``, routing settings, ``log_dir``).
        urls: the replicas' base URLs.
        token: the run's bearer token.
        tls: the run's ``TLSConfig``: the router serves HTTPS with its certificate and verifies the replicas against
            its CA; None = plain HTTP.

    Returns:
        A ``ServerHandle`` (``url``, ``stop()``) the flow tears down with the replicas.

    Raises:
        PortInUseError: ``server.router_port`` is taken (nothing is started).
        ServerStartError: the router exited or was not healthy within ``server.startup_timeout_s``.
    """
    import secrets

    from grpo_core.security.auth import check_port_free
    from grpo_core.serving.vllm import LaunchSpec, launch, wait_healthy

    check_port_free(server.host, server.router_port, "server.router_port")  # taken: no launch, the setting named
    port_file = server.log_dir / ROUTER_PORT
    argv = [
        sys.executable,
        "-m",
        "grpo_core.serving.router",
        "--host",
        server.host,
        "--port",
        str(server.router_port),
        "--port-file",
        str(port_file),
        "--route-imbalance",
        str(server.route_imbalance),
        "--control-retry-s",
        str(server.control_retry_s),
        "--control-timeout-s",
        str(server.control_timeout_s),
    ]
    argv += [arg for url in urls for arg in ("--url", url)]
    enabled = tls is not None and tls.enabled
    if enabled:
        argv += ["--ssl-certfile", str(tls.cert_file), "--ssl-keyfile", str(tls.key_file)]
        if tls.ca_file is not None:
            argv += ["--ssl-ca-file", str(tls.ca_file)]
    env = {NONCE_ENV: secrets.token_hex(16)}
    if key := server.resolved_api_key():
        env[SERVER_API_KEY_ENV] = key
    handle = launch(
        LaunchSpec(
            argv,
            env,
            "router",
            len(urls),
            server.host,
            server.router_port,
            server.log_dir / ROUTER_LOG,
            port_file,
            nonce=env[NONCE_ENV],
            tls=enabled,
            ca_file=tls.client_ca() if enabled else None,
        ),
        token,
    )
    wait_healthy(handle, server.startup_timeout_s, token)
    logger.info("router over %d replicas at %s (OpenAI-compatible)", len(urls), handle.url)
    return handle


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(prog="python -m grpo_core.serving.router", description=__doc__.splitlines()[0])
    p.add_argument("--url", action="append", required=True, help="replica base URL (repeat per replica)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (loopback by default)")
    p.add_argument("--port", type=int, default=8100, help="port; 0 = a free port")
    p.add_argument("--port-file", type=Path, default=None, help="write the bound port here")
    p.add_argument("--route-imbalance", type=int, default=8, help="server.route_imbalance")
    p.add_argument("--control-retry-s", type=float, default=0.5, help="server.control_retry_s")
    p.add_argument("--control-timeout-s", type=float, default=60.0, help="server.control_timeout_s")
    p.add_argument("--ssl-certfile", default=None, help="PEM certificate: serve HTTPS (tls.cert_file)")
    p.add_argument("--ssl-keyfile", default=None, help="PEM key of --ssl-certfile (tls.key_file)")
    p.add_argument(
        "--ssl-ca-file",
        default=None,
        help="PEM CA the replicas' https:// certificates are verified against (tls.ca_file; default "
        "GRPO_TLS_CA_FILE, else the system's CAs)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> None:
    """Bind, then serve the router until stopped (tokens from ``$GRPO_SERVER_API_KEY`` and ``$GRPO_RUN_TOKEN``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pydantic import ValidationError

    from grpo_core.config import LOOPBACK_HOSTS, ServerConfig, _error_lines, check_server_urls

    try:
        urls = check_server_urls(args.url, "--url")
        server = ServerConfig(
            urls=urls,
            route_imbalance=args.route_imbalance,
            control_retry_s=args.control_retry_s,
            control_timeout_s=args.control_timeout_s,
        )
    except ValidationError as exc:  # one line per flag, named as on the command line
        lines = [line.split(": ", 1) for line in _error_lines(ServerConfig, exc.errors())]
        parser.error("; ".join(f"--{field.replace('_', '-')}: {why}" for field, why in lines))
    except ValueError as exc:
        parser.error(str(exc))
    if not run_token() and not os.environ.get(SERVER_API_KEY_ENV):
        sys.exit(
            f"neither {TOKEN_ENV} nor {SERVER_API_KEY_ENV} is set: the router answers only requests carrying a "
            "bearer token and sends one to the replicas; set the replicas' token in the environment (e.g. "
            f"{TOKEN_ENV}=... as the embedded servers were started with, or {SERVER_API_KEY_ENV}=... for vLLM "
            "servers started with --api-key)"
        )
    from grpo_core.security.auth import token_problem

    for name in (TOKEN_ENV, SERVER_API_KEY_ENV):
        value = os.environ.get(name)
        if value and (problem := token_problem(value)) is not None:
            sys.exit(f"{name}: {problem}")
    import uvicorn

    from grpo_core.security.auth import TLS_CA_ENV
    from grpo_core.serving.embedded.server import listen
    from grpo_core.serving.limits import tls_options, uvicorn_options, warn_if_exposed
    from grpo_core.serving.routing import ReplicaSet, token_refused

    try:
        tls = tls_options(args.ssl_certfile, args.ssl_keyfile)
    except ValueError as exc:
        parser.error(str(exc))
    if args.ssl_ca_file:  # the replicas' clients (GenerationClient) read it from there
        os.environ[TLS_CA_ENV] = args.ssl_ca_file
    sock = listen(args.host, args.port)
    port = sock.getsockname()[1]
    for url in server.urls:  # a request would come back to this router, again and again
        parts = urllib.parse.urlsplit(url)
        if parts.port == port and parts.hostname in LOOPBACK_HOSTS | {"0.0.0.0", args.host}:
            sock.close()
            parser.error(f"--url: {url!r} is this router ({args.host}:{port}); give the replicas' URLs")
    if args.port_file:
        args.port_file.write_text(str(sock.getsockname()[1]))
    api_key = os.environ.get(SERVER_API_KEY_ENV) or None

    async def probe() -> tuple[str, int] | None:  # a set of its own: its clients belong to this event loop only
        async with ReplicaSet.from_config(server, server.urls, timeout_s=10.0) as rs:
            return await token_refused(rs)

    refused = asyncio.run(probe())
    if refused is not None:
        sock.close()
        sys.exit(
            f"{refused[0]} refuses the bearer token this router sends to the replicas "
            f"({SERVER_API_KEY_ENV if api_key else TOKEN_ENV} of the router's environment): every request "
            f"would be answered 401 whatever token its client holds; start the router with the replicas' token "
            f"in {SERVER_API_KEY_ENV} (vLLM started with --api-key) or {TOKEN_ENV} (servers a run started)"
        )
    replicas = ReplicaSet.from_config(server, server.urls)
    scheme = "https" if tls else "http"
    logger.info("router on %s://%s:%d over %s", scheme, args.host, sock.getsockname()[1], ", ".join(server.urls))
    warn_if_exposed(args.host, "the router", tls=bool(tls))
    config = uvicorn.Config(
        create_router_app(replicas, api_key), log_level="warning", timeout_keep_alive=60, **uvicorn_options(), **tls
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
