"""How many requests the rollout keeps in flight, counted by the fake generation server, a real HTTP server
(DESIGN.md §5, token allowance).

The server answers the first groups at once and holds every later request, so the loop ends
blocked with its admission rule alone deciding how many requests sit at the server. A dropped
group (its rewards all tie) never reaches the trainer, so it must not count against the staleness
limit; a group waiting only for its slowest rollout holds no concurrency slot for the finished ones.
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
from fake_generation import FakeGeneration
from transformers import AutoTokenizer

from grpo_core.config import ModelConfig, RolloutConfig
from grpo_core.models import resolve_model_dir
from grpo_core.rollout.driver import drive
from grpo_core.rollout.loop import LoopRuntime, RolloutLoop, request_seed
from grpo_core.rollout.pace import TokenAllowance
from grpo_core.rollout.queue import SampleQueue
from grpo_core.serving.client import GenerationClient
from grpo_core.serving.protocol import COMPLETIONS_PATH, METRICS_PATH
from grpo_core.serving.replicas import ReplicaSet

G = 2
COMPLETION = 8  # tokens of every completion (finish "length")


def _sevens(request, prompt, choice):
    """Every completion: token 7 up to ``max_tokens``, log-prob -1.0, finish ``length``."""
    return [7] * request.max_tokens, [-1.0] * request.max_tokens, "length"


def keep_pattern(completion_ids, keep, **_):
    """Rewards that vary inside a group whose row says ``keep`` (queued) and tie otherwise (dropped)."""
    return [float(i) if k else 0.0 for i, k in enumerate(keep)]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig(name="tiny-qwen3")))


def run_until_blocked(
    tokenizer, rows, step_groups: float, answered_groups: int = 2, first_rollout_answered: bool = False, **rollout
) -> tuple[int, RolloutLoop, int]:
    """Drive a real loop against the fake generation server until it admits nothing more; returns the requests
    held, the loop, and the tokens of one group. The fake answers the requests whose seed picks the first
    ``answered_groups`` groups (and with ``first_rollout_answered`` the first rollout of every group) at once and
    holds every other until released; its ``/metrics`` answers 404 (the cap stays at its ceiling)."""
    cfg = RolloutConfig(  # in the dataset's order: the server answers groups by their position
        num_generations=G,
        max_completion_length=COMPLETION,
        num_sampler_logprobs=0,
        max_staleness=1,
        shuffle=False,
        **rollout,
    )
    answer_now = {request_seed(cfg.seed, group, i, 0) for group in range(answered_groups) for i in range(G)}
    if first_rollout_answered:
        answer_now |= {request_seed(cfg.seed, group, 0, 0) for group in range(len(rows))}
    release = threading.Event()
    server = FakeGeneration().start()
    server.script(METRICS_PATH, status=404)
    server.script(COMPLETIONS_PATH, hold_until=release, hold_when=lambda r: r.body["seed"] not in answer_now)
    server.complete_with(_sevens)

    async def go():
        client = GenerationClient(server.url, max_connections=cfg.max_concurrent_rollouts, timeout_s=300, max_retries=0)
        probe = RolloutLoop(
            cfg,
            LoopRuntime(
                tokenizer=tokenizer,
                server=None,
                model_name="m",
                max_model_len=256,
                dataset=[],
                queue=None,
                allowance=TokenAllowance(1, 1),
            ),
        )
        prompt_tokens = len(probe.render([{"role": "user", "content": rows[0]["prompt"]}]))
        probe.executor.shutdown()
        group_tokens = G * (prompt_tokens + COMPLETION)
        allowance = TokenAllowance(cfg.max_staleness, int(step_groups * group_tokens))
        runtime = LoopRuntime(
            tokenizer=tokenizer,
            server=ReplicaSet([client]),
            model_name="m",
            max_model_len=256,
            dataset=rows,
            queue=SampleQueue(allowance, with_topk=False),
            allowance=allowance,
            reward_functions=[keep_pattern],
        )
        loop = RolloutLoop(cfg, runtime)
        task = asyncio.create_task(drive(loop))
        # Blocked: the first two groups are done, every started rollout sits at the server, and no group may start.
        for _ in range(12000):  # a guard against waiting forever, not a speed check
            if (
                allowance.completed_groups == answered_groups
                and server.held == loop.unfinished_rollouts
                and (not allowance.may_start_group() or loop.unfinished_rollouts + G > loop.cap.cap)
            ):
                break
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)
        else:
            pytest.fail(f"the loop never stopped admitting groups ({server.held} requests held)")
        for _ in range(20):  # nothing else arrives while it stays blocked
            await asyncio.sleep(0.01)
        held = server.held
        release.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        return held, loop, group_tokens, prompt_tokens

    try:
        held, loop, group_tokens, prompt_tokens = asyncio.run(go())
    finally:
        server.stop()
    prompt_lengths = {len(r.body["prompt"]) for r in server.calls(COMPLETIONS_PATH)}
    assert prompt_lengths == {prompt_tokens}, "every request carried the rendered prompt"
    return held, loop, group_tokens


def test_dropped_groups_do_not_count_against_the_staleness_limit(tokenizer):
    # Groups 0-7 are answered: group 0 is kept (it queues one group's tokens T), groups 1-7 are dropped.
    # Every later group is held in flight.
    rows = [{"prompt": "Count to 3.", "keep": i == 0} for i in range(200)]
    held, loop, group_tokens = run_until_blocked(tokenizer, rows, step_groups=5, answered_groups=8)
    assert loop.runtime.allowance.queued_tokens == group_tokens
    # Limit 10 T: (max_staleness 1 + 1) steps of 5 T. A group in flight may queue T times the Wilson upper bound
    # (z = 2) of the kept share, 1 of 8: (1/8 + 4/16 + 2 sqrt(7/512 + 4/256)) / (1 + 4/8) = 0.4782 (math, not the code).
    upper = (1 / 8 + 4 / 16 + 2 * math.sqrt(7 / 512 + 4 / 256)) / (1 + 4 / 8)
    assert abs(upper - 0.4782) < 1e-4
    # A group may start while T + n x upper T + upper T <= 10 T: n <= 17, so 18 groups end up in flight.
    n = max(k for k in range(200) if 1 + k * upper + upper <= 10)
    assert n == 17 and held == (n + 1) * G
    # The old rule (every group in flight at its full size T) stopped at T + n T + T <= 10 T: 9 groups.
    assert held > 9 * G


def test_a_groups_finished_rollouts_free_their_concurrency_slots(tokenizer):
    # Every group is kept and the allowance never binds; the cap is 6 rollouts. The server answers the first
    # rollout of each group and holds the second, so each group in flight has one unfinished rollout.
    rows = [{"prompt": "Count to 3.", "keep": True} for _ in range(200)]
    held, loop, _ = run_until_blocked(
        tokenizer, rows, step_groups=1000, first_rollout_answered=True, max_concurrent_rollouts=6
    )
    # A group of 2 may start while unfinished + 2 <= 6: with n groups of one unfinished rollout each, n <= 4,
    # so 5 groups sit at the server, one request each.
    assert loop.cap.cap == 6 and held == 5
    # Counting whole groups (2 slots each, finished or not) stopped at 3 groups: 3 requests for a cap of 6.
    assert held > 3
