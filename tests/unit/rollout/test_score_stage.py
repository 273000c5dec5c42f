"""Scoring as its own bounded stage (issue 25, item 8; the seed manual's rollout metrics): finished groups wait in
FIFO order for a scoring worker; while ``rollout.score_queue_maxsize`` of them wait, the driver starts no new group
and logs the hold as ``rollout/score_block_s``.

The groups go through the real driver (``produce``) and ``RolloutLoop.run_group``; only sampling is scripted (no
server). A "slow" reward is an async function that waits on an event the test sets, so when scoring ends is decided
by the test, not by a clock.
"""

from __future__ import annotations

import asyncio

import pytest
from waiting import async_wait_until

from grpo_core.config import RolloutConfig
from grpo_core.rollout import driver
from grpo_core.rollout.loop import _REQUEST, LoopRuntime, RolloutLoop
from grpo_core.rollout.pace import TokenAllowance
from grpo_core.rollout.queue import SampleQueue
from grpo_core.rollout.types import Rollout, TurnRecord

G = 3
PROMPTS = 6


class RecordingQueue(SampleQueue):
    """Records the prompts settled: queued with samples (in order) or consumed without."""

    def __init__(self, allowance):
        super().__init__(allowance, with_topk=False)
        self.queued: list[int] = []
        self.samples_per_group: list[int] = []
        self.settled_without: list[int] = []

    def put_group(self, prompt_index, samples, tokens):
        self.queued.append(prompt_index)
        self.samples_per_group.append(len(samples))
        super().put_group(prompt_index, samples, tokens)

    def consumed(self, prompt_index):
        self.settled_without.append(prompt_index)
        super().consumed(prompt_index)


class ScriptedLoop(RolloutLoop):
    """Rollout i of a group answers ``"x" * (i + 1)`` at once (no server); records the groups that started and
    every ``rollout/score_block_s`` value the driver logs (one per group start)."""

    def __init__(self, config, runtime):
        super().__init__(config, runtime)
        self.started: list[int] = []
        self.score_block: list[float] = []
        add = self.window.add

        def recording_add(name, value):
            if name == "rollout/score_block_s":
                self.score_block.append(value)
            add(name, value)

        self.window.add = recording_add

    def prompt_too_long(self, row):
        return None  # no tokenizer: the scripted prompts are short

    async def generate_one(self, prompt, tools, group_id=0):
        if group_id not in self.started:
            self.started.append(group_id)
        text = "x" * (_REQUEST.get()[1] + 1)  # the rollout's index in its group
        ids = list(range(10, 10 + len(text)))
        turn = TurnRecord(prompt_ids=[1, 2], output_ids=ids, output_log_probs=[-0.5] * len(ids), text=text)
        return Rollout(completion=[{"role": "assistant", "content": text}], completion_ids=ids, turns=[turn])


def _loop(reward, **rollout) -> ScriptedLoop:
    cfg = RolloutConfig(num_generations=G, num_sampler_logprobs=0, shuffle=False, reward_workers=0, **rollout)
    allowance = TokenAllowance(cfg.max_staleness, 1 << 20)
    allowance.group_started()  # past the first-group rule (one group at a time until one completes)
    allowance.group_finished(0, queued=False)
    runtime = LoopRuntime(
        tokenizer=None,
        server=None,
        model_name="m",
        max_model_len=256,
        dataset=[{"prompt": f"q{i}"} for i in range(PROMPTS)],
        queue=RecordingQueue(allowance),
        allowance=allowance,
        reward_functions=[reward],
    )
    return ScriptedLoop(cfg, runtime)


def length_reward(completions, **_):
    """The answer's length: distinct within a group, so no group is dropped for tied rewards."""
    return [float(len(c[-1]["content"])) for c in completions]


async def _produce(loop: ScriptedLoop) -> None:
    try:
        async with asyncio.TaskGroup() as tasks:
            await driver.produce(loop, tasks)
    finally:
        loop.executor.shutdown(wait=False)


