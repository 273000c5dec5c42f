"""HTTP retries of the generation client back off with jitter (the fake generation server answering 503), and a
routed request whose connection drops is retried on its healthy replica (the fake dropping one)."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest

from grpo_core.errors import ServerUnavailableError
from grpo_core.serving.client import GenerationClient, backoff_delay
from grpo_core.serving.protocol import COMPLETIONS_PATH, MODELS_PATH, POLICY_VERSION_HEADER
from grpo_core.serving.replicas import ReplicaSet


def test_backoff_delay_is_uniform_below_the_exponential_bound():
    rng = random.Random(0)
    for attempt, bound in ((0, 0.5), (2, 2.0), (6, 8.0)):  # 0.5 * 2**6 = 32 is capped at 8
        draws = [backoff_delay(attempt, 0.5, 8.0, rng) for _ in range(4000)]
        assert min(draws) >= 0.0 and max(draws) <= bound
        # Uniform on [0, bound]: mean bound/2, standard deviation bound/sqrt(12).
        assert statistics.fmean(draws) == pytest.approx(bound / 2, rel=0.05)
        assert statistics.pstdev(draws) == pytest.approx(bound / 12**0.5, rel=0.05)


def test_clients_failing_together_do_not_retry_in_lockstep(fake_generation):
    fake_generation.script(MODELS_PATH, status=503)
    url = fake_generation.url

    async def one(i: int) -> None:
        async with GenerationClient(url, max_connections=2, timeout_s=10, max_retries=1, backoff_s=0.5) as c:
            c._http.headers["x-client"] = str(i)
            with pytest.raises(ServerUnavailableError):
                await c.models()

    async def all_clients() -> None:
        await asyncio.gather(*(one(i) for i in range(8)))

    asyncio.run(all_clients())
    by_client: dict[str, list[float]] = {}
    for request in fake_generation.calls(MODELS_PATH):
        by_client.setdefault(request.headers.get("x-client", ""), []).append(request.at)
    assert sorted(by_client) == [str(i) for i in range(8)]
    delays = [times[1] - times[0] for times in by_client.values()]
    assert all(len(times) == 2 for times in by_client.values())
    assert all(0.0 <= d <= 0.5 + 0.2 for d in delays)
    # Without jitter every client waits exactly backoff_s: the retries would land within a few ms.
    assert max(delays) - min(delays) > 0.05, f"retries in lockstep: {sorted(delays)}"


def _two_tokens(request, prompt, choice):
    return [7, 8], [-0.5, -0.25], "stop"


def test_a_dropped_connection_to_a_healthy_replica_is_retried_not_routed_around(fake_generation):
    """Seen on the H200: a request on a connection vLLM was closing failed with ``ReadError``; the single replica
    was marked down and the rollout stalled until the probe re-admitted it, every ~10 s of the run. The fake drops
    the first completion without a status line (as a request sent on a keep-alive connection the server is
    closing), answers later ones, and ``/health`` answers 200."""
    fake_generation.script(COMPLETIONS_PATH, drop_first=1)
    fake_generation.complete_with(_two_tokens)
    url = fake_generation.url

    async def go():
        async with ReplicaSet([url], api_key="k") as rs:
            out = await rs.complete([1, 2], affinity_key="g", model="m", max_tokens=2)
            return out, list(rs.policy.healthy), rs.policy.counts.replica_down, rs.retry_count

    (out, healthy, down, retries) = asyncio.run(go())
    assert len(fake_generation.calls(COMPLETIONS_PATH)) == 2, "the dropped request was sent again"
    assert out[0].token_ids == [7, 8] and out[0].logprobs == [-0.5, -0.25]
    assert healthy == [True] and down == 0, "a replica whose /health answers stays in the routing"
    assert retries == 1


def _one_token(request, prompt, choice):
    return [5], [-0.5], "stop"


@pytest.fixture
def generation_server(fake_generation):
    """The fake answering every completion with token 5 (log-prob -0.5, finish "stop")."""
    fake_generation.complete_with(_one_token)
    return fake_generation


def test_generation_requests_carry_the_token_and_version_and_retry_only_5xx(generation_server):
    """Completions travel through aiohttp (httpx's pool costs ~6x the CPU per request with hundreds in flight,
    encode/httpcore#1035): same headers, same retry rules as every other call of the client."""
    from grpo_core.errors import ServerRequestError

    generation_server.script(COMPLETIONS_PATH, statuses=[503, 500, 200, 400])

    async def go():
        async with GenerationClient(generation_server.url, api_key="k", max_retries=2, backoff_s=0.01) as c:
            out = await c.complete([1, 2], model="m", max_tokens=1, policy_version=3)
            retries = c.retry_count
            with pytest.raises(ServerRequestError, match="scripted 400 on /v1/completions"):  # its error body
                await c.complete([1, 2], model="m", max_tokens=1)
            return out, retries, c.retry_count

    out, retries, after = asyncio.run(go())
    assert out[0].token_ids == [5] and retries == 2 and after == 2, "5xx retried twice, the 400 not at all"
    seen = [r.headers for r in generation_server.calls(COMPLETIONS_PATH)]
    assert len(seen) == 4
    assert all(h["authorization"] == "Bearer k" for h in seen)
    assert [h.get(POLICY_VERSION_HEADER.lower()) for h in seen] == ["3", "3", "3", None]


def test_generation_requests_hold_at_most_max_connections(generation_server):
    generation_server.script(COMPLETIONS_PATH, hold_s=0.2)

    async def go():
        async with GenerationClient(generation_server.url, api_key="k", max_connections=8, max_retries=0) as c:
            outs = await asyncio.gather(*(c.complete([1], model="m", max_tokens=1) for _ in range(40)))
            return outs

    outs = asyncio.run(go())
    assert len(outs) == 40 and all(o[0].token_ids == [5] for o in outs)
    assert len(generation_server.calls(COMPLETIONS_PATH)) == 40
    assert generation_server.peak == 8, f"the server held {generation_server.peak} requests at once"
