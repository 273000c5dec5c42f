"""Reward weights (``rollout.reward_weights``, issue 27 item 2): a rollout's reward is Σ_i w_i·r_i over the reward
functions that scored it (TRL's ``reward_weights``), other sources (an environment's ``get_reward``,
``Rollout.reward``) weighing 1; each function is still logged with its own, unweighted values."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from grpo_core.config import RolloutConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.rollout.rewards import sum_rewards
from grpo_core.rollout.scoring import score_group
from grpo_core.rollout.window import MetricWindow

NAN = float("nan")


def _reference(sources: dict[str, list[float]], weights: dict[str, float]) -> list[float]:
    """float64: per rollout Σ w·r over the sources that scored it (NaN = did not apply), NaN when none did."""
    size = len(next(iter(sources.values())))
    out = []
    for i in range(size):
        scored = [(weights.get(name, 1.0), values[i]) for name, values in sources.items() if not math.isnan(values[i])]
        out.append(math.fsum(w * r for w, r in scored) if scored else NAN)
    return out


def test_the_weighted_sum_over_the_scoring_sources():
    sources = {"accuracy": [1.0, 0.0, NAN, 1.0], "format": [0.5, 1.0, NAN, NAN], "MyEnv": [NAN, 2.0, NAN, 0.25]}
    weights = {"accuracy": 2.0, "format": -0.5}
    got = sum_rewards({k: np.array(v) for k, v in sources.items()}, 4, weights)
    want = _reference(sources, weights)
    np.testing.assert_allclose(got[[0, 1, 3]], np.array(want)[[0, 1, 3]], rtol=1e-15)
    assert math.isnan(got[2]) and math.isnan(want[2])
    assert got[0] == pytest.approx(2.0 * 1.0 - 0.5 * 0.5) and got[1] == pytest.approx(-0.5 + 2.0)  # weights applied
    unweighted = sum_rewards({k: np.array(v) for k, v in sources.items()}, 4)
    np.testing.assert_allclose(unweighted[[0, 1, 3]], np.array(_reference(sources, {}))[[0, 1, 3]], rtol=1e-15)


def accuracy(completions, **kwargs):
    return [1.0, 0.0, 1.0]


def brevity(completions, **kwargs):
    return [0.2, 0.4, None]


def test_score_group_weighs_the_sum_and_keeps_each_function_unweighted(monkeypatch):
    from types import SimpleNamespace

    from grpo_core.rollout import scoring

    group = SimpleNamespace(rollouts=[SimpleNamespace(env_reward=None, reward=None) for _ in range(3)])
    monkeypatch.setattr(scoring, "reward_kwargs", lambda group, window: {"completions": ["a", "b", "c"]})
    with ThreadPoolExecutor(2) as threads:
        coro = score_group(
            group,  # type: ignore[arg-type]
            [accuracy, brevity],
            threads,
            MetricWindow(),
            weights={"accuracy": 1.0, "brevity": 3.0},
        )
        asyncio.run(coro)
    np.testing.assert_allclose(group.rewards, [1.0 + 0.6, 0.0 + 1.2, 1.0], rtol=1e-15)
    np.testing.assert_allclose(group.source_rewards["brevity"][:2], [0.2, 0.4], rtol=1e-15)  # logged as returned


def test_the_config_takes_one_weight_per_function():
    assert RolloutConfig().reward_weights is None
    cfg = load_config(None, ["rollout.reward_functions=[a:f, b:g]", "rollout.reward_weights=[1.0, 0.5]"])
    assert cfg.rollout.reward_weights == [1.0, 0.5]
    assert cfg.rollout.reward_weight_by_name(["f", "g"]) == {"f": 1.0, "g": 0.5}
    with pytest.raises(ConfigError, match=r"rollout.reward_weights has 1 weight.*2 rollout.reward_functions"):
        load_config(None, ["rollout.reward_functions=[a:f, b:g]", "rollout.reward_weights=[1.0]"])


def test_a_resume_with_other_weights_is_applied_and_logged(tmp_path):
    from grpo_core.config import RunConfig
    from grpo_core.train.fingerprint import FINGERPRINT_FILE, check_resume, fingerprint_text

    rollout = {"reward_functions": ["grpo_core.demo_rewards:even_token_reward"]}
    folder = tmp_path / "step-0000002"
    folder.mkdir()
    (folder / FINGERPRINT_FILE).write_text(fingerprint_text(RunConfig(rollout=rollout).trainer_process()))
    weighted = RunConfig(rollout={**rollout, "reward_weights": [2.0]}).trainer_process()
    assert check_resume(weighted, folder) == ["rollout.reward_weights: None -> [2.0]"]


# Slow tier (an embedded server and a rollout process, ~18 s on the loaded CI box): the default tier's
# test_overlong_penalty.py::test_a_rollout_process_adds_the_penalty_to_the_logged_reward runs the same process with
# reward_weights [3.0] and checks both the weighted reward and the unweighted per-function mean.
@pytest.mark.slow
def test_a_rollout_process_sums_the_weighted_rewards_and_logs_each_function_as_returned(tmp_path):
    """The rollout process as the flow starts it (embedded tiny server): ``reward`` is 3 × the one function's
    recorded values, ``rewards/recording_reward/mean`` the values themselves."""
    import json

    import rollout_helpers as h
    from serving_helpers import embedded_server
    from test_rollout_e2e import HELPERS_ENV, _config, drain, rollout, rows

    log = tmp_path / "rewards.jsonl"
    with embedded_server(tmp_path / "server", max_model_len=512) as server:
        config = _config(
            num_generations=4, **rows(3), reward_functions=["rollout_helpers:recording_reward"], reward_weights=[3.0]
        )
        with rollout(server, tmp_path, config, env={**HELPERS_ENV, h.REWARD_LOG_ENV: str(log)}) as source:
            _, _, metrics = drain(source)
    recorded = [json.loads(line)["reward"] for line in log.read_text().splitlines()]
    assert len(recorded) == 12 and len(set(recorded)) > 1 and abs(np.mean(recorded)) > 1e-6  # scored, spread
    assert metrics["rewards/recording_reward/mean"] == pytest.approx(np.mean(recorded))
    assert metrics["reward"] == pytest.approx(3.0 * np.mean(recorded))
