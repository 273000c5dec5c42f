"""The adaptive concurrency cap against the real embedded server's /metrics under real load.

The server's KV cache holds 512 tokens and requests may be 256 long, so the cap starts at 2;
two long requests fill the cache past 80% (the cap falls), and once they have finished an
idle poll raises it again (DESIGN.md §5).
"""

from __future__ import annotations

import asyncio

import pytest
from serving_helpers import TINY, embedded_server

from grpo_core.rollout.driver import poll_concurrency
from grpo_core.rollout.pace import ConcurrencyCap
from grpo_core.rollout.window import MetricWindow
from grpo_core.serving.client import GenerationClient
from grpo_core.serving.replicas import ReplicaSet

pytestmark = pytest.mark.slow


class _PollTarget:
    """What ``poll_concurrency`` reads from a rollout loop: the cap, the window, the replica set, max_model_len."""

    def __init__(self, client: GenerationClient, ceiling: int) -> None:
        self.cap = ConcurrencyCap(ceiling)
        self.window = MetricWindow()
        self.runtime = type("Runtime", (), {"server": ReplicaSet([client]), "max_model_len": 256})()


def test_cap_follows_the_real_server_kv_usage(tmp_path):
    with embedded_server(tmp_path, max_model_len=256, kv_cache_size_tokens=512) as server:

        async def go():
            async with GenerationClient(server.url, max_connections=8, timeout_s=120) as client:
                target = _PollTarget(client, ceiling=16)
                await poll_concurrency(target, first=True)
                assert target.cap.cap == 2, "KV cache tokens / max_model_len"
                long_prompt = list(range(1000, 1216))
                requests = [
                    asyncio.create_task(
                        client.complete(long_prompt, model=TINY, max_tokens=40, seed=i, ignore_eos=True)
                    )
                    for i in range(2)
                ]
                while (await client.metrics()).num_requests_running < 2:
                    await asyncio.sleep(0.01)
                await poll_concurrency(target)
                assert target.cap.cap == 1, "KV usage above 80%: the cap falls by 30%"
                await asyncio.gather(*requests)
                for _ in range(target.cap.cap):  # a cap's worth of rollouts finished
                    await target.cap.acquire()
                    await target.cap.release()
                await poll_concurrency(target)
                assert target.cap.cap == 2, "idle and nothing waiting: the cap rises"
                metrics = target.window.drain()
                assert metrics["rollout/vllm_kv_cache_usage_frac"] > 0

        asyncio.run(go())
