"""The per-run bearer token and per-launch nonce that every listener of a run checks.

One run (one flow run, one ``grpo train``) generates one random token; it reaches the processes the
run starts through their environment (``GRPO_RUN_TOKEN``), never through a command line, a config
file or a log line. Every listener the run starts answers only requests carrying
``Authorization: Bearer <token>`` (HTTP) or the same ``authorization`` call header (Arrow Flight);
anything else gets 401 (Flight: ``FlightUnauthenticatedError``) and changes nothing.

Each server launch also gets a random nonce (``GRPO_RUN_NONCE``, not secret) that the server reports
on an authenticated route, so the launcher can tell the process it started from any other server that
answers on the same port (a leftover of an earlier attempt holds the same token, not the same nonce).

Only the standard library (and ``grpo_core.errors``) is imported here.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
from collections.abc import Mapping

from grpo_core.errors import PortInUseError

TOKEN_ENV = "GRPO_RUN_TOKEN"
"""Environment variable holding the run's bearer token (security-relevant: never log it)."""
NONCE_ENV = "GRPO_RUN_NONCE"
"""Environment variable holding one server launch's nonce (not secret)."""
NONCE_PATH = "/grpo/run_nonce"
"""Authenticated route of the generation servers answering ``{"nonce": ...}``."""
OPEN_PATHS = frozenset({"/health"})
"""HTTP paths answered without a token (they reveal nothing but liveness)."""


#: Fewest characters of a token that several trainer hosts share (``train.nnodes`` > 1).
MIN_SHARED_TOKEN_CHARS = 16


def token_problem(value: str) -> str | None:
    """Why ``value`` cannot be a bearer token (None when it can): it travels in HTTP ``Authorization`` headers,
    which take printable ASCII only, and a blank one would turn authentication off."""
    if not value.strip():
        return "it is empty or blank"
    bad = sorted({c for c in value if not "!" <= c <= "~"})
    if bad:
        return (
            f"it holds {len(bad)} character(s) an HTTP header cannot carry (spaces, non-ASCII or control "
            "characters); use printable ASCII, e.g. the output of `openssl rand -hex 32`"
        )
    return None


def new_token() -> str:
    """A fresh random token: 32 bytes from ``secrets`` (256 bits), URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def run_token(env: Mapping[str, str] | None = None) -> str | None:
    """The run's token from ``GRPO_RUN_TOKEN`` in ``env`` (default: this process's environment), or None."""
    value = (os.environ if env is None else env).get(TOKEN_ENV, "")
    return value or None


def ensure_run_token() -> str:
    """The run's token, generated and put in this process's environment (for its children) when missing."""
    token = run_token()
    if token is None:
        token = new_token()
        os.environ[TOKEN_ENV] = token
    return token


def bearer_headers(token: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}``, or ``{}`` without a token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def authorized(header_value: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <token>`` (constant-time comparison).

    Args:
        header_value: the request's ``Authorization`` header (None when absent).
        token: the run's token.
    """
    if not header_value or not token:
        return False
    scheme, _, given = header_value.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def check_port_free(host: str, port: int, field_name: str = "server.port") -> None:
    """Raise ``PortInUseError`` when ``host:port`` cannot be bound because another process listens there.

    Raises:
        PortInUseError: the port is taken (the message names ``field_name`` and the fix).
    """
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed socket in TIME_WAIT is no owner
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortInUseError(
                f"{host}:{port} is already in use ({exc.strerror or exc}): another process (another "
                f"run's server?) listens there and this run will not attach to it; stop it, or set "
                f"{field_name} to a free port (0 = pick one)"
            ) from None
