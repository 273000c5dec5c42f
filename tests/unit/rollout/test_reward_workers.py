"""Sync reward functions run in the main thread of worker processes (``rollout.reward_workers``): signal-based
timeouts work, a hung call is killed at ``rollout.reward_timeout_s`` and fails only its group, what cannot be
pickled is refused naming the function; ``trainer_state`` carries TRL's TrainerState fields.

The groups go through the real ``RolloutLoop.run_group`` (scoring, failed-group accounting); only sampling is
scripted (:class:`ScriptedLoop`), so no server is needed.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import threading
import time

import numpy as np
import pytest

from grpo_core.config import RolloutConfig
from grpo_core.errors import RolloutError
from grpo_core.rollout.loop import LoopRuntime, RolloutLoop
from grpo_core.rollout.pace import TokenAllowance
from grpo_core.rollout.queue import SampleQueue
from grpo_core.rollout.reward_pool import pickling_error
from grpo_core.rollout.types import Rollout, TurnRecord

G = 3


class ScriptedLoop(RolloutLoop):
    """Rollout i of a group answers ``"x" * (i + 1)`` (no server); records each scored group's rewards."""

    def __init__(self, config, runtime):
        super().__init__(config, runtime)
        self.counter = 0
        self.scored: list[np.ndarray] = []

    async def generate_one(self, prompt, tools, group_id=0):
        self.counter += 1
        text = "x" * ((self.counter - 1) % G + 1)
        ids = list(range(10, 10 + len(text)))
        turn = TurnRecord(prompt_ids=[1, 2], output_ids=ids, output_log_probs=[-0.5] * len(ids), text=text)
        return Rollout(completion=[{"role": "assistant", "content": text}], completion_ids=ids, turns=[turn])

    def compute_advantages(self, group):
        self.scored.append(group.rewards.copy())
        return super().compute_advantages(group)


def _loop(funcs, max_steps=None, trainer_step=0, **rollout) -> ScriptedLoop:
    cfg = RolloutConfig(num_generations=G, num_sampler_logprobs=0, max_failed_groups=5, shuffle=False, **rollout)
    allowance = TokenAllowance(cfg.max_staleness, 1 << 20)
    allowance.trainer_step = trainer_step
    runtime = LoopRuntime(
        tokenizer=None,
        server=None,
        model_name="m",
        max_model_len=256,
        dataset=[],
        queue=SampleQueue(allowance, with_topk=False),
        allowance=allowance,
        reward_functions=funcs,
        max_steps=max_steps,
    )
    return ScriptedLoop(cfg, runtime)


def _run(loop: ScriptedLoop, rows: list[dict]) -> dict[str, float]:
    async def go():
        try:
            for i, row in enumerate(rows):
                await loop.run_group(i, i, 0, row)
        finally:
            loop.executor.shutdown(wait=False)
            if getattr(loop, "reward_pool", None) is not None:
                loop.reward_pool.close()

    asyncio.run(go())
    return loop.window.drain()


# ----- reward functions (top level: sent to the workers by reference) --------------------------------------------


