"""Group advantages and rewards (issue 9, items 3 and 4): zero variance within a tolerance relative to the
reward scale, advantages of a kept group summing to 0, NaN rewards as "does not apply", ±inf as an error; issue 27
item 6: a non-numeric reward (a string, bytes, another object) refused naming the function."""

from __future__ import annotations

import asyncio
import math
import re
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.errors import RolloutError
from grpo_core.rollout.rewards import ZERO_STD_RTOL, call_reward_functions, group_advantages, is_zero_std
from grpo_core.rollout.scoring import score_group
from grpo_core.rollout.types import Rollout, RolloutGroup
from grpo_core.rollout.window import MetricWindow


def test_rewards_equal_up_to_rounding_are_a_zero_variance_group():
    # (0.1+0.2)+0.3 and 0.1+(0.2+0.3) differ by one ulp; before, the group was kept with advantages
    # [0, -1.15, -1.15, -1.15] (not even zero-mean).
    rewards = np.array([(0.1 + 0.2) + 0.3, 0.1 + (0.2 + 0.3), 0.1 + (0.2 + 0.3), 0.1 + (0.2 + 0.3)])
    assert rewards[0] != rewards[1]
    assert is_zero_std(rewards)
    assert np.all(group_advantages(rewards) == 0)


def _exact_advantages(scored: list[float]) -> list[float]:
    """(r - mean) / std with the mean and variance in exact rational arithmetic (an independent reference).

    A is unchanged when every reward is divided by the same number; dividing by the largest |r| keeps
    the variance's float conversion from underflowing for tiny rewards.
    """
    top = max(abs(Fraction(r)) for r in scored)
    exact = [Fraction(r) / top for r in scored]
    mean = sum(exact) / len(exact)
    std = math.sqrt(sum((r - mean) ** 2 for r in exact) / len(exact))
    return [float(r - mean) / std for r in exact]


reward = st.one_of(
    st.floats(min_value=-1e12, max_value=1e12, allow_nan=False, allow_subnormal=False),
    st.just(math.nan),
    st.sampled_from([0.0, 1.0, 0.2, -1.0]),
)
near_constant = st.tuples(
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    st.lists(st.floats(min_value=-1.0, max_value=1.0), min_size=2, max_size=16),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(reward, min_size=2, max_size=16))
def test_advantages_of_random_groups(values):
    rewards = np.array(values, dtype=np.float64)
    adv = group_advantages(rewards)
    ok = ~np.isnan(rewards)
    assert adv.dtype == np.float32 and adv.shape == rewards.shape
    assert np.all(adv[~ok] == 0), "an unscored rollout gets advantage 0"
    scored = rewards[ok]
    if is_zero_std(rewards):
        assert np.all(adv == 0)
        assert len(scored) < 2 or np.ptp(scored) <= ZERO_STD_RTOL * np.abs(scored).max()
        return
    kept = adv[ok].astype(np.float64)
    assert abs(kept.sum()) <= 1e-5 * len(kept), "the advantages of a kept group sum to 0"
    assert math.sqrt(np.mean(kept**2)) == pytest.approx(1.0, abs=1e-5), "unit population std"
    np.testing.assert_allclose(kept, _exact_advantages(scored.tolist()), rtol=1e-4, atol=1e-5)
    order = np.argsort(scored, kind="stable")
    assert np.all(np.diff(kept[order]) >= -1e-6), "a higher reward never gets a lower advantage"


@settings(max_examples=200, deadline=None)
@given(near_constant)
def test_groups_differing_only_by_noise_far_below_their_scale_are_dropped(case):
    base, noise = case
    if base == 0:
        base = 1.0
    rewards = np.array([base * (1 + 1e-9 * n) for n in noise])
    assert is_zero_std(rewards) and np.all(group_advantages(rewards) == 0)


def test_scale_does_not_change_advantages_or_the_zero_variance_decision():
    rewards = np.array([0.0, 1.0, 0.5, np.nan, 0.25])
    for scale in (1e-12, 1e-3, 1.0, 1e9, 1e200):
        np.testing.assert_allclose(group_advantages(rewards * scale), group_advantages(rewards), rtol=1e-6)
    assert not is_zero_std(np.array([1e-12, 2e-12]))  # tiny rewards are still a signal
    assert is_zero_std(np.array([0.0, 0.0, np.nan]))


