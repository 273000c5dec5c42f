"""Pure parts of the rollout engine: rewards, advantages, reconciliation, pace, tools, data, config.

No server and no subprocess: each test runs in milliseconds.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import rollout_helpers as h

from grpo_core.config import RunConfig
from grpo_core.errors import ConfigError, RolloutError, TransportError, UserCodeError
from grpo_core.rollout import TurnRecord, reconcile_turns, start_rollout_process
from grpo_core.rollout.build import loop_class_and_config
from grpo_core.rollout.data import extract_answer, reasoning_gym_dataset, reasoning_gym_reward
from grpo_core.rollout.driver import poll_concurrency, prompt_stream
from grpo_core.rollout.pace import ConcurrencyCap, TokenAllowance
from grpo_core.rollout.rewards import call_reward_functions, group_advantages, is_zero_std, sum_rewards
from grpo_core.rollout.scoring import group_tokens
from grpo_core.rollout.tools import EnvironmentPool, environment_tools, parse_tool_calls, run_tool_calls
from grpo_core.rollout.window import MetricWindow
from grpo_core.serving.client import ServerMetrics


def _rewards(funcs, size=3, **kwargs):
    kwargs = {
        "prompts": [[]] * size,
        "completions": [[{"role": "assistant", "content": "x"}]] * size,
        "completion_ids": [[2, 4], [3], [5, 6, 7]][:size],
        **kwargs,
    }
    with ThreadPoolExecutor(2) as pool:
        return asyncio.run(call_reward_functions(funcs, kwargs, size, pool))


# ----- rewards and advantages -------------------------------------------------------------------


def test_sync_and_async_rewards_sum_and_none_is_skipped():
    sources = _rewards([h.length_reward, h.parity_reward, h.none_for_odd_rows], row_id=[1, 2, 3])
    assert list(sources) == ["length_reward", "parity_reward", "none_for_odd_rows"]
    total = sum_rewards(sources, 3)
    np.testing.assert_allclose(total, [2 + 1 + 0, 1 + 0 + 1, 3 + 0 + 0])
    only_none = sum_rewards({"a": np.full(2, np.nan)}, 2)
    assert np.isnan(only_none).all()


@pytest.mark.parametrize(
    "func, message, charged",
    [
        (h.raising_reward, "reward function 'raising_reward' raised RuntimeError: boom", True),
        (h.wrong_length_reward, "reward function 'wrong_length_reward' returned 4 rewards for a group of 3", False),
        (h.needs_answer_column, "reward function 'needs_answer_column' cannot take the arguments", False),
    ],
)
def test_bad_reward_function_fails_naming_it(func, message, charged):
    # A failure inside the call is charged to rollout.max_failed_groups (UserCodeError); a misconfigured
    # function (wrong return length, wrong signature) is a plain RolloutError that fails the run at once.
    with pytest.raises(RolloutError, match=message.replace("(", r"\(")) as info:
        _rewards([func])
    assert isinstance(info.value, UserCodeError) == charged


def test_hanging_reward_function_times_out_and_is_counted():
    kwargs = {"prompts": [[]] * 3, "completions": [[]] * 3, "completion_ids": [[1]] * 3, "row_id": [1] * 3}
    window = MetricWindow()
    pool = ThreadPoolExecutor(2)  # not waited for: the hung call keeps its thread until it returns
    with pytest.raises(UserCodeError, match=r"'flaky_reward' took longer than rollout.reward_timeout_s=0.2 s"):
        asyncio.run(call_reward_functions([h.flaky_reward], kwargs, 3, pool, timeout_s=0.2, window=window))
    pool.shutdown(wait=False)
    assert window.drain()["rewards/flaky_reward/timeout_count"] == 1


def test_partial_reward_is_named_after_its_function():
    sources = _rewards([functools.partial(h.length_reward)])
    assert list(sources) == ["length_reward"]


def test_advantages_match_independent_formula_and_nan_is_left_out():
    rng = np.random.default_rng(0)
    for _ in range(50):
        r = rng.normal(size=6)
        r[rng.random(6) < 0.3] = np.nan
        adv = group_advantages(r)
        ok = ~np.isnan(r)
        assert np.all(adv[~ok] == 0)
        if ok.sum() >= 2 and np.ptp(r[ok]) > 0:
            mean = sum(r[ok]) / ok.sum()
            std = math.sqrt(sum((x - mean) ** 2 for x in r[ok]) / ok.sum())
            np.testing.assert_allclose(adv[ok], (r[ok] - mean) / std, rtol=1e-5)
    assert is_zero_std(np.array([1.0, 1.0, np.nan])) and is_zero_std(np.array([1.0, np.nan, np.nan]))
    assert not is_zero_std(np.array([1.0, 0.0, np.nan]))
    assert np.all(group_advantages(np.array([2.0, 2.0])) == 0)


def test_nan_reward_counts_as_unscored():
    sources = _rewards([h.nan_first_reward])
    total = sum_rewards(sources, 3)
    assert np.isnan(total[0]) and total[1] == 1 and total[2] == 3
    assert group_advantages(total)[0] == 0


# ----- turn reconciliation ---------------------------------------------------------------------


def test_reconcile_extends_when_prefix_kept_and_forks_otherwise():
    t1 = TurnRecord([1, 2, 3], [10, 11], [-0.1, -0.2], output_sampler_logprobs=[{10: -0.1}, {11: -0.2}])
    t2 = TurnRecord([1, 2, 3, 10, 11, 7, 8], [12], [-0.3], output_sampler_logprobs=[{12: -0.3}])
    seqs, stats = reconcile_turns([t1, t2])
    assert len(seqs) == 1 and stats.forks == 0 and stats.drift_tokens == [0]
    assert seqs[0].input_ids == [1, 2, 3, 10, 11, 7, 8, 12]
    assert seqs[0].completion_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    np.testing.assert_allclose(seqs[0].sampler_logprobs, [0, 0, 0, -0.1, -0.2, 0, 0, -0.3])
    assert seqs[0].topk[3] == {10: -0.1} and seqs[0].topk[5] == {}
    # The template re-rendered turn 1's reply differently: turn 2 starts a new sample.
    t2_fork = TurnRecord([1, 2, 3, 10, 99, 7], [12, 13], [-0.3, -0.4])
    seqs, stats = reconcile_turns([t1, t2_fork])
    assert len(seqs) == 2 and stats.forks == 1 and stats.drift_tokens == [1]
    trained = [t for s in seqs for t, m in zip(s.input_ids, s.completion_mask) if m]
    assert trained == [10, 11, 12, 13], "every generated token is trained exactly once"


def test_group_tokens_are_raw_sample_tokens():
    assert group_tokens([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]]) == 12
    assert group_tokens([]) == 0


# ----- pace --------------------------------------------------------------------------------------


def test_token_allowance_one_group_until_first_completes_then_tokens():
    # (max_staleness + 1) steps of tokens: queued + in flight + held by the trainer (pulled, not yet trained)
    a = TokenAllowance(max_staleness=2, first_step_tokens=1000)
    assert a.may_start_group()
    a.group_started()
    assert not a.may_start_group(), "one group at a time until the first completes"
    a.group_finished(300, queued=True)
    assert a.limit == 3 * 1000 and a.may_start_group()  # 300 queued + 300 next <= 3000
    a.report(policy_version=1, tokens_consumed=250)
    assert a.limit == 3 * 250 and a.may_start_group()  # 300 queued + 300 next <= 750
    a.dequeued(300)  # the trainer pulls the group; another one queues
    a.group_started()
    a.group_finished(300, queued=True)
    assert not a.may_start_group(), "pulled tokens count until a report: 300 queued + 300 held + 300 next > 750"
    a.report(policy_version=2, tokens_consumed=250, held_tokens=100)
    assert a.held_tokens == 100 and a.may_start_group()  # 300 + 100 + 300 <= 750
    a.report(policy_version=3, tokens_consumed=0, held_tokens=10_000)
    assert a.policy_version == 3 and a.limit == 750 and not a.may_start_group()
    a.dequeued(300)
    assert a.may_start_group(), "nothing queued or in flight: one group may start whatever the trainer holds"
    assert TokenAllowance(max_staleness=0, first_step_tokens=10).limit == 10


class _FakeClient:
    """A one-replica set whose /metrics the test controls."""

    def __init__(self):
        self.snap: ServerMetrics | None = ServerMetrics(0.1, 0, 0, 0, 64 * 256)
        self.retry_count = 0

    async def metrics(self):
        return [self.snap]


class _FakeLoop:
    def __init__(self, ceiling):
        self.cap = ConcurrencyCap(ceiling)
        self.window = MetricWindow()
        self.runtime = type("R", (), {"server": _FakeClient(), "max_model_len": 256})()


def test_concurrency_cap_falls_on_high_kv_usage_and_rises_when_idle():
    async def go():
        loop = _FakeLoop(ceiling=100)
        client = loop.runtime.server
        await poll_concurrency(loop, first=True)
        assert loop.cap.cap == 64, "starts at KV tokens / max_model_len"
        client.snap = ServerMetrics(0.95, 64, 3, 0, 64 * 256)
        await poll_concurrency(loop)
        assert loop.cap.cap == 44  # floor(64 * 0.7)
        client.snap = ServerMetrics(0.2, 5, 0, 0, 64 * 256)
        await poll_concurrency(loop)
        assert loop.cap.cap == 44, "no raise before a cap's worth of rollouts finished"
        for _ in range(44):
            await loop.cap.acquire()
            await loop.cap.release()
        await poll_concurrency(loop)
        assert loop.cap.cap == 55  # ceil(44 * 1.25)
        client.snap = ServerMetrics(0.2, 5, 2, 0, 64 * 256)
        for _ in range(60):
            await loop.cap.acquire()
            await loop.cap.release()
        await poll_concurrency(loop)
        assert loop.cap.cap == 55, "requests waiting: no raise"
        for _ in range(5):
            client.snap = ServerMetrics(0.1, 0, 0, 0, 64 * 256)
            for _ in range(loop.cap.cap):
                await loop.cap.acquire()
                await loop.cap.release()
            await poll_concurrency(loop)
        assert loop.cap.cap == 100, "never above max_concurrent_rollouts"
        client.snap = None
        loop.cap.cap = 10
        await poll_concurrency(loop)
        assert loop.cap.cap == 100, "no /metrics: the ceiling"
        metrics = loop.window.drain()
        assert metrics["rollout/concurrency_cap"] > 0 and "rollout/vllm_kv_cache_usage_frac" in metrics

    asyncio.run(go())


def test_concurrency_cap_blocks_acquire_above_cap():
    async def go():
        cap = ConcurrencyCap(4)
        await cap.set_cap(2)
        await cap.acquire()
        await cap.acquire()
        waiter = asyncio.create_task(cap.acquire())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await cap.release()
        await asyncio.wait_for(waiter, 1)

    asyncio.run(go())


# ----- data and resume ---------------------------------------------------------------------------


def test_prompt_stream_epochs_positions_and_resume_start():
    rows = h.rows(3)
    got = [(e, r, p) for e, r, p, _ in prompt_stream(rows, num_epochs=2)]
    assert got == [(0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 0, 3), (1, 1, 4), (1, 2, 5)]
    assert [p for _, _, p, _ in prompt_stream(rows, num_epochs=2, start=4)] == [4, 5]
    import datasets

    iterable = datasets.Dataset.from_list(rows).to_iterable_dataset()
    assert [p for _, _, p, _ in prompt_stream(iterable, num_epochs=2, start=2)] == [2, 3, 4, 5]
    with pytest.raises(RolloutError, match="no rows"):
        list(prompt_stream([], num_epochs=1))


def test_reasoning_gym_adapter_scores_answers():
    ds = reasoning_gym_dataset("basic_arithmetic", size=3, seed=1)
    row = ds[0]
    assert row["prompt"][-1]["role"] == "user" and row["rg_task"] == "basic_arithmetic"
    right = [{"role": "assistant", "content": f"so <answer>{row['answer']}</answer>"}]
    wrong = [{"role": "assistant", "content": "<answer>abc</answer>"}]
    scores = reasoning_gym_reward([right, wrong], rg_task=[row["rg_task"]] * 2, rg_entry=[row["rg_entry"]] * 2)
    assert scores == [1.0, 0.0]
    assert reasoning_gym_reward([right]) == [None]
    assert extract_answer("a\n 42 \n") == "42"


# ----- tools and environments ----------------------------------------------------------------------


def test_parse_tool_calls():
    text = (
        'I will call. <tool_call>\n{"name": "increment", "arguments": {"step": 2}}\n</tool_call>'
        '<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>not json</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("increment", {"step": 2}), ("x", {"a": 1})]
    assert calls[2].error and parse_tool_calls("no calls") == []


def test_unknown_and_raising_tools_become_tool_errors_and_are_counted():
    env = h.CounterEnv()
    env.reset(target=3)

    def broken(x: int) -> int:
        """Always fails.

        Args:
            x: anything.
        """
        raise ValueError("nope")

    tools = {t.__name__: t for t in [*environment_tools(env), broken]}
    window = MetricWindow()
    calls = parse_tool_calls(
        '<tool_call>{"name": "increment", "arguments": {"step": 2}}</tool_call>'
        '<tool_call>{"name": "fly", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
    )
    with ThreadPoolExecutor(1) as pool:
        messages, failures = asyncio.run(run_tool_calls(calls, tools, pool, window))
    assert env.counter == 2 and failures == 2
    assert messages[0]["content"] == "2" and "unknown tool 'fly'" in messages[1]["content"]
    assert "ValueError: nope" in messages[2]["content"]
    m = window.drain()
    assert m["tools/unknown_name_count"] == 1 and m["tools/broken/failure_count"] == 1
    assert m["tools/increment/call_count"] == 1 and "tools/latency_s" in m


def test_hanging_tool_becomes_a_tool_error_after_its_timeout():
    def sleepy(seconds: float) -> str:
        """Sleeps.

        Args:
            seconds: how long.
        """
        import time

        time.sleep(seconds)
        return "done"

    window = MetricWindow()
    # A timeout of 2 s, not less: the quick call (sleep 0) must come back within it from a thread of the pool on a
    # loaded box, where a thread can wait hundreds of ms for a core; the hung one sleeps well past it.
    calls = parse_tool_calls(
        '<tool_call>{"name": "sleepy", "arguments": {"seconds": 8}}</tool_call>'
        '<tool_call>{"name": "sleepy", "arguments": {"seconds": 0}}</tool_call>'
    )
    pool = ThreadPoolExecutor(2)  # not waited for: the hung call keeps its thread until it returns
    messages, failures = asyncio.run(run_tool_calls(calls, {"sleepy": sleepy}, pool, window, timeout_s=2.0))
    pool.shutdown(wait=False)
    assert failures == 1 and "took longer than 2 s" in messages[0]["content"] and messages[1]["content"] == "done"
    m = window.drain()
    assert m["tools/sleepy/timeout_count"] == 1 and m["tools/sleepy/failure_count"] == 1


def test_environment_routing_exposes_only_its_tools():
    pool = EnvironmentPool({"counter": h.CounterEnv, "game": h.GameEnv})
    counter, game = pool.take(pool.route({"environment": "counter"})), pool.take(pool.route({"environment": "game"}))
    assert [t.__name__ for t in environment_tools(counter)] == ["increment"]
    assert [t.__name__ for t in environment_tools(game)] == ["move"]
    pool.give_back("counter", counter)
    assert pool.take("counter") is counter, "instances are reused"
    with pytest.raises(KeyError, match="environment='chess'"):
        pool.route({"environment": "chess"})


# ----- config, pickling -------------------------------------------------------------------------


def test_loop_class_and_its_config_subclass_from_config():
    cfg = RunConfig(rollout={"loop_class": "rollout_helpers:CurriculumLoop", "loop_options": {"pass_rate_cap": 0.7}})
    cls, config = loop_class_and_config(cfg.rollout)
    assert cls is h.CurriculumLoop and config.pass_rate_cap == 0.7
    bad = RunConfig(rollout={"loop_class": "rollout_helpers:CurriculumLoop", "loop_options": {"pass_rate": 0.7}})
    with pytest.raises(ConfigError, match="loop_options"):
        loop_class_and_config(bad.rollout)
    with pytest.raises(ConfigError, match="not a RolloutLoop"):
        loop_class_and_config(RunConfig(rollout={"loop_class": "rollout_helpers:CounterEnv"}).rollout)


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match="num_generations"):
        RunConfig(rollout={"num_generations": 1})
    with pytest.raises(ValueError, match="module:attribute"):
        RunConfig(rollout={"reward_functions": ["accuracy"]})


def test_the_rollout_process_gets_only_its_sub_config_from_the_owners():
    cfg = RunConfig(
        model={"name": "tiny-qwen3"},
        server={"max_model_len": 4608, "served_model_name": "served"},
        train={"lora": {"enabled": True, "name": "pol"}},
        tracking={"log_completions": True, "num_completions_to_print": 3},
    )
    sub = cfg.rollout_process()
    assert (sub.served_model_name, sub.max_model_len, sub.adapter_name) == ("served", 4608, "pol")
    assert (sub.log_completions, sub.num_completions_to_print) == (True, 3) and sub.rollout == cfg.rollout
    plain = RunConfig(model={"name": "tiny-qwen3"}).rollout_process()
    assert plain.adapter_name is None and plain.served_model_name == "tiny-qwen3" and not plain.log_completions
    # the server section is its own (it routes requests over the replicas); nothing of the trainer's
    assert sub.server == cfg.server
    assert not {"train", "tracking", "packing", "export", "flow"} & set(type(sub).model_fields)


def test_rollout_process_that_fails_before_serving_names_the_cause(tmp_path):
    # The flow's start path: the process exits on the bad loop class before it serves; the error carries its log.
    helpers = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[2] / "support"), os.environ.get("PYTHONPATH")])
    )
    cfg = RunConfig(rollout={"loop_class": "rollout_helpers:CounterEnv"})
    started = start_rollout_process(cfg, ["http://127.0.0.1:9"], tmp_path, env={"PYTHONPATH": helpers})
    with pytest.raises(TransportError, match="exited with code 1 before serving") as err:
        started.wait_location(timeout_s=300)
    assert "rollout.loop_class='rollout_helpers:CounterEnv' is not a RolloutLoop subclass" in str(err.value)
    assert started.process.poll() == 1 and not started.location_path.exists()
    with pytest.raises(ConfigError, match="at least one generation server URL"):
        start_rollout_process(cfg, [], tmp_path)


def test_candidate_sets_and_topk_reach_the_sample_arrow_encoding():
    from grpo_core.packing import samples_from_arrow, samples_to_arrow
    from grpo_core.rollout.scoring import group_samples
    from grpo_core.rollout.types import Rollout, RolloutGroup

    turn = TurnRecord(
        [1, 2],
        [5, 6],
        [-0.5, -0.25],
        output_sampling_mask=[[5, 7], [6]],
        output_sampler_logprobs=[{5: -0.5, 7: -1.0}, {6: -0.25}],
    )
    seqs, _ = reconcile_turns([turn])
    rollout = Rollout(completion=[], completion_ids=[5, 6], turns=[turn])
    group = RolloutGroup(
        prompt_index=7,
        row_index=7,
        epoch=0,
        row={},
        prompts=[[]],
        rollouts=[rollout],
        sequences=[seqs],
        policy_version=2,
        rewards=np.array([1.0]),
    )
    (sample,) = samples_from_arrow(samples_to_arrow(group_samples(group, np.array([0.5]), with_topk=True)))
    assert sample.group_id == sample.prompt_index == 7 and sample.policy_version == 2 and sample.advantage == 0.5
    ids, _ = sample.sampling_mask.entry(2)
    assert ids.tolist() == [5, 7] and sample.sampling_mask.entry(0)[0].tolist() == []
    top_ids, top_lp = sample.sampler_topk.entry(3)
    assert top_ids.tolist() == [6] and top_lp.tolist() == [-0.25]


def test_lora_runs_sample_the_adapter_of_the_group_version():
    from grpo_core.rollout import LoopRuntime, RolloutLoop

    runtime = LoopRuntime(
        tokenizer=None,
        server=None,
        model_name="base",
        max_model_len=64,
        dataset=[],
        queue=None,
        allowance=TokenAllowance(1, 10),
        lora_name="policy",
    )
    loop = RolloutLoop(RunConfig().rollout, runtime)
    assert loop.served_model(0) == "base" and loop.served_model(3) == "policy-v3"
    loop.executor.shutdown()


def test_completion_table_rows_lead_with_prompt_completion_reward_and_advantage():
    from grpo_core.rollout.scoring import completion_rows
    from grpo_core.rollout.types import Rollout, RolloutGroup

    turn = TurnRecord([1, 2], [5, 6], [-0.5, -0.25])
    rollouts = [
        Rollout(completion=[{"role": "assistant", "content": f"c{i}"}], completion_ids=[5, 6], turns=[turn])
        for i in range(2)
    ]
    group = RolloutGroup(
        prompt_index=3,
        row_index=3,
        epoch=0,
        row={},
        prompts=[[{"role": "user", "content": "p"}]] * 2,
        rollouts=rollouts,
        sequences=[[], []],
        policy_version=1,
        rewards=np.array([1.0, 0.0]),
    )
    group.source_rewards = {"acc": np.array([1.0, 0.0])}
    rows = completion_rows(group, np.array([0.5, -0.5]))
    # The MLflow UI shows a logged table's columns in this order and cuts off the right-hand ones.
    assert [list(r)[:5] for r in rows] == [["prompt", "completion", "reward", "advantage", "reward/acc"]] * 2
    assert [(r["prompt"], r["completion"], r["reward"], r["advantage"]) for r in rows] == [
        ("p", "c0", 1.0, 0.5),
        ("p", "c1", 0.0, -0.5),
    ]
    assert rows[0]["prompt_index"] == 3 and rows[0]["policy_version"] == 1 and rows[0]["completion_tokens"] == 2


def test_a_json_lines_dataset_path_expands_home_and_variables(tmp_path, monkeypatch):
    from grpo_core.rollout.data import _json_lines_files

    (tmp_path / "d.jsonl").write_text('{"prompt": "x"}\n')
    monkeypatch.setenv("GRPO_TEST_DATA", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _json_lines_files("$GRPO_TEST_DATA/d.jsonl") == [tmp_path / "d.jsonl"]
    assert _json_lines_files("~/d.jsonl") == [tmp_path / "d.jsonl"]