def alarm_reward(completions, **_):
    """Length of the answer, computed under a ``signal.alarm`` guard as math verifiers do."""

    def on_alarm(signum, frame):
        raise TimeoutError("verification took too long")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(30)
    try:
        return [float(len(c[-1]["content"])) for c in completions]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def hangs_on_flag(completions, hang, pid_file, **_):
    """Hangs in a C call (``time.sleep``) when the row says so, after writing its process id; else scores 1."""
    if hang[0]:
        with open(pid_file[0], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
    return [1.0 + i for i in range(len(completions))]


def state_reward(completions, trainer_state, log_metric, **_):
    """Reports what it sees of ``trainer_state`` through ``log_metric``."""
    log_metric("seen/global_step", trainer_state.global_step)
    log_metric("seen/step", trainer_state.step)
    log_metric("seen/max_steps", trainer_state.max_steps)
    log_metric("seen/epoch", trainer_state.epoch)
    epochs = trainer_state.num_train_epochs
    log_metric("seen/num_train_epochs", -1 if epochs is None else epochs)
    log_metric("seen/policy_version", trainer_state.policy_version)
    log_metric("seen/main_thread", float(threading.current_thread() is threading.main_thread()))
    log_metric("seen/pid", os.getpid())
    return [float(i) for i in range(len(completions))]


def plain_reward(completions, **_):
    return [float(i) for i in range(len(completions))]


# ----- tests --------------------------------------------------------------------------------------------------


def test_a_reward_using_signal_alarm_scores_in_a_worker_process():
    # On the code before reward workers: every group failed with "signal only works in main thread".
    loop = _loop([alarm_reward])  # the default rollout.reward_workers
    assert loop.config.reward_workers >= 1
    metrics = _run(loop, [{"prompt": "", "k": 0}, {"prompt": "", "k": 1}])
    assert "rollout/failed_group_count" not in metrics
    # Rollout i answers i + 1 characters: the rewards are the answers' lengths.
    assert [r.tolist() for r in loop.scored] == [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]


def test_with_reward_workers_0_the_thread_path_still_refuses_signals():
    # The set-up the workers exist for: in a thread the same function fails its group.
    loop = _loop([alarm_reward], reward_workers=0)
    metrics = _run(loop, [{"prompt": ""}])
    assert metrics["rollout/failed_group_count"] == 1 and loop.scored == []


def test_a_hung_reward_is_killed_at_its_timeout_and_only_its_group_fails(tmp_path):
    pid_file = str(tmp_path / "pid")
    # 5 s: the groups that do not hang must score within it (a round trip to the worker process, which a loaded box
    # can hold up for a second); the hung one sleeps 120 s
    loop = _loop([hangs_on_flag], reward_timeout_s=5.0, reward_workers=1)
    rows = [{"prompt": "", "hang": flag, "pid_file": pid_file} for flag in (False, True, False)]
    metrics = _run(loop, rows)
    assert metrics["rollout/failed_group_count"] == 1
    assert metrics["rewards/hangs_on_flag/timeout_count"] == 1
    assert loop.failed_groups == 1
    # The groups before and after scored (the one worker was replaced after the kill).
    assert [r.tolist() for r in loop.scored] == [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    with open(pid_file) as f:
        pid = int(f.read())
    assert pid != os.getpid()
    with pytest.raises(ProcessLookupError):  # the hung worker was killed (and reaped), not left sleeping
        os.kill(pid, 0)


def test_trainer_state_carries_trl_fields_into_the_worker():
    loop = _loop([state_reward], max_steps=50, trainer_step=7, num_epochs=3)
    loop.runtime.allowance.policy_version = 4
    metrics = _run(loop, [{"prompt": ""}])
    assert "rollout/failed_group_count" not in metrics
    assert metrics["seen/global_step"] == 7 and metrics["seen/step"] == 7
    assert metrics["seen/max_steps"] == 50 and metrics["seen/num_train_epochs"] == 3
    assert metrics["seen/epoch"] == 0 and metrics["seen/policy_version"] == 4
    assert metrics["seen/main_thread"] == 1.0 and metrics["seen/pid"] != os.getpid()


def test_cycling_prompts_have_no_num_train_epochs():
    loop = _loop([state_reward], max_steps=10, num_epochs=None, reward_workers=0)  # the thread path too
    metrics = _run(loop, [{"prompt": ""}])
    assert metrics["seen/num_train_epochs"] == -1 and metrics["seen/max_steps"] == 10
    assert metrics["seen/main_thread"] == 0.0 and metrics["seen/pid"] == os.getpid()


def test_an_unpicklable_reward_function_is_refused_naming_it():
    def local_reward(completions, **_):
        return [0.0] * len(completions)

    loop = _loop([local_reward])
    with pytest.raises(
        RolloutError,
        match=r"reward function 'local_reward' cannot be sent.*the function cannot be pickled.*top-level function",
    ):
        _run(loop, [{"prompt": ""}])


def test_an_unpicklable_argument_is_refused_naming_it_and_the_function():
    loop = _loop([plain_reward])
    with pytest.raises(RolloutError, match=r"reward function 'plain_reward'.*its argument 'handle' cannot be pickled"):
        _run(loop, [{"prompt": "", "handle": threading.Lock()}])


def test_async_reward_functions_stay_in_the_event_loop():
    seen = []

    async def async_reward(completions, **_):  # a local function: never pickled, awaited as before
        seen.append(threading.current_thread() is threading.main_thread())
        return [float(i) for i in range(len(completions))]

    loop = _loop([async_reward])
    metrics = _run(loop, [{"prompt": ""}])
    assert "rollout/failed_group_count" not in metrics and seen == [True]
    assert [r.tolist() for r in loop.scored] == [[0.0, 1.0, 2.0]]


def test_pickling_error_is_none_for_a_top_level_function_and_names_a_lambda():
    """The one pickling check that preflight and the pool share: a module-level function pickles by reference (None);
    a lambda cannot (pickle looks it up by its name '<lambda>'), and the error names it, the cause and the fix."""
    assert pickle.loads(pickle.dumps(plain_reward)) is plain_reward  # the set-up: it really pickles
    assert pickling_error("reward function 'plain_reward'", plain_reward) is None
    error = pickling_error("rollout.reward_functions: m:f", lambda completions, **_: [0.0])
    assert error is not None and error.startswith("rollout.reward_functions: m:f cannot be pickled ("), error
    assert "top-level function of an importable module" in error, error