def _reward_sources(*funcs, size=3):
    kwargs = {"prompts": [[]] * size, "completions": [[]] * size, "completion_ids": [[1]] * size}
    with ThreadPoolExecutor(2) as pool:
        return asyncio.run(call_reward_functions(list(funcs), kwargs, size, pool))


def inf_reward(completion_ids, **_):
    return [1.0, math.inf, 0.0][: len(completion_ids)]


def minus_inf_reward(completion_ids, **_):
    return [-math.inf, 1.0, 0.0][: len(completion_ids)]


def nan_reward(completion_ids, **_):
    return [math.nan, 1.0, 0.0][: len(completion_ids)]


@pytest.mark.parametrize("func, value", [(inf_reward, "inf at position 1"), (minus_inf_reward, "-inf at position 0")])
def test_infinite_reward_is_an_error_naming_the_function(func, value):
    with pytest.raises(
        RolloutError, match=f"reward function '{func.__name__}' returned {value}; rewards must be finite"
    ):
        _reward_sources(func)


def test_nan_reward_means_does_not_apply():
    (values,) = _reward_sources(nan_reward).values()
    assert math.isnan(values[0]) and list(values[1:]) == [1.0, 0.0]


@pytest.mark.parametrize("where", ["environment", "rollout"])
def test_infinite_environment_or_rollout_reward_is_an_error_naming_the_source(where):
    rollouts = [Rollout(completion=[], completion_ids=[1], turns=[]) for _ in range(2)]
    if where == "environment":
        rollouts[1].env_reward = ("CounterEnv", math.inf)
    else:
        rollouts[1].reward = -math.inf
    group = RolloutGroup(
        prompt_index=0,
        row_index=0,
        epoch=0,
        row={},
        prompts=[[], []],
        rollouts=rollouts,
        sequences=[[], []],
        policy_version=0,
    )
    source = "CounterEnv.get_reward()" if where == "environment" else "Rollout.reward"
    with ThreadPoolExecutor(1) as pool, pytest.raises(RolloutError, match=re.escape(source) + " returned -?inf"):
        asyncio.run(score_group(group, [], pool, MetricWindow()))


def _returning(value, name="graded"):
    """A reward function of a group of 3 that returns ``[1.0, value, 0.0]``, named ``name``."""

    def func(completion_ids, **_):
        return [1.0, value, 0.0]

    func.__name__ = name
    return func


@pytest.mark.parametrize(
    "value",
    ["0.5", "1", b"1", bytearray(b"1"), object(), 1 + 0j, [1.0], {"score": 1.0}, np.array([1.0]), np.str_("1")],
    ids=lambda value: "object()" if type(value) is object else repr(value),  # the same id in every xdist worker
)
def test_a_non_numeric_reward_is_refused_naming_the_function(value):
    # float() reads "0.5", b"1", bytearray(b"1") and np.array([1.0]) as numbers; none of them is one.
    with pytest.raises(
        RolloutError, match=r"reward function 'graded' returned .* at position 1; rewards must be numbers"
    ):
        _reward_sources(_returning(value))


def test_bytes_returned_for_the_whole_group_are_refused_naming_the_function():
    def byte_scores(completion_ids, **_):
        return b"\x01\x00\x01"  # a Sequence of 3 ints to Python, not a list of rewards

    with pytest.raises(RolloutError, match="reward function 'byte_scores' returned bytes; it must return a list"):
        _reward_sources(byte_scores)


@pytest.mark.parametrize(
    "value, expected",
    [
        (True, 1.0),
        (False, 0.0),
        (np.bool_(True), 1.0),
        (np.float32(0.25), 0.25),
        (np.int64(-2), -2.0),
        (Fraction(3, 4), 0.75),
        (Decimal("0.5"), 0.5),
        (np.array(0.125), 0.125),
        (torch.tensor(1.5), 1.5),
    ],
    ids=repr,
)
def test_numeric_rewards_of_every_kind_are_read_as_their_value(value, expected):
    (values,) = _reward_sources(_returning(value)).values()
    assert list(values) == [1.0, expected, 0.0]
