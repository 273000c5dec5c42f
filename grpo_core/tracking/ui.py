"""``grpo ui --mlflow``: the MLflow UI behind a password, reachable by no one else on the host without it.

MLflow's own server has no authentication (its basic-auth app needs a database of users and a secret key of its
own): anyone who reaches it reads every artifact (checkpoints, configs) and writes tags and registry aliases. So
MLflow serves on a Unix socket in a fresh folder of mode 0700 (``mlflow ui --uvicorn-opts "--uds PATH"``), which
no other user of the host can open, and this process listens on ``127.0.0.1:<--mlflow-port>`` in front of it: an
authenticating reverse proxy (:class:`AuthProxy`) that answers 401 to every request without the password
(HTTP basic auth, user ``grpo``: the browser asks for it once; or ``Authorization: Bearer <password>``) but
``GET /health`` (liveness only), and forwards the rest with the ``Authorization`` header removed. The password is
``GRPO_UI_PASSWORD`` when set, else a fresh random one written to a file of mode 0600 in a 0700 folder
(:func:`password_file`); it is never printed or put on a command line. The proxy's listener has the
header-read timeout and concurrency limit of the run's other HTTP listeners (``grpo_core.serving.limits``).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn

logger = logging.getLogger(__name__)

PASSWORD_ENV = "GRPO_UI_PASSWORD"
"""Environment variable holding the UI's password (else a fresh one is generated per start)."""
USER = "grpo"
"""The basic-auth user name the UI asks for."""
OPEN_PATHS = frozenset({"/health"})
#: Hop-by-hop headers (RFC 9110 §7.6.1) and the credentials: not forwarded to MLflow.
_DROPPED = frozenset(
    {
        "authorization",
        "connection",
        "keep-alive",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_DROPPED_BACK = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})


def password_file(port: int, folder: Path | None = None) -> Path:
    """Where the UI on ``port`` keeps its password: ``<folder>/ui-<port>.password`` (default folder
    ``runs/mlflow-ui`` under the working folder, created 0700)."""
    from grpo_core.run.stores import make_private_dir

    folder = make_private_dir(Path(folder) if folder is not None else Path.cwd() / "runs" / "mlflow-ui")
    return folder / f"ui-{port}.password"


def ui_password(port: int, folder: Path | None = None) -> tuple[str, Path | None]:
    """The UI's password and the file holding it: ``GRPO_UI_PASSWORD`` (no file), else a fresh random one
    (``grpo_core.security.auth.new_token``, 256 bits) written to :func:`password_file` with mode 0600."""
    from grpo_core.security.auth import new_token

    given = os.environ.get(PASSWORD_ENV)
    if given:
        return given, None
    password, path = new_token(), password_file(port, folder)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(password + "\n")
    return password, path


def credentials_ok(header: str | None, password: str) -> bool:
    """Whether an ``Authorization`` header carries the password: ``Basic base64(grpo:<password>)`` or
    ``Bearer <password>`` (constant-time comparison)."""
    if not header:
        return False
    scheme, _, given = header.partition(" ")
    if scheme.lower() == "bearer":
        return hmac.compare_digest(given.strip().encode(), password.encode())
    if scheme.lower() != "basic":
        return False
    try:
        decoded = base64.b64decode(given.strip(), validate=True)
    except ValueError:
        return False
    return hmac.compare_digest(decoded, f"{USER}:{password}".encode())


