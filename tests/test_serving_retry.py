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

import httpx
import pytest

from grpo_core.errors import ServerUnavailableError
from grpo_core.serving.client import GenerationClient, backoff_delay
from grpo_core.serving.routing import ReplicaSet


def test_backoff_delay_is_uniform_below_the_exponential_bound():
    rng = random.Random(0)
    for attempt, bound in ((0, 0.5), (2, 2.0), (6, 8.0)):  # 0.5 * 2**6 = 32 is capped at 8
        draws = [backoff_delay(attempt, 0.5, 8.0, rng) for _ in range(4000)]
        assert 0.0 <= min(draws) and max(draws) <= bound
        # Uniform on [0, bound]: mean bound/2, standard deviation bound/sqrt(12).
        assert statistics.fmean(draws) == pytest.approx(bound / 2, rel=0.05)
        assert statistics.pstdev(draws) == pytest.approx(bound / 12**0.5, rel=0.05)


class _Unavailable(BaseHTTPRequestHandler):
    arrivals: list[tuple[str, float]] = []

    def do_GET(self):  # noqa: N802 - http.server's name
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


class _DropsFirstCompletion(BaseHTTPRequestHandler):
    """``/health`` answers 200; the first ``POST /v1/completions`` loses its connection without an answer (as
    a request sent on a keep-alive connection the server is closing does), later ones answer."""

    protocol_version = "HTTP/1.1"
    completions = 0

    def do_GET(self):  # noqa: N802 - http.server's name
        self._answer(200, b"{}")

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["content-length"]))
        type(self).completions += 1
        if type(self).completions == 1:
            self.close_connection = True  # no status line: the client sees the connection dropped
            return
        body = {"choices": [{"index": 0, "text": "", "token_ids": [7, 8], "prompt_token_ids": [1, 2],
                             "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.5, -0.25]}}]}
        self._answer(200, json.dumps(body).encode())

    def _answer(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # quiet
        pass


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


def test_generation_requests_spread_over_small_pools_by_fewest_in_flight():
    """httpcore's pool walks all its connections per request (encode/httpcore#1035): no pool may exceed
    POOL_CONNECTIONS, the pools together hold max_connections, and concurrent completions land on the pool
    with the fewest in flight (so they spread evenly)."""
    from grpo_core.serving import client as client_mod

    async def go() -> tuple[list[int], list[int]]:
        c = GenerationClient("http://127.0.0.1:9", max_connections=100, max_retries=0)
        sizes = [pool._transport._pool._max_connections for pool in c._pools]
        peak = [0] * len(c._pools)
        release = asyncio.Event()

        def fake(i):
            async def request(method, path, **kwargs):
                peak[i] = max(peak[i], c._in_flight[i])
                await release.wait()
                return httpx.Response(200, json={"choices": [{"index": 0, "token_ids": [1], "finish_reason": "stop",
                                                              "logprobs": {"token_logprobs": [-0.5]}}]})
            return request

        for i, pool in enumerate(c._pools):
            pool.request = fake(i)
        tasks = [asyncio.create_task(c.complete([1, 2], model="m", max_tokens=1)) for _ in range(40)]
        await asyncio.sleep(0.05)
        release.set()
        results = await asyncio.gather(*tasks)
        assert all(r[0].token_ids == [1] for r in results) and c._in_flight == [0] * len(c._pools)
        await c.aclose()
        return sizes, peak

    sizes, peak = asyncio.run(go())
    assert max(sizes) <= client_mod.POOL_CONNECTIONS and sum(sizes) >= 100 and len(sizes) == 4
    assert peak == [10, 10, 10, 10]
