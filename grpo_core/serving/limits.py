"""Limits of the run's HTTP listeners against clients that hold or flood them (issue 26, item 14).

The embedded generation server, the router and the MLflow UI's proxy run uvicorn with :func:`uvicorn_options`:

* a header-read timeout: a connection that sent no complete request head within ``GRPO_HTTP_HEADER_TIMEOUT_S``
  seconds (30) of opening, or of its first byte after a response, is answered ``408`` and closed
  (:class:`HeaderTimeoutProtocol`; uvicorn itself waits forever for the head of a first request, and its
  keep-alive timeout ends once a byte arrives, so a client trickling a header held a connection and a slot);
  a slow body is not cut by it (the body-size limit bounds what it can cost);
* a concurrency limit: beyond ``GRPO_HTTP_MAX_CONCURRENCY`` (4096) open connections or requests in progress,
  uvicorn answers ``503`` at once (uvicorn's ``limit_concurrency``; above the 512 rollouts a run keeps in flight
  by default, ``rollout.max_concurrent_rollouts``);
* a request head of at most 64 KiB (h11's ``max_incomplete_event_size``).

The guard (:mod:`grpo_core.serving.guard`, on the embedded server and on vLLM) and the router refuse a request
body larger than ``GRPO_HTTP_MAX_BODY_MIB`` MiB (16) with ``413`` and a message naming the variable, before the
app parses it (:class:`BodyLimit`): from ``Content-Length`` at once, and while a chunked body streams in.

TLS: with the run's ``tls.cert_file`` and ``tls.key_file`` (:class:`grpo_core.config.TLSConfig`) the embedded
server and the router serve HTTPS (``--ssl-certfile``/``--ssl-keyfile``, vLLM's flag names: :func:`tls_options`),
and the run's clients verify them against ``tls.ca_file`` (:func:`client_ssl_context`). A listener bound beyond
loopback without TLS is logged as a warning naming those settings (:func:`warn_if_exposed`): the bearer token,
prompts and completions travel in clear there.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import ssl
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

HEADER_TIMEOUT_ENV = "GRPO_HTTP_HEADER_TIMEOUT_S"
MAX_CONCURRENCY_ENV = "GRPO_HTTP_MAX_CONCURRENCY"
MAX_BODY_ENV = "GRPO_HTTP_MAX_BODY_MIB"
DEFAULT_HEADER_TIMEOUT_S = 30.0
DEFAULT_MAX_CONCURRENCY = 4096
DEFAULT_MAX_BODY_MIB = 16.0
MAX_HEAD_BYTES = 64 * 1024
_TIMEOUT_ANSWER = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def _env_number(name: str, default: float, minimum: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; unset it for the default ({default:g})") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be at least {minimum:g}; unset it for the default ({default:g})")
    return value


def header_timeout_s() -> float:
    """Seconds a connection may take to send a request head (``GRPO_HTTP_HEADER_TIMEOUT_S``, default 30)."""
    return _env_number(HEADER_TIMEOUT_ENV, DEFAULT_HEADER_TIMEOUT_S, 0.1)


def max_concurrency() -> int:
    """Open connections or requests in progress beyond which a listener answers 503 (default 4096)."""
    return int(_env_number(MAX_CONCURRENCY_ENV, DEFAULT_MAX_CONCURRENCY, 1))


def max_body_bytes() -> int:
    """Largest request body a listener reads, in bytes (``GRPO_HTTP_MAX_BODY_MIB``, default 16 MiB)."""
    return int(_env_number(MAX_BODY_ENV, DEFAULT_MAX_BODY_MIB, 0.001) * 1024 * 1024)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a header-read timeout (see the module docstring).

    The timer starts when the connection opens and again with the first byte after a response; when it fires and
    no request head has been parsed since (no request yet, or the bytes of an unfinished head), the connection is
    answered 408 and closed. An idle keep-alive connection (no byte since the last response) is left to uvicorn's
    keep-alive timeout.
    """

    timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        """Start the header timer with the connection."""
        self._head_timer: asyncio.TimerHandle | None = None
        self._bytes_since_response = 0
        super().connection_made(transport)
        self._arm()

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.timeout_s, self._head_timeout)

    def _head_timeout(self) -> None:
        self._head_timer = None
        waiting = self.cycle is None or (self.cycle.response_complete and self._bytes_since_response > 0)
        if waiting and not self.transport.is_closing():
            self.transport.write(_TIMEOUT_ANSWER)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        """Count the bytes of a request whose head is not parsed yet, and start the timer for it."""
        if self._between_requests():
            self._bytes_since_response += len(data)
            self._arm()
        super().data_received(data)

    def on_response_complete(self) -> None:
        """A response went out: the next request's head gets its own timer from its first byte."""
        self._bytes_since_response = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the timer with the connection."""
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


def uvicorn_options() -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.Config`` for a listener of the run (see the module docstring)."""
    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"timeout_s": header_timeout_s()})
    return {
        "http": protocol,
        "limit_concurrency": max_concurrency(),
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }


