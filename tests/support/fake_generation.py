"""One scriptable fake of the generation servers' HTTP API, for tests (issue 29, item 4).

:class:`FakeGeneration` is a real HTTP server on ``127.0.0.1`` (port 0, a thread per request) that serves the
routes of :mod:`grpo_core.serving.protocol` by their names there (never by spelling a path), records every request
in order and answers as a vLLM 0.25.1 server would, deterministically:

* ``COMPLETIONS_PATH``: the body is parsed as :class:`~grpo_core.serving.protocol.CompletionRequest` (a bad body
  gets vLLM's 400 error body) and answered by :func:`~grpo_core.serving.protocol.completion_response`: ``n``
  choices per prompt, ``max_tokens`` tokens each, token ``k`` of choice ``c`` of prompt ``p`` is
  ``(p[-1] + 1 + c + k) % vocab_size`` with log-prob ``-1.0`` and finish reason ``"length"``, unless a test
  gives its own rule (:meth:`FakeGeneration.complete_with`) or delegates to the engine simulator (``upstream``,
  :func:`simulated_generation`) where it needs an engine's pacing;
* ``HEALTH_PATH``, ``MODELS_PATH``, ``METRICS_PATH`` (vLLM's gauge names; running = requests in flight),
  ``PAUSE_PATH`` / ``RESUME_PATH`` / ``IS_PAUSED_PATH``, the full-weight sequence (``UPDATE_WEIGHTS_PATH``
  advances :attr:`FakeGeneration.version`), the LoRA routes (:attr:`FakeGeneration.adapters`), ``NONCE_PATH``,
  ``STALE_PATH``, ``SERVER_INFO_PATH``, ``WORLD_SIZE_PATH``, ``RESET_PREFIX_CACHE_PATH``; any other path is
  vLLM's 404, unless :data:`ANY_ROUTE` is scripted.

A test scripts a route's behaviour with :meth:`FakeGeneration.script`: answer a status (every call, or a list
popped per call), drop the connection without an answer for the first K calls, hold a request until an event is
set (every request, or those a rule picks, e.g. by seed) or for a fixed time. A refused pause is
``script(PAUSE_PATH, status=409)``, a failed update ``script(UPDATE_WEIGHTS_PATH, status=500)``.

Used as a context manager (``with FakeGeneration() as fake: fake.url``) or through the ``fake_generation``
fixture of ``tests/conftest.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
from pydantic import ValidationError

from grpo_core.serving import protocol as p

ANY_ROUTE = "*"
"""Route name of :meth:`FakeGeneration.script` that applies to every path without a script of its own (also the
paths the protocol does not name: another server that answers everything)."""


ARRIVALS = itertools.count()
"""Arrival numbers of every fake's requests (:attr:`Recorded.number`); a test may number its own events from it too, to
order them against the requests."""


@dataclass(frozen=True)
class Recorded:
    """One request as the fake received it.

    Attributes:
        method: ``GET`` or ``POST``.
        route: the path without the query (``/v1/completions``).
        query: the query's values by name (``{"mode": ["keep"]}``).
        body: the JSON body (None without one or when it is not JSON).
        headers: header values by lower-case name.
        at: ``time.monotonic()`` when it arrived, in seconds.
        number: its arrival number across every fake of this process (orders requests to several servers).
        call: the how-manieth call of its route's script it is (0 without a script).
    """

    method: str
    route: str
    query: dict[str, list[str]]
    body: Any
    headers: dict[str, str]
    at: float
    number: int
    call: int = 0


@dataclass
class Script:
    """What one route does instead of its normal answer (see :meth:`FakeGeneration.script`)."""

    status: int | None = None
    statuses: list[int] = field(default_factory=list)
    body: Any = None
    drop_first: int = 0
    hold_until: threading.Event | None = None
    hold_when: Callable[[Recorded], bool] | None = None
    hold_s: float | Callable[[Recorded], float] = 0.0
    before: Callable[[Recorded], object] | None = None
    calls: int = 0


@dataclass
class _Choice:
    """Duck type of the embedded engine's ``Sequence`` that :func:`protocol.completion_response` reads."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str
    stop_token_ids: frozenset[int] = frozenset()


