"""HTTP retries of the generation client back off with jitter (a real HTTP server answering 503), and a routed
request whose connection drops is retried on its healthy replica (a real HTTP server dropping one)."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo_core.errors import ServerUnavailableError
from grpo_core.serving.client import GenerationClient, backoff_delay
from grpo_core.serving.replicas import ReplicaSet


def test_backoff_delay_is_uniform_below_the_exponential_bound():
    rng = random.Random(0)
    for attempt, bound in ((0, 0.5), (2, 2.0), (6, 8.0)):  # 0.5 * 2**6 = 32 is capped at 8
        draws = [backoff_delay(attempt, 0.5, 8.0, rng) for _ in range(4000)]
        assert min(draws) >= 0.0 and max(draws) <= bound
        # Uniform on [0, bound]: mean bound/2, standard deviation bound/sqrt(12).
        assert statistics.fmean(draws) == pytest.approx(bound / 2, rel=0.05)
        assert statistics.pstdev(draws) == pytest.approx(bound / 12**0.5, rel=0.05)


class _Unavailable(BaseHTTPRequestHandler):
    arrivals: list[tuple[str, float]] = []

    def do_GET(self):
        self.arrivals.append((self.headers.get("x-client", ""), time.monotonic()))
        self.send_response(503)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):  # quiet
        pass


def test_clients_failing_together_do_not_retry_in_lockstep():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    _Unavailable.arrivals = []

    async def one(i: int) -> None:
        async with GenerationClient(url, max_connections=2, timeout_s=10, max_retries=1, backoff_s=0.5) as c:
            c._http.headers["x-client"] = str(i)
            with pytest.raises(ServerUnavailableError):
                await c.models()

    async def all_clients() -> None:
        await asyncio.gather(*(one(i) for i in range(8)))

    try:
        asyncio.run(all_clients())
    finally:
        server.shutdown()
        server.server_close()
    by_client: dict[str, list[float]] = {}
    for client, at in _Unavailable.arrivals:
        by_client.setdefault(client, []).append(at)
    assert sorted(by_client) == [str(i) for i in range(8)]
    delays = [times[1] - times[0] for times in by_client.values()]
    assert all(len(times) == 2 for times in by_client.values())
    assert all(0.0 <= d <= 0.5 + 0.2 for d in delays)
    # Without jitter every client waits exactly backoff_s: the retries would land within a few ms.
    assert max(delays) - min(delays) > 0.05, f"retries in lockstep: {sorted(delays)}"


class _JsonHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 handler answering JSON bytes, quietly."""

    protocol_version = "HTTP/1.1"

    def _answer(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # quiet
        pass


class _DropsFirstCompletion(_JsonHandler):
    """``/health`` answers 200; the first ``POST /v1/completions`` loses its connection without an answer (as
    a request sent on a keep-alive connection the server is closing does), later ones answer."""

    completions = 0

    def do_GET(self):
        self._answer(200, b"{}")

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        type(self).completions += 1
        if type(self).completions == 1:
            self.close_connection = True  # no status line: the client sees the connection dropped
            return
        body = {
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "token_ids": [7, 8],
                    "prompt_token_ids": [1, 2],
                    "finish_reason": "stop",
                    "logprobs": {"token_logprobs": [-0.5, -0.25]},
                }
            ]
        }
        self._answer(200, json.dumps(body).encode())


def test_a_dropped_connection_to_a_healthy_replica_is_retried_not_routed_around():
    """Seen on the H200: a request on a connection vLLM was closing failed with ``ReadError``; the single replica
    was marked down and the rollout stalled until the probe re-admitted it, every ~10 s of the run."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _DropsFirstCompletion)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    _DropsFirstCompletion.completions = 0

    async def go():
        async with ReplicaSet([url], api_key="k") as rs:
            out = await rs.complete([1, 2], affinity_key="g", model="m", max_tokens=2)
            return out, list(rs.policy.healthy), rs.policy.counts.replica_down, rs.retry_count

    try:
        (out, healthy, down, retries) = asyncio.run(go())
    finally:
        server.shutdown()
    assert _DropsFirstCompletion.completions == 2, "the dropped request was sent again"
    assert out[0].token_ids == [7, 8] and out[0].logprobs == [-0.5, -0.25]
    assert healthy == [True] and down == 0, "a replica whose /health answers stays in the routing"
    assert retries == 1


class _Generation(_JsonHandler):
    """``POST /v1/completions``: records the headers and how many requests it holds at once; answers per
    ``statuses`` (popped per request, then 200) after ``hold_s``."""

    seen: list[dict[str, str]] = []
    statuses: list[int] = []
    hold_s = 0.0
    holding = peak = 0
    lock = threading.Lock()

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        cls = type(self)
        with cls.lock:
            cls.seen.append({k.lower(): v for k, v in self.headers.items()})
            status = cls.statuses.pop(0) if cls.statuses else 200
            cls.holding += 1
            cls.peak = max(cls.peak, cls.holding)
        time.sleep(cls.hold_s)
        with cls.lock:
            cls.holding -= 1
        body = (
            {
                "choices": [
                    {"index": 0, "token_ids": [5], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.5]}}
                ]
            }
            if status == 200
            else {"error": {"message": "nope", "type": "BadRequestError", "code": status}}
        )
        self._answer(status, json.dumps(body).encode())


@pytest.fixture
def generation_server():
    _Generation.seen, _Generation.statuses, _Generation.hold_s = [], [], 0.0
    _Generation.holding = _Generation.peak = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Generation)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_generation_requests_carry_the_token_and_version_and_retry_only_5xx(generation_server):
    """Completions travel through aiohttp (httpx's pool costs ~6x the CPU per request with hundreds in flight,
    encode/httpcore#1035): same headers, same retry rules as every other call of the client."""
    from grpo_core.errors import ServerRequestError

    _Generation.statuses = [503, 500, 200, 400]

    async def go():
        async with GenerationClient(generation_server, api_key="k", max_retries=2, backoff_s=0.01) as c:
            out = await c.complete([1, 2], model="m", max_tokens=1, policy_version=3)
            retries = c.retry_count
            with pytest.raises(ServerRequestError, match="nope"):
                await c.complete([1, 2], model="m", max_tokens=1)
            return out, retries, c.retry_count

    out, retries, after = asyncio.run(go())
    assert out[0].token_ids == [5] and retries == 2 and after == 2, "5xx retried twice, the 400 not at all"
    assert len(_Generation.seen) == 4
    assert all(h["authorization"] == "Bearer k" for h in _Generation.seen)
    assert [h.get("x-grpo-policy-version") for h in _Generation.seen] == ["3", "3", "3", None]


def test_generation_requests_hold_at_most_max_connections(generation_server):
    _Generation.hold_s = 0.2

    async def go():
        async with GenerationClient(generation_server, api_key="k", max_connections=8, max_retries=0) as c:
            outs = await asyncio.gather(*(c.complete([1], model="m", max_tokens=1) for _ in range(40)))
            return outs

    outs = asyncio.run(go())
    assert len(outs) == 40 and all(o[0].token_ids == [5] for o in outs)
    assert _Generation.peak == 8, f"the server held {_Generation.peak} requests at once"
