"""Held-out evaluation during training (issue 27, item 3): the pass@k estimator against the closed form and brute
force, the step tagging that carries an evaluation to the step it evaluated, the trainer's end wait, and a `grpo
train` end to end on the embedded CPU server where evaluations run at steps N and at the end."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from math import comb
from pathlib import Path

import numpy as np
import pytest
from flow_helpers import grpo_train_command

from grpo_core.config import RunConfig
from grpo_core.rollout.evaluate import EvalBoard, eval_metrics, pass_at_k
from grpo_core.tracking.metrics import MetricWindow, at_step, split_at_step
from grpo_core.train.eval_log import EvalLog

ROOT = Path(__file__).resolve().parents[2]


def _brute_force_pass_at_k(correct: list[bool], k: int) -> float:
    """Fraction of the k-subsets of the samples holding at least one correct sample (the definition)."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_hand_computed_values():
    # 1 - C(n-c, k) / C(n, k), worked by hand
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)=3, C(5,2)=10
    assert pass_at_k(4, 1, 1) == pytest.approx(1 / 4)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # C(7,5)=21, C(10,5)=252
    assert pass_at_k(3, 0, 2) == 0.0
    assert pass_at_k(3, 2, 2) == 1.0  # n - c = 1 < k: every pair holds a correct one
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8])
def test_pass_at_k_equals_brute_force_enumeration_and_the_closed_form(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            expected = _brute_force_pass_at_k(correct, k)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)
            assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_eval_metrics_average_pass_at_k_over_prompts_and_count_unscored_as_wrong():
    rewards = [np.array([1.0, 0.0, 0.0, 0.5]), np.array([0.0, np.nan, 0.0, 0.0]), np.array([2.0, 2.0, 0.0, 1.0])]
    m = eval_metrics(rewards, [1, 2], correct_above=0.0)
    # correct counts 2, 0, 3 of 4 samples each
    assert m["eval/accuracy"] == pytest.approx(5 / 12)
    assert m["eval/pass_at_1"] == pytest.approx((2 / 4 + 0 + 3 / 4) / 3)
    assert m["eval/pass_at_2"] == pytest.approx(((1 - comb(2, 2) / comb(4, 2)) + 0 + 1) / 3)
    assert m["eval/reward_mean"] == pytest.approx((1 + 0.5 + 2 + 2 + 1) / 11)  # 11 scored samples
    assert m["eval/num_prompts"] == 3
    # a configured threshold: reward > 1 only
    assert eval_metrics(rewards, [1], correct_above=1.0)["eval/accuracy"] == pytest.approx(2 / 12)


def test_step_tagged_metrics_survive_the_window_and_split_back_to_their_step():
    w = MetricWindow()
    w.add("reward", 0.5)
    w.add(at_step("eval/pass_at_4", 12), 0.25)
    w.add(at_step("eval/failed_count", 14), 1)
    w.add(at_step("eval/failed_count", 14), 1)  # counts keep their aggregation (summed)
    plain, tagged = split_at_step(w.flush())
    assert plain == {"reward": 0.5}
    assert tagged == {12: {"eval/pass_at_4": 0.25}, 14: {"eval/failed_count": 2.0}}


def test_board_asks_for_every_nth_step_and_the_final_one():
    board = EvalBoard(every_steps=2, final_step=5)
    for step in range(1, 6):
        board.on_report(step, policy_version=step)
    asked = []
    while not board.requests.empty():
        asked.append(board.requests.get())
    assert asked == [(2, 2), (4, 4), (5, 5)]


class _Sink:
    def __init__(self):
        self.lines = []

    def log(self, step, metrics):
        self.lines.append((step, dict(metrics)))


def test_trainer_logs_evaluations_at_their_step_and_waits_for_the_missing_ones_at_the_end():
    sink = _Sink()
    log = EvalLog(sink, every_steps=2, final_step=5, timeout_s=30, first_step=0)
    assert log.split({"reward": 1.0, at_step("eval/accuracy", 2): 0.5}) == {"reward": 1.0}
    assert sink.lines == [(2, {"eval/accuracy": 0.5})]
    windows = iter([{}, {at_step("eval/accuracy", 4): 0.75}, {"x": 1.0, at_step("eval/accuracy", 5): 1.0}])
    assert log.wait(lambda: next(windows), last_step=5) == set()
    assert sink.lines[1:] == [(4, {"eval/accuracy": 0.75}), (5, {"eval/accuracy": 1.0})]
    # a resumed trainer (from step 4) that stopped at step 3 of... nothing is expected before its first step
    assert EvalLog(sink, 2, 5, 30, first_step=4).expected(5) == {5}
    assert EvalLog(sink, None, None, 30, first_step=0).expected(7) == set()