class AuthProxy:
    """ASGI app: checks the password, then forwards the request to the MLflow server on ``socket_path``.

    Args:
        socket_path: the Unix socket MLflow's uvicorn listens on.
        password: the UI's password.
    """

    def __init__(self, socket_path: Path, password: str) -> None:
        import httpx

        self.password = password
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(socket_path)), base_url="http://mlflow", timeout=None
        )

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """The ASGI entry (HTTP only; a websocket is closed)."""
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await self.client.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1008})
            return
        headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]
        given = next((v for k, v in headers if k == "authorization"), None)
        if scope["path"] not in OPEN_PATHS and not credentials_ok(given, self.password):
            body = b"the MLflow UI of grpo-flow needs its password (user grpo; see `grpo ui --mlflow`)\n"
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"www-authenticate", b'Basic realm="grpo-flow MLflow UI", charset="UTF-8"'),
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self._forward(scope, receive, send, [(k, v) for k, v in headers if k not in _DROPPED])

    async def _forward(self, scope: dict, receive: Any, send: Any, headers: list[tuple[str, str]]) -> None:
        import httpx

        async def body() -> AsyncIterator[bytes]:
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                yield message.get("body", b"")
                more = message.get("more_body", False)

        path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        url = path.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")
        request = self.client.build_request(scope["method"], url, headers=headers, content=body())
        try:
            answer = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            message = f"the MLflow server behind this UI does not answer: {type(exc).__name__}\n".encode()
            await send({"type": "http.response.start", "status": 502, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": message})
            return
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": answer.status_code,
                    "headers": [
                        (k.encode("latin-1"), v.encode("latin-1"))
                        for k, v in answer.headers.multi_items()
                        if k.lower() not in _DROPPED_BACK
                    ],
                }
            )
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await answer.aclose()


def _mlflow_ready(socket_path: Path) -> bool:
    import httpx

    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path)), timeout=2) as http:
            return http.get("http://mlflow/health").status_code == 200
    except httpx.HTTPError:
        return False


def serve(uri: str, artifact_root: str | None, port: int, password: str, startup_timeout_s: float = 300.0) -> int:
    """Run MLflow's UI on a private Unix socket and the authenticating proxy on ``127.0.0.1:port`` until MLflow
    exits, Ctrl-C or SIGTERM; then stop MLflow and every process it started. Returns MLflow's exit code (0 after
    Ctrl-C or SIGTERM).

    Args:
        uri: the tracking store URI (credentials included: it goes by environment, not argv).
        artifact_root: the default artifact root, or None.
        port: the proxy's port on 127.0.0.1.
        password: the UI's password (:func:`ui_password`).
        startup_timeout_s: seconds MLflow may take to answer on its socket.

    Raises:
        RuntimeError: MLflow did not answer on its socket within ``startup_timeout_s``.
    """
    import uvicorn

    from grpo_core.run.children import start_child, stop_child
    from grpo_core.serving.limits import uvicorn_options

    private = Path(tempfile.mkdtemp(prefix="grpo-mlflow-"))  # 0700: only this user can open the socket in it
    socket_path = private / "mlflow.sock"
    cmd = [sys.executable, "-m", "mlflow", "ui", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    cmd += ["--uvicorn-opts", f"--uds {socket_path}"]  # uvicorn binds the socket instead of host:port
    env = {**os.environ, "MLFLOW_BACKEND_STORE_URI": uri}
    env.pop(PASSWORD_ENV, None)
    if artifact_root:
        env["MLFLOW_DEFAULT_ARTIFACT_ROOT"] = artifact_root

    def interrupt(signum: int, frame: object) -> NoReturn:  # noqa: ARG001 - SIGTERM stops the UI like Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    process: subprocess.Popen = start_child(cmd, env=env)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not _mlflow_ready(socket_path):  # Ctrl-C or SIGTERM while MLflow starts: KeyboardInterrupt
            if process.poll() is not None:
                return process.returncode or 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"the MLflow UI did not answer on its socket within {startup_timeout_s:.0f} s")
            time.sleep(0.5)
        server = uvicorn.Server(
            uvicorn.Config(
                AuthProxy(socket_path, password), host="127.0.0.1", port=port, log_level="warning", **uvicorn_options()
            )
        )

        async def run() -> None:
            async def watch() -> None:  # MLflow exited: stop the proxy too
                while process.poll() is None and not server.should_exit:
                    await asyncio.sleep(0.5)
                server.should_exit = True

            watcher = asyncio.ensure_future(watch())
            try:
                await server.serve()
            finally:
                watcher.cancel()

        # uvicorn stops the proxy on Ctrl-C or SIGTERM, then raises the signal again once it restored the handlers
        # it found: a KeyboardInterrupt here, so MLflow is stopped below instead of left behind by a default SIGTERM
        asyncio.run(run())
        code = process.poll()
        return 0 if code is None else code
    except KeyboardInterrupt:
        logger.info("stopping the MLflow UI")
        return 0
    finally:
        stop_child(process, timeout_s=15)
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(private, ignore_errors=True)
