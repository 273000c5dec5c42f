"""Limits of the run's HTTP listeners (issue 26, item 14): a request head that never completes is cut, floods are
answered 503, an oversized body 413 before anything parses it, a long prompt does not stall ``/health``, and a
listener bound beyond loopback is warned about."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import httpx
import pytest
from serving_helpers import TINY, embedded_server, run

from grpo_core.security.auth import bearer_headers, run_token
from grpo_core.serving import limits

TOKEN = "limits-test-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _app(tokenizer=None, max_body: int | None = None):
    """The embedded server's app over no engine (its guard, routes and tokenizer path only)."""
    from grpo_core.serving.embedded.app import ServerState, create_app

    guard = {"token": TOKEN, **({"max_body": max_body} if max_body is not None else {})}
    state = ServerState(
        engine=None,
        tokenizer=tokenizer,
        weights=None,
        model_name=TINY,
        model_path="",
        max_logprobs=0,
        max_loras=0,
        guard=guard,
    )
    return create_app(state)


class _SlowTokenizer:
    """Blocks in ``encode`` until released (at most 20 s), recording whether it is still inside."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str) -> list[int]:
        self.inside.set()
        try:
            self.release.wait(20)
            return [1] * 4
        finally:
            self.inside.clear()

    def __len__(self) -> int:
        return 100


def test_health_answers_while_a_long_prompt_is_tokenized():
    """The prompt is tokenized off the event loop: ``/health`` answers while the tokenizer is still inside ``encode``
    (on the event loop it could answer only after the tokenizer returned)."""
    tokenizer = _SlowTokenizer()
    app = _app(tokenizer)

    async def go():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://embedded"
        ) as http:
            body = {"model": TINY, "prompt": "a long prompt " * 1000, "max_tokens": 1}
            big = asyncio.ensure_future(http.post("/v1/completions", json=body, headers=AUTH))
            deadline = time.monotonic() + 30
            while not tokenizer.inside.is_set() and not big.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            entered = tokenizer.inside.is_set() or big.done()
            health = await http.get("/health")
            during = tokenizer.inside.is_set()
            tokenizer.release.set()
            await big  # (no engine behind this app: its answer is an error, not checked here)
            return entered, health.status_code, during

    entered, health, during = run(go())
    assert entered and health == 200
    assert during, "/health was answered only after the tokenizer returned: tokenizing blocked the event loop"


def test_a_body_over_the_limit_is_413_before_anything_parses_it(monkeypatch):
    """Guard (embedded server, vLLM) and router: a declared or streamed body over the limit answers 413 naming the
    setting; a body within it reaches the app; a request without the token is 401 first (no body is read)."""
    from grpo_core.serving.replicas import ReplicaSet
    from grpo_core.serving.router.app import create_router_app

    monkeypatch.setenv(limits.MAX_BODY_ENV, "0.001")  # 1 KiB (1048 bytes) for the router, read at creation
    monkeypatch.setenv("GRPO_RUN_TOKEN", TOKEN)
    replicas = ReplicaSet(["http://127.0.0.1:9"], api_key=None, max_retries=0, backoff_s=0.01, max_backoff_s=0.01)
    apps = {"embedded": _app(max_body=1024), "router": create_router_app(replicas)}
    big = {"model": "nope", "prompt": "x" * 4096, "max_tokens": 1}
    small = {"model": "nope", "prompt": "x", "max_tokens": 1}

    async def chunks():
        for _ in range(8):
            yield b"x" * 512  # 4 KiB, no Content-Length

    async def go():
        seen = {}
        for name, app in apps.items():
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://listener") as http:
                declared = await http.post("/v1/completions", json=big, headers=AUTH)
                streamed = await http.post(
                    "/v1/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"}
                )
                anonymous = await http.post("/v1/completions", json=big)
                within = await http.post("/v1/completions", json=small, headers=AUTH)
                seen[name] = (declared, streamed, anonymous, within)
        await replicas.aclose()
        return seen

    for name, (declared, streamed, anonymous, within) in run(go()).items():
        assert "content-length" not in streamed.request.headers  # streamed: counted as it arrives
        for answer in (declared, streamed):
            assert answer.status_code == 413, (name, answer.status_code, answer.text)
            assert limits.MAX_BODY_ENV in answer.json()["error"]["message"]
        assert anonymous.status_code == 401, name
        assert within.status_code not in (401, 413), (name, within.status_code)  # the app answered it


def _held_open(url: str) -> dict[str, bytes]:
    """What a connection that sends nothing, and one that trickles an unfinished head, receive from ``url`` before
    the server closes them (``<still open after 60 s>`` when it did not)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    silent = socket.create_connection((host, int(port)))
    partial = socket.create_connection((host, int(port)))
    partial.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    answers = {}
    for name, conn in (("silent", silent), ("partial", partial)):
        conn.settimeout(60)  # an upper bound only: the server closes it after about 1 s
        data = b""
        try:
            while chunk := conn.recv(4096):
                data += chunk
        except TimeoutError:
            data += b"<still open after 60 s>"
        conn.close()
        answers[name] = data
    return answers


def test_a_request_head_that_never_completes_is_cut_and_the_servers_keep_serving(tmp_path, monkeypatch):
    """A real embedded server and a router in front of it (header timeout 1 s): a connection that sends nothing,
    and one that trickles an unfinished head, are answered 408 and closed; uvicorn alone kept both open for good."""
    from grpo_core.config import RunConfig
    from grpo_core.serving.router.server import start_router

    monkeypatch.setenv(limits.HEADER_TIMEOUT_ENV, "1")
    with embedded_server(tmp_path) as server:
        router = start_router(
            RunConfig(server={"router_port": 0, "log_dir": tmp_path}).server, [server.url], run_token()
        )
        try:
            for url in (server.url, router.url):
                answers = _held_open(url)
                assert all(a.startswith(b"HTTP/1.1 408") for a in answers.values()), (url, answers)
                with httpx.Client(base_url=url) as http:  # and it serves complete requests as before
                    assert http.get("/health").status_code == 200
                    models = http.get("/v1/models", headers=bearer_headers(run_token())).json()["data"]
                    assert models[0]["id"] == TINY
        finally:
            router.stop()


def test_requests_beyond_the_concurrency_limit_are_503(monkeypatch):
    """uvicorn with the listeners' options (limit 4): with 4 connections open, the next request is answered 503
    at once; when they close, requests are served again."""
    import uvicorn

    monkeypatch.setenv(limits.MAX_CONCURRENCY_ENV, "4")

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **limits.uvicorn_options()))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        try:
            deadline = time.monotonic() + 30  # the server registers the held connections as it accepts them
            while len(server.server_state.connections) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(server.server_state.connections) == 4
            flooded = httpx.get(f"http://127.0.0.1:{port}/")
            assert flooded.status_code == 503
        finally:
            for conn in held:
                conn.close()
        deadline = time.monotonic() + 30
        while server.server_state.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.parametrize(
    ("host", "warned"),
    [("127.0.0.1", False), ("::1", False), ("localhost", False), ("0.0.0.0", True), ("::", True), ("10.1.2.3", True)],
)
def test_binding_beyond_loopback_without_tls_is_warned_about(host, warned, caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_core.serving.limits"):
        assert limits.warn_if_exposed(host, "the router") is warned
    lines = [r.getMessage() for r in caplog.records]
    assert bool(lines) is warned
    if warned:
        assert f"the router listens on {host} without TLS" in lines[0]