def too_large_message(limit: int) -> str:
    """The 413 message: the limit and how to raise it."""
    return (
        f"request body larger than {limit / 1024 / 1024:g} MiB: refused unread; send smaller requests (token ids, "
        f"not text, for long prompts) or raise {MAX_BODY_ENV} where the server runs"
    )


class BodyLimit:
    """Pure ASGI middleware answering 413 to a request body over ``limit`` bytes (default :func:`max_body_bytes`).

    A ``Content-Length`` over the limit is refused before any byte is read; a body without one is read up to the
    limit and refused once it passes it. A body within the limit is read whole before the app sees it (at most
    ``limit`` bytes held), then handed over as one message; the body is vLLM's error shape
    (``{"error": {"message", "type", "code"}}``).
    """

    def __init__(self, app: Any, limit: int | None = None) -> None:
        self.app = app
        self.limit = limit if limit is not None else max_body_bytes()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """The ASGI entry (HTTP only)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limited = await limit_body(scope, receive, send, self.limit)
        if limited is not None:
            await self.app(scope, limited, send)


async def limit_body(scope: dict, receive: Any, send: Any, limit: int) -> Any:
    """Read an HTTP request's body, at most ``limit`` bytes (see :class:`BodyLimit`); returns the ``receive`` that
    hands it to the app, or None when the request was answered 413 (or its client left).

    Args:
        scope: the ASGI scope of an HTTP request.
        receive: its ``receive``.
        send: its ``send`` (the 413 goes out through it).
        limit: the largest body read, in bytes.
    """
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-length" and value.isdigit() and int(value) > limit:
            await _refuse(send, limit)
            return None
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":  # the client left: nothing to answer
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            await _refuse(send, limit)
            return None
        chunks.append(chunk)
        more = message.get("more_body", False)
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return await receive()

    return replay


async def _refuse(send: Any, limit: int) -> None:
    import json

    body = json.dumps({"error": {"message": too_large_message(limit), "type": "RequestTooLarge", "code": 413}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback only (``127.0.0.1``, ``::1``, ``localhost``)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


TLS_SETTINGS = "tls.cert_file and tls.key_file"
"""The config settings that turn TLS on, as warnings and errors name them."""


def warn_if_exposed(host: str, what: str, tls: bool = False) -> bool:
    """Log a warning when ``what`` binds ``host`` beyond loopback without TLS, where it speaks plain HTTP (or
    ``grpc``); returns whether it warned.

    Args:
        host: the interface bound.
        what: the listener, as the warning names it.
        tls: whether it serves TLS (no warning then).
    """
    if tls or is_loopback(host):
        return False
    logger.warning(
        "%s listens on %s without TLS: the bearer token, prompts and completions travel in clear to every "
        "host that can reach it; set %s (docs/security.md), bind 127.0.0.1, or put it behind a TLS proxy or a "
        "private network",
        what,
        host,
        TLS_SETTINGS,
    )
    return True


def tls_options(cert_file: str | os.PathLike | None, key_file: str | os.PathLike | None) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.Config`` serving HTTPS with ``cert_file`` and ``key_file`` (PEM); empty (plain
    HTTP) when ``cert_file`` is None.

    Raises:
        ValueError: only one of the two is given, or a file cannot be read (named, with the setting to fix).
    """
    if cert_file is None and key_file is None:
        return {}
    if cert_file is None or key_file is None:
        raise ValueError(f"TLS needs both a certificate and its key ({TLS_SETTINGS}; --ssl-certfile, --ssl-keyfile)")
    for path in (cert_file, key_file):
        if not os.access(path, os.R_OK):
            raise ValueError(f"TLS file {os.fspath(path)!r} cannot be read ({TLS_SETTINGS})")
    try:  # a key that does not match the certificate fails here, not at the first client's handshake
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise ValueError(f"TLS certificate {os.fspath(cert_file)!r} and key {os.fspath(key_file)!r}: {exc}") from None
    return {"ssl_certfile": os.fspath(cert_file), "ssl_keyfile": os.fspath(key_file)}


def client_ssl_context(ca_file: str | os.PathLike | None) -> ssl.SSLContext:
    """The TLS context a client of the run's listeners verifies them with: the certificate must chain to
    ``ca_file`` (PEM; ``tls.ca_file``) and name the host connected to; None = the system's trusted CAs."""
    return ssl.create_default_context(cafile=os.fspath(ca_file) if ca_file is not None else None)