def test_eval_config_refuses_what_cannot_be_computed():
    with pytest.raises(ValueError, match="eval.greedy"):
        RunConfig.model_validate({"eval": {"dataset": "json:x.jsonl", "greedy": True, "num_samples": 2}})
    with pytest.raises(ValueError, match=r"eval.pass_at_k \[8\]"):
        RunConfig.model_validate({"eval": {"dataset": "json:x.jsonl", "num_samples": 4, "pass_at_k": [1, 8]}})
    cfg = RunConfig.model_validate({"eval": {"dataset": "json:x.jsonl", "every_steps": 3}, "train": {"max_steps": 7}})
    assert cfg.rollout_process().eval.every_steps == 3 and cfg.rollout_process().max_steps == 7
    assert cfg.trainer_process().eval.every_steps == 3
    assert not RunConfig().eval.enabled


def test_summary_artifact_and_progress_read_evaluation_lines_apart_from_the_steps(tmp_path):
    from flows.artifacts import eval_markdown, last_record
    from grpo_core.tracking.report import eval_history, summarize

    lines = [
        {"step": 1, "reward": 0.2},
        {"step": 2, "reward": 0.4},
        {"step": 2, "eval/num_prompts": 3, "eval/pass_at_2": 0.5, "eval/policy_version": 2},  # logged after step 3
        {"step": 3, "reward": 0.6},
        {"step": 3, "eval/num_prompts": 3, "eval/pass_at_2": 0.75, "eval/policy_version": 3},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["step"] for r in eval_history(path)] == [2, 3]
    summary = summarize(path)
    assert summary["reward_first5"] == pytest.approx(0.4) and summary["steps"] == 3
    assert summary["eval"] == "step 3 (policy version 3), 3 prompts: pass_at_2 0.75"
    assert last_record(path) == {"step": 3, "reward": 0.6}  # the progress bar's step, not an evaluation's
    table = eval_markdown(eval_history(path)).splitlines()
    assert table[2] == "| step | num_prompts | pass_at_2 | policy_version |"
    assert table[4:] == ["| 2 | 3 | 0.5000 | 2 |", "| 3 | 3 | 0.7500 | 3 |"]


def test_eval_code_is_checked_like_the_rollouts_and_preflight_reads_the_eval_dataset(tmp_path, monkeypatch):
    from grpo_core.entries import kind_of_field
    from grpo_core.errors import ConfigError
    from grpo_core.run import preflight
    from grpo_core.security.allowlist import check_code_references, code_references

    monkeypatch.delenv("GRPO_ALLOWED_MODULES", raising=False)
    cfg = RunConfig.model_validate(
        {"eval": {"dataset": "evil_module:rows", "reward_functions": ["grpo_core.demo_rewards:even_token_reward"]}}
    )
    fields = {ref.field: ref.spec for ref in code_references(cfg)}
    assert fields["eval.dataset"] == "evil_module:rows"
    assert fields["eval.reward_functions[0]"] == "grpo_core.demo_rewards:even_token_reward"
    assert kind_of_field("eval.reward_functions[0]") == "reward" and kind_of_field("eval.dataset") == "dataset"
    with pytest.raises(ConfigError, match="eval.dataset"):  # outside the allow-list, refused before any import
        check_code_references(cfg)
    # preflight: a held-out file whose row 1 has no prompt is refused naming eval.dataset and the row
    data = tmp_path / "held_out.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n')
    cfg = RunConfig.model_validate({"eval": {"dataset": f"json:{data}"}})
    with pytest.raises(ConfigError, match=r"eval.dataset=.*row 1 has no 'prompt'"):
        preflight.check_eval(cfg)
    with pytest.raises(ConfigError, match=r"eval.dataset=.*no such file"):
        preflight.check_eval(RunConfig.model_validate({"eval": {"dataset": f"json:{tmp_path / 'missing.jsonl'}"}}))
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    preflight.check_eval(cfg)  # a good file passes


