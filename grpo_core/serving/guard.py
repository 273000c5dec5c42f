"""ASGI middleware guarding a generation server the run started (embedded server and vLLM alike).

The same class wraps the embedded server's FastAPI app (``create_app``) and real vLLM's app
(``vllm serve --middleware grpo_core.serving.guard.RunGuardMiddleware``; vLLM adds a middleware
class with ``app.add_middleware(cls)``, no arguments, so every setting has an environment
fallback). It:

* answers 401 to any request without ``Authorization: Bearer <key>`` of the run, before the request
  reaches a route (so nothing is parsed or changed), except ``GET /health``, which reveals only
  liveness. Two keys pass (``grpo_core.security.auth``): the control key (``GRPO_CONTROL_KEY``) on every route, and
  the inference key derived from it (``GRPO_INFERENCE_KEY``) on the generation routes only
  (``grpo_core.serving.protocol.INFERENCE_PATHS``): elsewhere it gets 403 naming the control key. vLLM's own
  ``--api-key`` check (``VLLM_API_KEY``) covers only paths under ``/v1`` (vLLM 0.25.1
  ``AuthenticationMiddleware``) and takes one key, so the launcher leaves it off; its dev-mode routes
  (``/pause``, ``/resume``, ``/start_weight_update``, ``/update_weights``, ``/collective_rpc``, ``/server_info``, …) and
  ``/metrics`` are covered here;
* answers ``GET /grpo/identity?challenge=<hex>`` without a token with the launch's nonce and an HMAC of the
  challenge under the run's token (``grpo_core.security.auth.identity_answer``), so the launcher can tell the process it
  started from another server on the same port without sending that server the token
  (``grpo_core.serving.launch.wait_healthy``); ``GET /grpo/run_nonce`` (authenticated) reports the nonce as well;
* refuses (403) a LoRA adapter load whose ``lora_path`` is outside the run's adapter folder, and a
  full-weight update whose ``update_info.path`` is outside the run's weights folder;
* fences a replica whose full-weight update failed (``POST /grpo/stale {"stale": true, "reason"}``, sent by the
  trainer's weight sync before it resumes the replica): until ``{"stale": false}`` (the next update that reaches it)
  or a restart, ``/health`` and new generation requests answer 503, and a generation request in flight when the
  fence went up answers 503 instead of its result (its tokens came from weights of no policy version; a streamed
  answer whose first chunk went out before is not cut), so every
  router (the rollout's, ``grpo_core.serving.router``) routes around the replica, counts it, and re-admits it when
  ``/health`` answers 200 again;
* knows which policy version it serves: every full-weight sync that reaches it lowers its fence naming the version
  (``{"stale": false, "version": v}``); a generation request tagged ``X-GRPO-Policy-Version: v`` with ``v`` > 0
  that reaches a guard no sync has reached since its process started (a replica restarted by its owner, or by
  the servers' flow: it holds the base weights, i.e. policy version 0) raises the fence at once and is answered
  503 of type ``PolicyVersionBehind``, so no base-weight token is tagged with a later version; the rollout then
  asks the trainer to sync its current weights again (``grpo_core.train.trainer``), which lowers the fence;
* answers 413 to a request body larger than ``GRPO_HTTP_MAX_BODY_MIB`` (16 MiB), after the token check and before
  anything parses it (``grpo_core.serving.limits``);
* caps a pause: ``max_pause_s`` seconds after ``POST /pause`` (or ``/start_weight_update``) with no
  ``POST /resume`` since, it resumes the server itself (an internal ``POST /resume``) and logs a
  warning, so a stray pause cannot stall a run for longer.

Environment (set per launch by ``grpo_core.serving.launch``): ``GRPO_CONTROL_KEY`` (required; a process holding
``GRPO_RUN_TOKEN`` instead derives it, and the token itself then grants control too), ``GRPO_INFERENCE_KEY``,
``GRPO_RUN_NONCE``, ``GRPO_MAX_PAUSE_S``, ``GRPO_ADAPTER_DIR``, ``GRPO_WEIGHTS_DIR``. The routes, headers and error
types named here are ``grpo_core.serving.protocol``'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

from grpo_core.security.auth import (
    CONTROL_KEY_ENV,
    INFERENCE_KEY_ENV,
    NONCE_ENV,
    ROLE_CONTROL,
    ROLE_INFERENCE,
    TOKEN_ENV,
    bearer_role,
    identity_answer,
    listener_keys,
    run_token,
)
from grpo_core.serving.limits import limit_body, max_body_bytes
from grpo_core.serving.protocol import (
    BEHIND_ERROR_TYPE,
    FENCE_HEADER,
    GENERATION_PATHS,
    HEALTH_PATH,
    IDENTITY_PATH,
    INFERENCE_PATHS,
    LOAD_LORA_PATH,
    NONCE_PATH,
    OPEN_PATHS,
    PAUSE_PATHS,
    POLICY_VERSION_HEADER,
    RESUME_PATH,
    STALE_PATH,
    UPDATE_WEIGHTS_PATH,
    error_body,
    role_refusal,
)

logger = logging.getLogger(__name__)

MAX_PAUSE_ENV = "GRPO_MAX_PAUSE_S"
ADAPTER_DIR_ENV = "GRPO_ADAPTER_DIR"
WEIGHTS_DIR_ENV = "GRPO_WEIGHTS_DIR"
DEFAULT_MAX_PAUSE_S = 300.0


def inside(path: str, root: str | Path | None) -> bool:
    """Whether ``path`` resolves (symlinks and ``..`` followed) to ``root`` or below it; False without a root.

    An fsspec URL root (``s3://bucket/run``, ``train.adapter_store``) admits URLs below it with no ``..`` part.
    """
    if not root:
        return False
    if "://" in str(root) or "://" in path:
        base = str(root).rstrip("/") + "/"
        return path.startswith(base) and ".." not in path[len(base) :].split("/")
    return Path(path).resolve().is_relative_to(Path(root).resolve())


async def _send_json(send: Any, status: int, body: dict[str, Any], extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *extra],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def _read_body(receive: Any) -> bytes | None:
    """The whole body of an HTTP request, or None when the client disconnected first."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


class RunGuardMiddleware:
    """Pure ASGI middleware; see the module docstring.

    Args:
        app: the wrapped ASGI app.
        token: the server's control key, or the run's token (every route; the identity proofs are keyed by it);
            default ``GRPO_CONTROL_KEY``, else ``GRPO_RUN_TOKEN``. The control key derived from it passes too, and
            the inference keys derived from those (and ``GRPO_INFERENCE_KEY`` when set without ``token``) pass on
            the generation routes only (``grpo_core.security.auth.listener_keys``).
        nonce: this launch's nonce; default ``GRPO_RUN_NONCE`` ('' = none).
        max_pause_s: seconds a pause may last before the server resumes itself; default
            ``GRPO_MAX_PAUSE_S`` or 300; 0 = no limit.
        adapter_dir: the only folder LoRA adapters may be loaded from; default ``GRPO_ADAPTER_DIR``
            (unset = every adapter load is refused).
        weights_dir: the only folder full weights may be read from; default ``GRPO_WEIGHTS_DIR``.
        max_body: the largest request body read, in bytes; default ``GRPO_HTTP_MAX_BODY_MIB`` or 16 MiB
            (``grpo_core.serving.limits``).

    Raises:
        RuntimeError: no token (the server must not start unguarded).
    """

    def __init__(
        self,
        app: Any,
        token: str | None = None,
        nonce: str | None = None,
        max_pause_s: float | None = None,
        adapter_dir: str | Path | None = None,
        weights_dir: str | Path | None = None,
        max_body: int | None = None,
    ) -> None:
        self.app = app
        self.max_body = max_body if max_body is not None else max_body_bytes()
        secret = token or os.environ.get(CONTROL_KEY_ENV) or run_token()
        if not secret:
            raise RuntimeError(
                f"neither {CONTROL_KEY_ENV} nor {TOKEN_ENV} is set: the server needs the run's control key (or token) "
                f"in its environment (e.g. {TOKEN_ENV}=$(python -c 'import secrets; print(secrets.token_urlsafe(32))'))"
            )
        self._token: str = secret  # keys the identity proofs
        self._control, self._inference = listener_keys(secret)
        if not token and (own := os.environ.get(INFERENCE_KEY_ENV)):
            self._inference.append(own)
        self.nonce = nonce if nonce is not None else os.environ.get(NONCE_ENV, "")
        env_pause = os.environ.get(MAX_PAUSE_ENV)
        self.max_pause_s = (
            max_pause_s if max_pause_s is not None else (float(env_pause) if env_pause else DEFAULT_MAX_PAUSE_S)
        )
        self.adapter_dir = adapter_dir or os.environ.get(ADAPTER_DIR_ENV) or None
        self.weights_dir = weights_dir or os.environ.get(WEIGHTS_DIR_ENV) or None
        self._pause_generation = 0
        self.stale: str | None = None  # why the replica is fenced off (a failed weight update); None = serving
        self._stale_epoch = 0  # times the fence went up: a request that saw another epoch at its start is fenced
        self._behind = False  # the fence is up because a request asked for a version this process never received
        # the policy version the last full-weight sync that reached this process named; None = none since it started
        self.policy_version: int | None = None
        self._pause_timer: asyncio.TimerHandle | None = None
        self._expiry: asyncio.Task | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """The ASGI entry: fence, pause and path checks around the wrapped app."""
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "").removeprefix(scope.get("root_path", "") or "") or "/"
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if path == IDENTITY_PATH and scope["type"] == "http" and scope.get("method") == "GET":
            await _send_json(send, *identity_answer(scope.get("query_string", b""), self._token, self.nonce))
            return
        role = (
            ROLE_CONTROL
            if path in OPEN_PATHS
            else bearer_role(headers.get("authorization"), self._control, self._inference)
        )
        if role is None or (role == ROLE_INFERENCE and path not in INFERENCE_PATHS):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            if role is None:
                body = error_body("Unauthorized: this server needs the run's bearer token", 401, "Unauthorized")
            else:
                body = error_body(role_refusal(path), 403, "Forbidden")
            await _send_json(send, body["error"]["code"], body)
            return
        if scope["type"] == "http":  # a body over the limit: 413 before anything parses it (grpo_core.serving.limits)
            receive = await limit_body(scope, receive, send, self.max_body)
            if receive is None:
                return
        if path == NONCE_PATH:
            await _send_json(send, 200, {"nonce": self.nonce})
            return
        if path == STALE_PATH and scope["type"] == "http":
            await self._set_stale(receive, send)
            return
        if path in GENERATION_PATHS and POLICY_VERSION_HEADER.lower() in headers:
            wanted = headers[POLICY_VERSION_HEADER.lower()]
            if not wanted.isdigit():
                await _send_json(
                    send,
                    400,
                    error_body(
                        f"{POLICY_VERSION_HEADER} must be a policy version (an integer >= 0), got {wanted!r}",
                        400,
                        "BadRequest",
                    ),
                )
                return
            if self.policy_version is None and int(wanted) > 0 and self.stale is None:
                self.stale = (
                    f"no weight sync of the run reached it since it started (restarted?): it holds the base "
                    f"weights, not policy version {wanted}"
                )
                self._stale_epoch += 1
                self._behind = True
                logger.error("fenced off (503 on /health and generation requests): %s", self.stale)
        if self.stale is not None and (path == HEALTH_PATH or path in GENERATION_PATHS):
            await _send_json(send, 503, self._stale_error(), ((FENCE_HEADER.lower().encode(), b"up"),))
            return
        if path in GENERATION_PATHS and scope["type"] == "http":
            await self._fenced(scope, receive, send)
            return
        if scope["type"] == "http" and scope.get("method") == "POST":
            receive = await self._check_paths(path, receive, send)
            if receive is None:
                return
            if path in PAUSE_PATHS or path == RESUME_PATH:
                await self._track_pause(path, scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _stale_error(self) -> dict[str, Any]:
        return error_body(
            f"this replica is out of routing: {self.stale}; it rejoins once a weight update reaches it "
            "(or it restarts)",
            503,
            BEHIND_ERROR_TYPE if self._behind else "ServiceUnavailable",
        )

    async def _set_stale(self, receive: Any, send: Any) -> None:
        """``POST /grpo/stale {"stale": bool, "reason": str, "version": int}``: raise or lower the fence (see the
        module docstring); ``version`` (with ``"stale": false``): the policy version the sync that lowers it sent."""
        body = await _read_body(receive)
        if body is None:
            return
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            data = None
        version = data.get("version") if isinstance(data, dict) else None
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("stale"), bool)
            or not (version is None or (type(version) is int and version >= 0))
        ):
            await _send_json(
                send,
                400,
                error_body(
                    'body must be {"stale": true|false, "reason": "...", "version": <policy version, optional>}',
                    400,
                    "BadRequest",
                ),
            )
            return
        if data["stale"]:
            self.stale = str(data.get("reason") or "a weight update failed")
            self._stale_epoch += 1
            self._behind = False
            logger.error("fenced off (503 on /health and generation requests): %s", self.stale)
        else:
            if version is not None:
                self.policy_version = version
            if self.stale is not None:
                logger.warning(
                    "fence lowered: the replica holds the current weights again%s",
                    "" if version is None else f" (policy version {version})",
                )
            self.stale, self._behind = None, False
        await _send_json(send, 200, {"stale": self.stale is not None, "policy_version": self.policy_version})

    async def _fenced(self, scope: dict, receive: Any, send: Any) -> None:
        """Pass a generation request on; if the fence went up since it started, answer 503 instead of its result."""
        epoch, replaced = self._stale_epoch, []

        async def fenced_send(message: dict) -> None:
            if message["type"] == "http.response.start" and self._stale_epoch != epoch:
                replaced.append(True)
                await _send_json(
                    send,
                    503,
                    self._stale_error()
                    if self.stale
                    else error_body(
                        "a weight update failed on this replica while the request ran; retry it elsewhere",
                        503,
                        "ServiceUnavailable",
                    ),
                )
                return
            if not replaced:
                await send(message)

        await self.app(scope, receive, fenced_send)

    async def _check_paths(self, path: str, receive: Any, send: Any) -> Any:
        """The request's ``receive`` (replaying the body read here), or None after a 403 answer."""
        if path not in (LOAD_LORA_PATH, UPDATE_WEIGHTS_PATH):
            return receive
        body = await _read_body(receive)
        if body is None:
            return None
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            data = {}
        data = data if isinstance(data, dict) else {}
        if path == LOAD_LORA_PATH:
            given, root, what = data.get("lora_path"), self.adapter_dir, "LoRA adapters (the run's adapter folder)"
        else:
            info = data.get("update_info")
            given = info.get("path") if isinstance(info, dict) else None
            root, what = self.weights_dir, "full weights (the run's weights folder)"
        if isinstance(given, str) and not inside(given, root):
            logger.warning("refused %s from %s: outside %s", path, given, root)
            await _send_json(
                send,
                403,
                error_body(
                    f"{given} is outside {root or 'any allowed folder'}: this server loads {what} only",
                    403,
                    "Forbidden",
                ),
            )
            return None
        replay = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()

        return replayed

    async def _track_pause(self, path: str, scope: dict, receive: Any, send: Any) -> None:
        """Pass the request on; a successful pause starts the clock, a resume stops it."""
        status: list[int] = []

        async def watching_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, receive, watching_send)
        if not status or status[0] >= 400:
            return
        self._pause_generation += 1
        if self._pause_timer is not None:
            self._pause_timer.cancel()
            self._pause_timer = None
        if path in PAUSE_PATHS and self.max_pause_s > 0:
            generation, loop = self._pause_generation, asyncio.get_running_loop()
            self._pause_timer = loop.call_later(self.max_pause_s, self._start_expiry, generation, dict(scope))

    def _start_expiry(self, generation: int, scope: dict) -> None:
        """Timer callback: run :meth:`_expire` as a task, kept referenced until it ends (asyncio holds tasks weakly)."""
        self._expiry = asyncio.get_running_loop().create_task(self._expire(generation, scope))

    async def _expire(self, generation: int, scope: dict) -> None:
        """Resume the server after ``max_pause_s`` if nothing paused or resumed it since."""
        if generation != self._pause_generation:
            return
        self._pause_timer = None
        logger.warning(
            "the server has been paused for %.0f s (server.max_pause_s) without a resume: resuming it", self.max_pause_s
        )
        scope.update(method="POST", path=RESUME_PATH, raw_path=RESUME_PATH.encode(), query_string=b"", headers=[])
        sent = [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive() -> dict:
            return sent.pop() if sent else {"type": "http.disconnect"}

        status: list[int] = []

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        await self.app(scope, receive, send)
        self._pause_generation += 1
        logger.warning("resumed after the pause limit (HTTP %s)", status[0] if status else "?")