Completer = Callable[[p.CompletionRequest, list[int], int], tuple[list[int], list[float], str]]
"""A completion rule: (request, prompt ids, choice index) -> (token ids, their log-probs, finish reason)."""


def default_completion(request: p.CompletionRequest, prompt: list[int], choice: int, vocab_size: int = 1000):
    """The fake's deterministic completion: ``max_tokens`` (default 16) tokens ``(prompt[-1] + 1 + choice + k) %
    vocab_size``, log-prob -1.0 each, finish reason ``"length"``."""
    count = request.max_tokens or 16
    last = prompt[-1] if prompt else 0
    return [(last + 1 + choice + k) % vocab_size for k in range(count)], [-1.0] * count, "length"


class FakeGeneration:
    """A scriptable fake generation server (module docstring); start with ``with`` or :meth:`start`.

    Args:
        model: the served model's name (``/v1/models``, the completions' ``model``).
        max_model_len: reported by ``/v1/models``.
        upstream: a server (e.g. :func:`simulated_generation`'s engine) that answers every unscripted completion
            instead of the fake's rule; the fake still records and scripts the request.
        nonce: what ``NONCE_PATH`` answers.
        middleware: wraps the fake's ASGI app (e.g. ``lambda app: RunGuardMiddleware(app, token=...)``, the guard
            every server of a run has): the fake then serves through uvicorn, records every request before the
            middleware sees it (one the middleware answers itself too) and answers what it lets through; the
            wrapped app is :attr:`guard`. A dropped connection answers 500 there.

    Attributes:
        requests: every request received, in arrival order (:class:`Recorded`).
        paused: whether ``PAUSE_PATH`` (or ``START_WEIGHT_UPDATE_PATH``) paused it and nothing resumed it since.
        version: the served policy version (``UPDATE_WEIGHTS_PATH`` adds 1; ``STALE_PATH`` with a version sets it).
        adapters: loaded LoRA adapters, name -> path.
        guard: the ``middleware``'s instance (None without one).
        held: requests held right now (:meth:`script`'s ``hold_until``/``hold_s``).
        active, peak: requests being answered right now, and the most at once since the start.
    """

    def __init__(
        self,
        model: str = "m",
        max_model_len: int = 256,
        upstream: str | None = None,
        nonce: str = "fake-nonce",
        middleware: Callable[[Any], Any] | None = None,
    ) -> None:
        self.model, self.max_model_len, self.upstream, self.nonce = model, max_model_len, upstream, nonce
        self._middleware = middleware
        self.guard: Any = None
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None
        self._port = 0
        self.requests: list[Recorded] = []
        self.paused = False
        self.version = 0
        self.adapters: dict[str, str] = {}
        self.held = self.active = self.peak = 0
        self.lock = threading.Lock()
        self._scripts: dict[str, Script] = {}
        self._completer: Completer = default_completion
        self._httpd: ThreadingHTTPServer | None = None
        self._upstream_http = httpx.Client(timeout=300) if upstream else None

    # --- set-up -------------------------------------------------------------------------------------------------

    def script(
        self,
        route: str,
        *,
        status: int | None = None,
        statuses: list[int] | tuple[int, ...] = (),
        body: Any = None,
        drop_first: int = 0,
        hold_until: threading.Event | None = None,
        hold_when: Callable[[Recorded], bool] | None = None,
        hold_s: float | Callable[[Recorded], float] = 0.0,
        before: Callable[[Recorded], object] | None = None,
    ) -> Script:
        """Script ``route`` (a protocol name such as ``protocol.COMPLETIONS_PATH``, or :data:`ANY_ROUTE`).

        Args:
            route: the path the script applies to.
            status: answer this HTTP status on every call (a vLLM error body unless ``body`` is given; 200 with
                ``body`` answers it instead of the normal answer).
            statuses: statuses popped one per call (after ``drop_first``); once empty, ``status`` or the normal
                answer.
            body: the JSON body of a scripted status.
            drop_first: the first ``drop_first`` calls lose their connection without a status line.
            hold_until: hold each request (those ``hold_when`` picks) until this event is set, 120 s at most.
            hold_when: which requests ``hold_until``/``hold_s`` hold (default every one).
            hold_s: hold each (picked) request this many seconds before answering (server-side latency), or a rule
                giving each request's seconds (a decode-bound server: its length over a speed).
            before: called with each request, in its thread, after any hold and before the answer (a test's hook:
                e.g. wait there for another server's state).

        Returns:
            The :class:`Script` (its ``calls`` counts the route's calls).

        Raises:
            ValueError: ``route`` is neither a path nor :data:`ANY_ROUTE`.
        """
        if route != ANY_ROUTE and not route.startswith("/"):
            raise ValueError(f"route {route!r}: name a path of grpo_core.serving.protocol or ANY_ROUTE")
        self._scripts[route] = Script(status, list(statuses), body, drop_first, hold_until, hold_when, hold_s, before)
        return self._scripts[route]

    def complete_with(self, rule: Completer) -> None:
        """Answer completions by ``rule`` (see :data:`Completer`) instead of :func:`default_completion`."""
        self._completer = rule

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (after :meth:`start`)."""
        if not self._port:
            raise RuntimeError("FakeGeneration.url before start(): use `with FakeGeneration() as fake`")
        return f"http://127.0.0.1:{self._port}"

    @property
    def port(self) -> int:
        """The port it listens on (after :meth:`start`)."""
        return urlsplit(self.url).port or 0

    def posts(self) -> list[tuple[str, dict[str, list[str]]]]:
        """``(route, query)`` of every POST received, in order."""
        with self.lock:
            return [(r.route, r.query) for r in self.requests if r.method == "POST"]

    def body(self, route: str) -> Any:
        """The JSON body of the first request on ``route``.

        Raises:
            LookupError: no request reached ``route``.
        """
        found = self.calls(route)
        if not found:
            raise LookupError(f"no request on {route}; received {[r.route for r in self.requests]}")
        return found[0].body

    def calls(self, route: str) -> list[Recorded]:
        """The requests received on ``route``, in order."""
        with self.lock:
            return [r for r in self.requests if r.route == route]

    def start(self) -> FakeGeneration:
        """Listen on 127.0.0.1, port 0, and serve in a daemon thread (uvicorn's, with ``middleware``).

        Raises:
            AssertionError: uvicorn did not start within 30 s.
        """
        if self._middleware is None:
            self._httpd = _Server(("127.0.0.1", 0), self._handler())
            self._port = self._httpd.server_address[1]
            threading.Thread(target=self._httpd.serve_forever, name="fake-generation", daemon=True).start()
            return self
        import uvicorn
        from waiting import wait_until

        from grpo_core.serving.embedded.server import bind_socket

        sock = bind_socket("127.0.0.1", 0)
        self._port = sock.getsockname()[1]
        self._uvicorn = uvicorn.Server(uvicorn.Config(self._asgi(), log_level="warning"))
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        wait_until(lambda: self._uvicorn.started, "the fake generation server (uvicorn) to start", 30, 0.01)
        return self

    def stop(self) -> None:
        """Release every held request, stop serving and close the socket."""
        for script in self._scripts.values():
            if script.hold_until is not None:
                script.hold_until.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._uvicorn is not None and self._thread is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=10)
        if self._upstream_http is not None:
            self._upstream_http.close()

    def __enter__(self) -> FakeGeneration:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- answers ------------------------------------------------------------------------------------------------

    def _normal(self, req: Recorded) -> tuple[int, Any]:
        """The route's unscripted answer: (status, JSON body or text)."""
        route, body = req.route, req.body if isinstance(req.body, dict) else {}
        ok = {"status": "ok"}
        if route == p.HEALTH_PATH:
            return 200, b""
        if route == p.MODELS_PATH:
            card = {"id": self.model, "object": "model", "owned_by": "vllm", "max_model_len": self.max_model_len}
            return 200, {"object": "list", "data": [card, *({"id": a, "parent": self.model} for a in self.adapters)]}
        if route == p.COMPLETIONS_PATH and req.method == "POST":
            return self._complete(req)
        if route == p.METRICS_PATH:
            lines = [
                f'vllm:num_requests_running{{model_name="{self.model}"}} {self.active}',
                f'vllm:num_requests_waiting{{model_name="{self.model}"}} 0',
                f'vllm:kv_cache_usage_perc{{model_name="{self.model}"}} 0.0',
            ]
            return 200, ("\n".join(lines) + "\n").encode()
        if route in (p.PAUSE_PATH, p.START_WEIGHT_UPDATE_PATH):
            self.paused = True
            return 200, {"status": "paused"} if route == p.PAUSE_PATH else ok
        if route in (p.RESUME_PATH, p.FINISH_WEIGHT_UPDATE_PATH):
            self.paused = False
            return 200, {"status": "resumed"} if route == p.RESUME_PATH else ok
        if route == p.IS_PAUSED_PATH:
            return 200, {"is_paused": self.paused}
        if route == p.UPDATE_WEIGHTS_PATH:
            self.version += 1
            return 200, {**ok, "version": self.version}
        if route in (p.INIT_WEIGHT_TRANSFER_PATH, p.RESET_PREFIX_CACHE_PATH):
            return 200, ok
        if route == p.LOAD_LORA_PATH:
            self.adapters[body.get("lora_name", "")] = body.get("lora_path", "")
            return 200, ok
        if route == p.UNLOAD_LORA_PATH:
            if self.adapters.pop(body.get("lora_name", ""), None) is None:
                return 404, p.error_body("The lora adapter cannot be found.", 404, "NotFoundError", "lora_name")
            return 200, ok
        if route == p.NONCE_PATH:
            return 200, {"nonce": self.nonce}
        if route == p.STALE_PATH:
            if not body.get("stale") and isinstance(body.get("version"), int):
                self.version = body["version"]
            return 200, ok
        if route == p.SERVER_INFO_PATH:
            return 200, {"backend": "fake", "max_model_len": self.max_model_len}
        if route == p.WORLD_SIZE_PATH:
            return 200, {"world_size": 1}
        return 404, p.error_body(f"Not Found: {req.method} {route}", 404, "NotFoundError")

    def _complete(self, req: Recorded) -> tuple[int, Any]:
        if self.upstream is not None and self._upstream_http is not None:
            headers = {k: v for k, v in req.headers.items() if k in ("authorization", "content-type")}
            answer = self._upstream_http.post(self.upstream + req.route, json=req.body, headers=headers)
            return answer.status_code, answer.json()
        try:
            request = p.CompletionRequest.model_validate(req.body)
        except ValidationError as exc:
            return 400, p.error_body(f"invalid request: {exc.errors()[0]['msg']}", 400, "BadRequestError")
        raw = request.prompt
        if not raw or isinstance(raw, str) or isinstance(raw[0], str):
            return 400, p.error_body("the fake takes token-id prompts only", 400, "BadRequestError", "prompt")
        prompts = [list(x) for x in raw] if isinstance(raw[0], list) else [list(raw)]  # type: ignore[arg-type]
        seqs = []
        for prompt in prompts:
            for choice in range(request.n):
                ids, logprobs, reason = self._completer(request, prompt, choice)
                top = [[(t, lp)] for t, lp in zip(ids, logprobs, strict=True)]
                stops = frozenset(request.stop_token_ids or ())
                seqs.append(_Choice(prompt, ids, logprobs, top, reason, stops))
        answer = p.completion_response(request, request.model or self.model, seqs, lambda t: f"token_id:{t}", str)  # type: ignore[arg-type]
        for choice in answer["choices"]:  # the client reads token ids; the text stands for them
            choice["text"] = " ".join(map(str, choice["token_ids"] or []))
        return 200, answer

    # --- the HTTP side ------------------------------------------------------------------------------------------

    def _record(self, method: str, target: str, headers: dict[str, str], raw: bytes) -> tuple[Recorded, Script | None]:
        """Record one arriving request and count a call of its route's script."""
        parts = urlsplit(target)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        req = Recorded(method, parts.path, parse_qs(parts.query), body, headers, time.monotonic(), next(ARRIVALS))
        with self.lock:
            self.requests.append(req)
            script = self._scripts.get(req.route) or self._scripts.get(ANY_ROUTE)
            if script is not None:
                script.calls += 1
                req = replace(req, call=script.calls)
        return req, script

    def _respond(self, req: Recorded, script: Script | None) -> tuple[int, Any] | None:
        """The answer to a recorded request, (status, JSON body or bytes), after any hold; None = drop it."""
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            return self._scripted(req, script) if script is not None else self._normal(req)
        finally:
            with self.lock:
                self.active -= 1

    def _scripted(self, req: Recorded, script: Script) -> tuple[int, Any] | None:
        if req.call <= script.drop_first:
            return None
        picked = script.hold_when is None or script.hold_when(req)
        hold_s = script.hold_s(req) if callable(script.hold_s) else script.hold_s
        if picked and (script.hold_until is not None or hold_s > 0):
            with self.lock:
                self.held += 1
            try:
                if script.hold_until is not None:
                    script.hold_until.wait(timeout=120)
                else:
                    threading.Event().wait(hold_s)  # the server's latency, not a wait for a state
            finally:
                with self.lock:
                    self.held -= 1
        if script.before is not None:
            script.before(req)
        with self.lock:
            status = script.statuses.pop(0) if script.statuses else script.status
        if status is None or (status == 200 and script.body is None):
            return self._normal(req)
        if script.body is not None:
            return status, script.body
        return status, p.error_body(f"scripted {status} on {req.route}", status, _kind(status))

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                answer = fake._respond(*fake._record(self.command, self.path, headers, raw))
                if answer is None:
                    self.close_connection = True  # no status line: the client sees the connection dropped
                    return
                status, payload = answer
                data, kind = _encode(payload)
                try:
                    self.send_response(status)
                    self.send_header("content-type", kind)
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client is gone
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = _serve  # noqa: N815 - http.server's method names

        return Handler

    def _asgi(self) -> Any:
        """The fake as an ASGI app (with ``middleware``): the recorder records a request as it arrives and passes it
        on (through ``middleware``) to the answerer, which answers it in a worker thread (holds block only it)."""
        fake = self
        pending: dict[int, tuple[Recorded, Script | None]] = {}

        async def answerer(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
                return
            req, script = pending.pop(scope["fake_arrival"])
            answer = await asyncio.to_thread(fake._respond, req, script)
            status, payload = answer if answer is not None else (500, p.error_body("dropped", 500, "Dropped"))
            data, kind = _encode(payload)
            await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind.encode())]})
            await send({"type": "http.response.body", "body": data})

        inner = self._middleware(answerer) if self._middleware is not None else answerer
        self.guard = inner if self._middleware is not None else None

        async def recorder(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await inner(scope, receive, send)
                return
            chunks, more = [], True
            while more:
                message = await receive()
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
            raw = b"".join(chunks)
            target = scope["path"] + ("?" + scope["query_string"].decode() if scope["query_string"] else "")
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            req, script = fake._record(scope["method"], target, headers, raw)
            pending[req.number] = (req, script)
            replay = [{"type": "http.request", "body": raw, "more_body": False}]

            async def again() -> dict:
                return replay.pop() if replay else await receive()

            try:
                await inner({**scope, "fake_arrival": req.number}, again, send)
            finally:
                pending.pop(req.number, None)  # a request the middleware answered itself

        return recorder


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # hundreds of rollouts connect at once

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away (the test or benchmark ended its loop) is no error; anything else is printed."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _encode(payload: Any) -> tuple[bytes, str]:
    if isinstance(payload, bytes):
        return payload, "text/plain"
    return json.dumps(payload).encode(), "application/json"


def _kind(status: int) -> str:
    return {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError", 409: "Conflict"}.get(
        status, "InternalServerError" if status >= 500 else "Error"
    )


@contextmanager
def simulated_generation(calibration_name: str = "h200", **settings: Any) -> Iterator[FakeGeneration]:
    """A :class:`FakeGeneration` whose unscripted completions the engine simulator answers with its pacing (the
    fake still records and scripts every request): one
    :class:`~grpo_core.serving.simulated.server.SimulatedServers` engine with ``settings``
    (:class:`~grpo_core.serving.simulated.engine.EngineSettings` fields; ``model_name`` defaults to ``"m"``) and
    the named cost calibration (:data:`~grpo_core.serving.simulated.cost.CALIBRATIONS`)."""
    from grpo_core.serving.simulated.cost import calibration
    from grpo_core.serving.simulated.engine import EngineSettings
    from grpo_core.serving.simulated.server import SimulatedServers

    engine = EngineSettings(**{"model_name": "m", **settings})
    with (
        SimulatedServers(1, calibration(calibration_name), engine) as sim,
        FakeGeneration(model=engine.model_name, upstream=sim.urls[0]) as fake,
    ):
        yield fake
