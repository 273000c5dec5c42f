"""One request with ``n`` choices for a group's rollouts that open together (``rollout.batch_group_prompts``).

The coalescer's contract is checked directly (who is sent together, with which first index, what each rollout
gets, failures and cancellations); the seed contract against a real embedded server (a request seeded ``s`` with
``n`` choices samples choice ``j`` as a request seeded ``s + j`` does, which makes rollout ``i``'s seed ``base + i``
whether or not it was batched); and the real rollout loop, driven against that server, sends one request per
group.
"""

from __future__ import annotations

import asyncio

import pytest
from rollout_helpers import position_reward
from serving_helpers import embedded_server
from transformers import AutoTokenizer

from grpo_core.config import ModelConfig, RolloutConfig
from grpo_core.models import resolve_model_dir
from grpo_core.rollout.coalesce import TurnCoalescer, consecutive_runs
from grpo_core.rollout.driver import drive
from grpo_core.rollout.loop import LoopRuntime, RolloutLoop, group_seed_base
from grpo_core.rollout.pace import TokenAllowance
from grpo_core.rollout.queue import SampleQueue
from grpo_core.serving.client import GenerationClient
from grpo_core.serving.replicas import ReplicaSet

G = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One embedded server for the module's tests (each paid ~10 s for its own on the loaded CI box): they only sample
    from the base weights, which none of them changes, and each request carries its own seed or none."""
    with embedded_server(tmp_path_factory.mktemp("server")) as handle:
        yield handle


def test_consecutive_runs():
    assert consecutive_runs([]) == []
    assert consecutive_runs([5, 0, 2, 1, 6]) == [[0, 1, 2], [5, 6]]
    assert consecutive_runs([3]) == [[3]]


def test_rollouts_asking_in_one_pass_share_a_request_in_runs_of_consecutive_indices():
    sent = []

    async def send(first, n):
        sent.append((first, n))
        await asyncio.sleep(0.01)
        return [f"choice {first + j}" for j in range(n)]

    async def go():
        c = TurnCoalescer()
        # rollouts 0, 1, 3 ask in the same pass under one key; 2 asks under another key; 4 asks a pass later
        first = await asyncio.gather(*(c.complete("k", i, send) for i in (3, 0, 1)), c.complete("other", 2, send))
        late = await c.complete("k", 4, send)
        return first, late, c.requests

    (first, late, requests) = asyncio.run(go())
    assert first == ["choice 3", "choice 0", "choice 1", "choice 2"] and late == "choice 4"
    assert sorted(sent) == [(0, 2), (2, 1), (3, 1), (4, 1)] and requests == 4


def test_a_failed_request_fails_each_of_its_rollouts_and_a_cancelled_one_is_not_asked_for():
    sent = []

    async def failing(first, n):
        sent.append((first, n))
        raise RuntimeError("server gone")

    async def go():
        c = TurnCoalescer()
        tasks = [asyncio.ensure_future(c.complete("k", i, failing)) for i in range(3)]
        await asyncio.sleep(0)  # every rollout has asked; the request is not sent yet
        tasks[1].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(go())
    assert isinstance(results[1], asyncio.CancelledError)
    assert [str(r) for r in (results[0], results[2])] == ["server gone", "server gone"]
    assert sorted(sent) == [(0, 1), (2, 1)], "rollout 1 was cancelled before the request: not asked for"


def test_a_request_with_n_choices_samples_each_as_its_seed_plus_index_would(server):
    """The seed contract the batching rests on, against the real embedded server (vLLM documents the same:
    ``ParentRequest.get_child_info`` seeds child j with seed + j)."""
    prompt = [1, 9038, 2684, 28, 253, 1046]
    sampling = {"model": "tiny-qwen3", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}

    async def go():
        async with GenerationClient(server.url) as c:
            together = await c.complete(prompt, n=G, seed=1234, **sampling)
            alone = [(await c.complete(prompt, seed=1234 + j, **sampling))[0] for j in range(G)]
            other = (await c.complete(prompt, seed=99, **sampling))[0]
            return together, alone, other

    together, alone, other = asyncio.run(go())
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert len({tuple(c.token_ids) for c in together}) > 1, "the choices differ from each other"
    assert other.token_ids not in [c.token_ids for c in together], "a different seed samples otherwise"


class CountingClient(GenerationClient):
    """A real client that records the ``n`` and seed of each completion request it sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: list[tuple[int, int | None, int]] = []

    async def complete(self, prompt_ids, **kwargs):
        self.sent.append((kwargs.get("n", 1), kwargs.get("seed"), len(prompt_ids)))
        return await super().complete(prompt_ids, **kwargs)


@pytest.mark.parametrize(("batched", "seed"), [(True, 0), (False, 0), (True, None), (False, None)])
def test_the_loop_sends_one_request_per_group_with_each_rollouts_seed(server, batched, seed):
    """Seeded (``rollout.seed`` an int): each request carries its rollouts' seed; unseeded (None, the GPU configs'
    choice): no request carries one, batched or not."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig(name="tiny-qwen3")))
    rows = [{"prompt": f"What is {i} + {i + 2}?"} for i in range(3)]
    cfg = RolloutConfig(
        num_generations=G,
        max_completion_length=6,
        num_sampler_logprobs=0,
        max_staleness=1,
        batch_group_prompts=batched,
        num_epochs=1,
        seed=seed,
    )

    async def go():
        client = CountingClient(server.url, max_retries=0)
        allowance = TokenAllowance(cfg.max_staleness, 1 << 20)
        queue = SampleQueue(allowance, with_topk=False)
        runtime = LoopRuntime(
            tokenizer=tokenizer,
            server=ReplicaSet([client]),
            model_name="tiny-qwen3",
            max_model_len=256,
            dataset=rows,
            queue=queue,
            allowance=allowance,
            reward_functions=[position_reward],
        )
        loop = RolloutLoop(cfg, runtime)
        await asyncio.wait_for(drive(loop), timeout=300)
        await client.aclose()
        return client.sent, allowance.completed_groups

    sent, groups = asyncio.run(go())
    assert groups == len(rows)
    if seed is None:
        assert {s for _, s, _ in sent} == {None}, "an unseeded run sends no seed"
    if batched:
        assert [n for n, _, _ in sent] == [G] * len(rows), "one request of G choices per group"
        if seed is not None:
            assert sorted(s for _, s, _ in sent) == sorted(group_seed_base(seed, g) for g in range(len(rows)))
    else:
        assert [n for n, _, _ in sent] == [1] * (G * len(rows))