def test_eval_prompts_too_long_for_the_context_are_left_out_with_a_warning(tmp_path, caplog):
    from types import SimpleNamespace

    from grpo_core.errors import ConfigError
    from grpo_core.rollout.evaluate import build_evaluator

    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"prompt": "x" * n}) + "\n" for n in (3, 40, 5)))
    # a stand-in loop: one token per character, a 16-token context (a completion needs at least one token of room)
    loop = SimpleNamespace(
        render=lambda messages: [0] * len(messages[-1]["content"]), runtime=SimpleNamespace(max_model_len=16)
    )
    cfg = RunConfig.model_validate({"eval": {"dataset": f"json:{data}"}})
    runner = build_evaluator(cfg.eval, cfg.rollout, loop, EvalBoard(None, 5))  # type: ignore[arg-type]
    assert [len(ids) for _, _, ids in runner.prompts] == [3, 5]
    assert "1 prompts (rows [1]) leave no room" in caplog.text
    loop.runtime.max_model_len = 4
    with pytest.raises(ConfigError, match="every prompt is longer than the servers' context"):
        build_evaluator(cfg.eval, cfg.rollout, loop, EvalBoard(None, 5))  # type: ignore[arg-type]


def _grpo_train(tmp: Path, prefect_api, *overrides: str) -> subprocess.CompletedProcess:
    """``grpo train`` of configs/tiny.yaml (the flow, its embedded server, rollout and trainer processes), its flow
    run on the session's ``prefect_api``."""
    cmd = grpo_train_command(
        tmp,
        "train.flush_partial_after_s=1",
        "rollout.reward_functions=[flow_helpers:varied_reward]",  # varies within every group: every prompt trains
        "rollout.max_concurrent_rollouts=4",  # one group of 4 at a time: groups finish in the order they start
        "train.max_steps=5",
        *overrides,
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'support'}",
        "PREFECT_HOME": str(tmp / "prefect"),
        "COLUMNS": "400",
        "OMP_NUM_THREADS": "1",
        **prefect_api.client_env(),
    }
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=900)


def _run_dir(tmp: Path) -> Path:
    (metrics,) = (tmp / "runs").glob("*/metrics.jsonl")
    return metrics.parent


EVAL_OVERRIDES = (
    "eval.dataset=reasoning_gym:basic_arithmetic",
    "eval.dataset_size=3",
    "eval.every_steps=2",
    "eval.num_samples=4",
    "eval.pass_at_k=[1,2,4]",
    "eval.correct_above=0.5",
    "eval.max_completion_length=8",
)


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory, prefect_api) -> tuple[Path, str]:
    """One `grpo train` of 5 steps evaluating 3 held-out prompts every 2 steps and at the end: (its folder, output)."""
    tmp = tmp_path_factory.mktemp("eval-run")
    done = _grpo_train(tmp, prefect_api, *EVAL_OVERRIDES)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 0, out[-4000:]
    return tmp, out


