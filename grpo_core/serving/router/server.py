"""The replicas as one OpenAI-compatible URL: ``python -m grpo_core.serving.router --url URL --url URL ...``.

The router process (see the package docstring): its command line, checked before anything binds, and
:func:`start_router`, which a run uses to launch it in front of its replicas.
"""

import argparse
import asyncio
import logging
import os
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from grpo_core.config import SERVER_API_KEY_ENV
from grpo_core.run.layout import ROUTER_LOG, ROUTER_PORT
from grpo_core.security.auth import CONTROL_KEY_ENV, NONCE_ENV, ROLE_CONTROL, TOKEN_ENV, role_key
from grpo_core.serving.embedded.server import port_number
from grpo_core.serving.router.app import create_router_app

logger = logging.getLogger(__name__)


def start_router(server: Any, urls: list[str], token: str, tls: Any = None) -> Any:
    """Start the router process in front of ``urls`` on ``server.router_port`` and wait until it answers with its
    launch's nonce (``wait_healthy``: its ``/health`` is the replicas' together).

    The keys reach it through the environment (the control key ``GRPO_CONTROL_KEY`` derived from ``token``,
    ``$GRPO_SERVER_API_KEY``), never its command line; it gets neither the run's token nor the membership key.

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

    from grpo_core.security.auth import check_port_free, derive_key
    from grpo_core.serving.launch import LaunchSpec, launch, wait_healthy

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
    control = derive_key(token, ROLE_CONTROL)
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
        control,
    )
    wait_healthy(handle, server.startup_timeout_s, control)
    logger.info("router over %d replicas at %s (OpenAI-compatible)", len(urls), handle.url)
    return handle


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(prog="python -m grpo_core.serving.router", description=__doc__.splitlines()[0])
    p.add_argument("--url", action="append", required=True, help="replica base URL (repeat per replica)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (loopback by default)")
    p.add_argument("--port", type=port_number, default=8100, help="port; 0 = a free port")
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
    if not role_key(ROLE_CONTROL) and not os.environ.get(SERVER_API_KEY_ENV):
        sys.exit(
            f"neither {TOKEN_ENV} nor {SERVER_API_KEY_ENV} is set (nor {CONTROL_KEY_ENV}): the router answers only "
            "requests carrying a bearer token and sends one to the replicas; set the replicas' key in the "
            f"environment (e.g. {CONTROL_KEY_ENV}=... as the embedded servers were started with, or "
            f"{SERVER_API_KEY_ENV}=... for vLLM "
            "servers started with --api-key)"
        )
    from grpo_core.security.auth import token_problem

    for name in (TOKEN_ENV, CONTROL_KEY_ENV, SERVER_API_KEY_ENV):
        value = os.environ.get(name)
        if value and (problem := token_problem(value)) is not None:
            sys.exit(f"{name}: {problem}")
    import uvicorn

    from grpo_core.security.auth import TLS_CA_ENV
    from grpo_core.serving.embedded.server import listen
    from grpo_core.serving.limits import tls_options, uvicorn_options, warn_if_exposed
    from grpo_core.serving.replicas import ReplicaSet, token_refused

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
        held = CONTROL_KEY_ENV if os.environ.get(CONTROL_KEY_ENV) else TOKEN_ENV
        sock.close()
        sys.exit(
            f"{refused[0]} refuses the bearer token this router sends to the replicas "
            f"({SERVER_API_KEY_ENV if api_key else held} of the router's environment): every request "
            f"would be answered 401 whatever token its client holds; start the router with the replicas' token "
            f"in {SERVER_API_KEY_ENV} (vLLM started with --api-key) or {CONTROL_KEY_ENV} (servers a run started)"
        )
    replicas = ReplicaSet.from_config(server, server.urls)
    scheme = "https" if tls else "http"
    logger.info("router on %s://%s:%d over %s", scheme, args.host, sock.getsockname()[1], ", ".join(server.urls))
    warn_if_exposed(args.host, "the router", tls=bool(tls))
    config = uvicorn.Config(
        create_router_app(replicas, api_key), log_level="warning", timeout_keep_alive=60, **uvicorn_options(), **tls
    )
    uvicorn.Server(config).run(sockets=[sock])
