"""DAPO's soft overlong punishment (``rollout.overlong_buffer_len``, ``rollout.overlong_penalty_factor``; issue 27
item 2): with L_max the completion limit and L_cache the buffer, a completion of |y| tokens gains 0 when
|y| ≤ L_max − L_cache, ((L_max − L_cache) − |y|) / L_cache inside the buffer and −1 beyond L_max (Yu et al. 2025,
§3.4, eq. 13), times the factor, added to its summed reward. Expected values are worked out from the equation."""

from __future__ import annotations

import asyncio
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from grpo_core.config import RolloutConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.rollout.scoring import OverlongPenalty, score_group
from grpo_core.rollout.window import MetricWindow


def _eq13(length: int, max_len: int, buffer: int) -> float:
    """DAPO eq. 13, case by case."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return ((max_len - buffer) - length) / buffer
    return -1.0


def test_the_penalty_is_dapo_equation_13():
    # L_max = 20, L_cache = 5: free up to 15 tokens, then -1/5 per token down to -1 at 20, -1 beyond
    lengths = [0, 1, 15, 16, 17, 19, 20, 21, 64]
    want = [0.0, 0.0, 0.0, -0.2, -0.4, -0.8, -1.0, -1.0, -1.0]
    np.testing.assert_allclose(OverlongPenalty(20, 5).penalties(lengths), want, rtol=1e-15, atol=0)
    assert want == pytest.approx([_eq13(n, 20, 5) for n in lengths], abs=1e-15)
    np.testing.assert_allclose(OverlongPenalty(20, 5, 0.5).penalties(lengths), np.multiply(want, 0.5), rtol=1e-15)
    # the buffer as long as the limit: every token costs 1/L_max
    np.testing.assert_allclose(OverlongPenalty(4, 4).penalties([0, 1, 4, 5]), [0.0, -0.25, -1.0, -1.0], rtol=1e-15)


def parity(completions, **kwargs):
    return [1.0, 0.0, None, 0.5]


def test_score_group_adds_the_penalty_to_the_weighted_sum(monkeypatch):
    from grpo_core.rollout import scoring

    lengths = [3, 14, 16, 17]  # L_max 16, L_cache 4: free, inside (-0.5), at the limit (-1), beyond (-1)
    group = SimpleNamespace(
        rollouts=[SimpleNamespace(env_reward=None, reward=None, completion_ids=[7] * n) for n in lengths]
    )
    monkeypatch.setattr(scoring, "reward_kwargs", lambda group, window: {"completions": ["a", "b", "c", "d"]})
    with ThreadPoolExecutor(2) as threads:
        coro = score_group(
            group,  # type: ignore[arg-type]
            [parity],
            threads,
            MetricWindow(),
            weights={"parity": 2.0},
            overlong=OverlongPenalty(16, 4, 0.5),
        )
        asyncio.run(coro)
    want = [2.0 * 1.0 + 0.0, 2.0 * 0.0 + 0.5 * -0.5, math.nan, 2.0 * 0.5 + 0.5 * -1.0]
    np.testing.assert_allclose(group.rewards, want, rtol=1e-15)  # the unscored rollout stays unscored (NaN)
    np.testing.assert_allclose(group.source_rewards["parity"][[0, 1, 3]], [1.0, 0.0, 0.5], rtol=1e-15)  # as returned


def test_the_config_is_off_by_default_and_the_dapo_preset_turns_it_on(caplog):
    assert RolloutConfig().overlong_buffer_tokens() is None
    cfg = load_config(
        None, ["server.max_model_len=32768", "rollout.max_completion_length=20480", "rollout.overlong_buffer_len=4096"]
    )
    assert cfg.rollout.overlong_buffer_tokens() == 4096 and cfg.rollout.overlong_penalty_factor == 1.0
    dapo = load_config(None, ["algorithm=dapo", "server.max_model_len=32768", "rollout.max_completion_length=20480"])
    assert dapo.rollout.overlong_buffer_len == "auto" and dapo.rollout.overlong_penalty_factor == 1.0
    assert dapo.rollout.overlong_buffer_tokens() == 4096  # the paper's L_cache for its L_max = 20480
    mine = load_config(None, ["algorithm=dapo", "rollout.overlong_buffer_len=null"])
    assert mine.rollout.overlong_buffer_tokens() is None  # a field set beside the preset wins
    with pytest.raises(ConfigError, match=r"rollout.overlong_buffer_len=17 must lie in \[1, rollout.max_completion"):
        load_config(None, ["rollout.max_completion_length=16", "rollout.overlong_buffer_len=17"])
    with caplog.at_level(logging.WARNING, logger="grpo_core.config"):
        load_config(None, ["rollout.overlong_penalty_factor=0.5"])
    assert "rollout.overlong_penalty_factor has no effect without rollout.overlong_buffer_len" in caplog.text


def test_a_rollout_process_adds_the_penalty_to_the_logged_reward(tmp_path):
    """The rollout process as the flow starts it (embedded tiny server, completions of up to 8 tokens, a buffer of
    4, the one reward function weighted 3): ``reward`` is the mean of 3 x each recorded reward plus eq. 13 of its
    recorded completion length; ``rewards/recording_reward/mean`` the recorded values themselves, unweighted. The
    weights' half is also test_reward_weights' process test, which is in the slow tier for this one."""
    import json

    import rollout_helpers as h
    from serving_helpers import embedded_server
    from test_rollout_e2e import HELPERS_ENV, _config, drain, rollout, rows

    log = tmp_path / "rewards.jsonl"
    with embedded_server(tmp_path / "server", max_model_len=512) as server:
        config = _config(
            num_generations=4,
            **rows(3),
            reward_functions=["rollout_helpers:recording_reward"],
            reward_weights=[3.0],
            overlong_buffer_len=4,
        )
        with rollout(server, tmp_path, config, env={**HELPERS_ENV, h.REWARD_LOG_ENV: str(log)}) as source:
            _, _, metrics = drain(source)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 12
    recorded = [r["reward"] for r in records]
    assert len(set(recorded)) > 1 and abs(np.mean(recorded)) > 1e-6  # scored, spread: a weight of 3 shows
    penalties = [_eq13(len(r["completion_ids"]), 8, 4) for r in records]
    assert min(penalties) < 0  # some completions reached the buffer
    assert metrics["rewards/recording_reward/mean"] == pytest.approx(np.mean(recorded))  # logged unweighted
    # the penalty is added to the weighted sum, unweighted (DAPO's term is the completion's, not a function's)
    assert metrics["reward"] == pytest.approx(np.mean([3.0 * r + p for r, p in zip(recorded, penalties)]))