# Slow tier (a whole `grpo train`, ~50 s on the loaded CI box; the default tier's one is test_honest_runs): the steps
# it evaluates at and logs under are the default tier's test_board_asks_for_every_nth_step_and_the_final_one and
# test_trainer_logs_evaluations_at_their_step_and_waits_for_the_missing_ones_at_the_end, in process.
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_grpo_train_evaluates_at_every_nth_step_and_at_the_end_logging_each_at_its_step(evaluated_run, prefect_api):
    tmp, out = evaluated_run
    run_dir = _run_dir(tmp)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if "eval/num_prompts" in r]
    # steps 2 and 4 (every_steps) and 5 (the end), each once, with the policy version of that step
    assert sorted(r["step"] for r in evals) == [2, 4, 5], evals
    for r in evals:
        assert r["eval/num_prompts"] == 3
        assert r["eval/policy_version"] == r["step"]  # train.weight_sync_steps 1: version N after step N
        assert 0.0 <= r["eval/pass_at_1"] <= r["eval/pass_at_2"] <= r["eval/pass_at_4"] <= 1.0
        assert r["eval/pass_at_1"] == pytest.approx(r["eval/accuracy"])  # both = correct samples / all (n=4 each)
        assert 0.0 <= r["eval/reward_mean"] < 1.0  # varied_reward is in [0, 1)
    step_lines = [r for r in lines if "eval/num_prompts" not in r]
    assert sorted(r["step"] for r in step_lines) == [1, 2, 3, 4, 5]  # the steps' own lines are unchanged
    assert not any(k.startswith("eval") for r in step_lines for k in r), "an eval metric leaked into a step's line"
    # MLflow holds the same values at the same steps, under the same names
    from grpo_core import tracking
    from grpo_core.config import TrackingConfig

    client = tracking.client(TrackingConfig(dir=tmp / "mlflow", experiment_name="grpo-tiny"))
    (run,) = client.search_runs([client.get_experiment_by_name("grpo-tiny").experiment_id])
    for name in ("eval/pass_at_4", "eval/accuracy"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert history == pytest.approx({r["step"]: r[name] for r in evals}), name
    assert "'eval': 'step 5 (policy version 5), 3 prompts: accuracy" in out  # the summary's line
    # the flow run's markdown artifact: one table row per evaluated step (read from the Prefect API; the run folder
    # is named by the flow run's id)
    found = prefect_api.api().http.post(
        "/artifacts/filter",
        json={"artifacts": {"key": {"any_": ["grpo-eval"]}, "flow_run_id": {"any_": [run_dir.name]}}},
    )
    found.raise_for_status()
    data = max(found.json(), key=lambda a: a["created"])["data"]  # the latest version of the keyed artifact
    table = json.loads(data) if data.startswith('"') else data
    assert table.startswith("### Held-out evaluation") and [r.split(" | ")[0] for r in table.splitlines()[4:]] == [
        "| 2",
        "| 4",
        "| 5",
    ], table


def test_eval_prompt_column_reads_the_held_out_prompts_and_eval_errors_name_eval_fields(tmp_path):
    from grpo_core.errors import ConfigError
    from grpo_core.rollout.evaluate import eval_rows
    from grpo_core.run import preflight

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n')
    train = tmp_path / "train.jsonl"
    train.write_text('{"problem": "3+3?", "answer": "6"}\n')
    rollout = {"dataset": f"json:{train}", "prompt_column": "problem"}
    cfg = RunConfig.model_validate(
        {"rollout": rollout, "eval": {"dataset": f"json:{held_out}", "prompt_column": "question"}}
    )
    # each row's prompt is its `question` as one user message, as rollout.prompt_column maps training's strings
    assert [r["prompt"] for r in eval_rows(cfg.eval, cfg.rollout)] == [
        [{"role": "user", "content": "1+1?"}],
        [{"role": "user", "content": "2+2?"}],
    ]
    preflight.check_eval(cfg)
    # unset, the rollout's prompt column applies (as before eval.prompt_column): `problem` is no column here
    inherited = RunConfig.model_validate({"rollout": rollout, "eval": {"dataset": f"json:{held_out}"}})
    with pytest.raises(ConfigError) as info:
        eval_rows(inherited.eval, inherited.rollout)
    assert str(info.value).startswith("rollout.prompt_column='problem' is not a column of json:"), str(info.value)
    misspelt = RunConfig.model_validate({"eval": {"dataset": f"json:{held_out}", "prompt_column": "questoin"}})
    with pytest.raises(ConfigError, match=r"^eval.prompt_column='questoin' is not a column of .*did you mean"):
        eval_rows(misspelt.eval, misspelt.rollout)
    # a loading error names eval.dataset (and eval.dataset_kwargs), never rollout.dataset
    for spec, kwargs, says in (
        (f"json:{tmp_path / 'missing.jsonl'}", {}, "eval.dataset='json:"),
        ("reasoning_gym:chain_sum", {"no_such_option": 1}, "eval.dataset_kwargs {'no_such_option': 1} are not all"),
        ("reasoning_gym:chian_sum", {}, "eval.dataset='reasoning_gym:chian_sum': no such reasoning-gym task"),
    ):
        bad = RunConfig.model_validate({"eval": {"dataset": spec, "dataset_kwargs": kwargs}})
        with pytest.raises(ConfigError) as info:
            eval_rows(bad.eval, bad.rollout)
        assert says in str(info.value) and "rollout.dataset" not in str(info.value), str(info.value)