def test_a_slow_scorer_with_a_queue_of_one_holds_generation_back_and_logs_the_hold(monkeypatch):
    release = asyncio.Event()
    scoring: list[int] = []

    async def slow_reward(completions, **_):
        scoring.append(len(completions))
        await release.wait()
        return length_reward(completions)

    slow_reward.__name__ = "slow_reward"
    # one scoring worker (an async reward: max_concurrent_rollouts of them), one group may wait
    loop = _loop(slow_reward, max_concurrent_rollouts=1, score_queue_maxsize=1)
    assert loop.score_workers == 1
    full_polls = [0]
    real_full = driver._score_full

    def counting_full(target):
        full = real_full(target)
        full_polls[0] += full
        return full

    monkeypatch.setattr(driver, "_score_full", counting_full)

    async def go():
        run = asyncio.create_task(_produce(loop))
        # group 0 is being scored (its reward waits), group 1 finished and waits for the one worker: the queue is
        # full, and the driver sees it on several polls without starting group 2
        await async_wait_until(
            lambda: _running(run, len(scoring) == 1 and loop.unscored_groups == 1 and full_polls[0] >= 3),
            "group 0 scoring, group 1 waiting, the driver polling a full scoring queue",
        )
        assert loop.started == [0, 1], "no group starts while the scoring queue is full"
        allowance = loop.runtime.allowance
        assert allowance.may_start_group() and not driver._cap_busy(loop), "only the scoring queue holds it back"
        assert loop.score_block == [0.0, 0.0], "groups 0 and 1 started at once; group 2's hold is not over"
        release.set()
        await asyncio.wait_for(run, timeout=60)

    asyncio.run(go())
    queue = loop.runtime.queue
    assert loop.started == list(range(PROMPTS))
    assert queue.queued == list(range(PROMPTS)), "one FIFO worker scores and queues groups in prompt order"
    assert queue.samples_per_group == [G] * PROMPTS and queue.settled_without == []
    assert loop.unscored_groups == 0
    assert len(loop.score_block) == PROMPTS, "one value per group start"
    assert loop.score_block[2] > 0, "group 2's start was held while the queue was full"
    assert all(v >= 0 for v in loop.score_block)
    metrics = loop.window.drain()
    assert metrics["rollout/score_block_s"] == pytest.approx(sum(loop.score_block) / PROMPTS), "mean over starts"
    assert metrics["rollout/group_count"] == PROMPTS
    # group 1 found group 0 being scored and nothing waiting; it then waited for the worker: score_wait_s > 0
    assert metrics["rollout/score_wait_s"] > 0


def test_a_scorer_that_keeps_up_never_holds_generation_and_trains_the_same_groups():
    # 8 scoring workers for 6 groups: no finished group ever waits for one, so the queue (of 1) never fills
    loop = _loop(length_reward, max_concurrent_rollouts=8, score_queue_maxsize=1)
    assert loop.score_workers == 8
    asyncio.run(_produce(loop))
    queue = loop.runtime.queue
    assert loop.score_block == [0.0] * PROMPTS, "no group start was held"
    assert sorted(queue.queued) == list(range(PROMPTS)) and queue.settled_without == []
    assert queue.samples_per_group == [G] * PROMPTS
    metrics = loop.window.drain()
    assert metrics["rollout/score_block_s"] == 0.0 and metrics["rollout/score_queue_size"] == 0.0


def test_a_group_waiting_for_a_scorer_when_the_run_stops_stays_unsettled_and_is_counted_out():
    """A group in the scoring queue is in flight: cancelled there (the run stops), its prompt is neither queued
    nor consumed, so a resume generates it again, as one cancelled while generating."""
    release = asyncio.Event()

    async def blocked_reward(completions, **_):
        await release.wait()
        return length_reward(completions)

    loop = _loop(blocked_reward, max_concurrent_rollouts=1, score_queue_maxsize=1)

    async def go():
        run = asyncio.create_task(_produce(loop))
        await async_wait_until(
            lambda: _running(run, loop.unscored_groups == 1), "group 1 waiting for the scoring worker"
        )
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(go())
    queue = loop.runtime.queue
    assert loop.started == [0, 1]
    assert queue.queued == [] and queue.settled_without == [], "neither group is settled"
    assert loop.unscored_groups == 0
    assert loop.score_slots._value == 1, "the slot of the group being scored was given back"


def test_the_scoring_workers_follow_the_reward_functions():
    sync_pool = RolloutConfig(num_generations=G, reward_workers=3, max_concurrent_rollouts=64)

    async def async_reward(completions, **_):
        return [0.0] * len(completions)

    def runtime(funcs):
        allowance = TokenAllowance(1, 1 << 20)
        return LoopRuntime(
            tokenizer=None,
            server=None,
            model_name="m",
            max_model_len=256,
            dataset=[],
            queue=SampleQueue(allowance, with_topk=False),
            allowance=allowance,
            reward_functions=funcs,
        )

    for funcs, workers in (([length_reward], 3), ([async_reward], 64), ([async_reward, length_reward], 3)):
        loop = RolloutLoop(sync_pool, runtime(funcs))
        try:
            assert loop.score_workers == workers, funcs
        finally:
            loop.executor.shutdown(wait=False)
            loop.reward_pool.close()
    threads = RolloutConfig(num_generations=G, reward_workers=0, max_concurrent_rollouts=64)
    loop = RolloutLoop(threads, runtime([length_reward]))
    loop.executor.shutdown(wait=False)
    assert loop.score_workers == 64, "sync functions in the rollout's threads: one per rollout slot"
    with pytest.raises(ValueError, match="score_queue_maxsize"):
        RolloutConfig(score_queue_maxsize=0)


async def _running(run: asyncio.Task, value: bool) -> bool:
    """``value``, once more polled; a run that ended (failed) before the state came is reported at once."""
    if run.done():
        run.result()
        raise AssertionError("the run ended before the state waited for")
    return value
