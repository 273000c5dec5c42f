"""A sync reward function or tool past its time limit stops consuming the run (grpo_core.rollout.usercode)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_core.errors import UserCodeTimeout
from grpo_core.rollout.rewards import call_reward_functions
from grpo_core.rollout.usercode import call_user, running_after_timeout
from grpo_core.rollout.window import MetricWindow


def test_a_reward_function_looping_past_its_timeout_is_stopped_and_counted():
    left, stop, spins = threading.Event(), threading.Event(), []

    def spinning_reward(completions, **_):
        try:
            while not stop.is_set():  # Python code that does not return: before, it spun for the rest of the run
                spins.append(1)
                del spins[:-1]
        finally:
            left.set()

    window = MetricWindow()
    executor = ThreadPoolExecutor(1)
    try:
        with pytest.raises(UserCodeTimeout, match="spinning_reward.*reward_timeout_s=0.2"):
            asyncio.run(
                call_reward_functions(
                    [spinning_reward], {"completions": [[]] * 2}, 2, executor, timeout_s=0.2, window=window
                )
            )
        assert left.wait(60), "the timed-out call still runs in its thread"
        # The worker thread is free again and runs the next call normally.
        assert asyncio.run(call_user(lambda x: x + 1, {"x": 1}, executor, timeout_s=60)) == 2
    finally:
        stop.set()  # ends the loop in any case (the test before the fix), so the process can exit
        executor.shutdown()
    assert window.drain()["rewards/spinning_reward/timeout_count"] == 1
    assert running_after_timeout(executor) == 0


def test_a_call_blocked_in_c_is_counted_until_it_returns_and_the_worker_is_not_poisoned():
    release, returned = threading.Event(), threading.Event()

    def blocked_tool():
        try:
            release.wait()  # a C-level wait: the interrupt is raised only once it returns
            return "late"
        finally:
            returned.set()

    # Counted per executor: calls other tests of this process left blocked (their own executors) do not count here.
    with ThreadPoolExecutor(1) as executor:
        try:
            with pytest.raises(TimeoutError):
                asyncio.run(call_user(blocked_tool, {}, executor, timeout_s=0.2))
            assert running_after_timeout(executor) == 1
            assert running_after_timeout() >= 1  # and in the process's total (the rollout's metric)
        finally:
            release.set()  # in any case: the executor's exit waits for its thread (a failed check hung the session)
        assert returned.wait(60)
        # The interrupt lands in the call it was meant for, never in the next one on that thread.
        results = asyncio.run(_many(executor))
        assert results == list(range(20))
        deadline = time.monotonic() + 60
        while running_after_timeout(executor) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running_after_timeout(executor) == 0


def test_a_blocked_call_counts_for_its_own_executor_only():
    release = threading.Event()
    mine, other = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    try:
        with pytest.raises(TimeoutError):
            asyncio.run(call_user(release.wait, {}, mine, timeout_s=0.2))
        assert (running_after_timeout(mine), running_after_timeout(other)) == (1, 0)
        assert asyncio.run(call_user(lambda: "free", {}, other, timeout_s=60)) == "free"
    finally:
        release.set()
        mine.shutdown()
        other.shutdown()
    assert running_after_timeout(mine) == 0


async def _many(executor):
    return await asyncio.gather(*(call_user(lambda i=i: i, {}, executor, 60) for i in range(20)))
