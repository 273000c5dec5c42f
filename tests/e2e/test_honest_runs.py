"""A run that cannot form a step fails with the cause and the keys to change; a run that trained fewer
steps than asked says so in its summary and exit code; configs/tiny.yaml really trains (issue 9, item 2)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from flow_helpers import grpo_env, grpo_train_command

from grpo_core.errors import NothingToTrainError
from grpo_core.packing import Sample, samples_to_arrow, write_samples_ipc
from grpo_core.train.checkpoint import PromptTracker
from grpo_core.train.planner import Planner
from grpo_core.transport.types import PulledBatch

ROOT = Path(__file__).resolve().parents[2]


class ScriptedSource:
    """Answers pulls from a fixed script, then reports the end of the stream."""

    def __init__(self, script):
        self.script = list(script)

    def pull(self, policy_version, *, min_samples=1, timeout_s=None):
        return self.script.pop(0) if self.script else PulledBatch(EMPTY, exhausted=True)

    def report(self, policy_version, tokens_consumed):
        pass

    def metrics(self):
        return {"frac_reward_zero_std": 1.0, "reward": 0.0}

    def close(self):
        pass


def group(prompt_index, length=4, n=2):
    return samples_to_arrow(
        [
            Sample.build(
                [100 + prompt_index] + [2] * (length - 2) + [4 + i],
                [0] * (length - 1) + [1],
                sample_id=prompt_index * 10 + i,
                group_id=prompt_index,
                prompt_index=prompt_index,
            )
            for i in range(n)
        ]
    )


EMPTY = group(0).slice(0, 0)


def planner(script, **kw):
    return Planner(
        ScriptedSource(script),
        num_ranks=1,
        token_budget=16,
        backend="rust",
        tracker=PromptTracker(),
        flush_after_s=0.01,
        hints={"max_staleness": 4, "temperature": 1.0, "num_generations": 2, "max_completion_length": 64},
        **kw,
    )


def test_groups_dropped_by_the_rollout_fail_after_the_bound_with_counts_and_keys():
    # 3 dropped groups per pull; the bound is 7: the third pull crosses it (9 in a row).
    script = [PulledBatch(EMPTY, consumed_prompt_indices=[3 * i, 3 * i + 1, 3 * i + 2]) for i in range(10)]
    p = planner(script, max_untrainable_groups=7)
    with pytest.raises(NothingToTrainError) as err:
        p.next_step(1, policy_version=0)
    message = str(err.value)
    assert "the last 9 groups in a row" in message and "train.max_untrainable_groups=7" in message
    assert "9 groups by the rollout" in message and "frac_reward_zero_std=1" in message
    assert "rollout.reward_functions" in message and "rollout.temperature=1.0" in message
    assert len(p.source.script) == 7  # it stopped pulling at the bound


def test_a_trainable_sample_resets_the_count_of_untrainable_groups():
    script = [
        PulledBatch(EMPTY, consumed_prompt_indices=[0, 1, 2]),
        PulledBatch(group(3)),
        PulledBatch(EMPTY, consumed_prompt_indices=[4, 5, 6]),
    ]
    p = planner(script, max_untrainable_groups=5)
    assert p.next_step(1, policy_version=0) is not None  # 3 + 3 dropped, but not 5 in a row
    assert p.streak.groups == 3 and p.total.groups == 6


def test_samples_longer_than_the_budget_fail_naming_the_budget_keys():
    script = [PulledBatch(pa.concat_batches([group(i, length=40), group(i + 1, length=40)])) for i in range(0, 8, 2)]
    p = planner(script, max_untrainable_groups=4)
    with pytest.raises(NothingToTrainError) as err:
        p.next_step(1, policy_version=0)
    message = str(err.value)
    assert "8 samples (4 whole groups) longer than packing.token_budget=16" in message
    assert "raise packing.token_budget or lower rollout.max_completion_length (now 64)" in message
    assert "rollout.reward_functions" not in message  # not the cause here


def _offline_trainer(tmp_path: Path, samples: list[Sample], **train) -> tuple[int, str]:
    write_samples_ipc(tmp_path / "samples.arrow", samples)
    cfg = {
        "model": {"name": "tiny-qwen3"},
        "server": {"max_model_len": 128},
        "rollout": {"max_completion_length": 32, "num_sampler_logprobs": 0},
        "packing": {"token_budget": 16},
        "train": {
            "output_dir": str(tmp_path / "out"),
            "samples_path": str(tmp_path / "samples.arrow"),
            "score_centering": False,
            "device": "cpu",
            "flush_partial_after_s": 0.5,
            **train,
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    done = subprocess.run(
        [sys.executable, "-m", "grpo_core.train", "--config", str(tmp_path / "run.yaml")],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stdout + done.stderr


def _samples(num_groups: int, length: int) -> list[Sample]:
    # Sampler log-probs near a random tiny model's (about log(1/49152)), so the terms are kept.
    return [
        Sample.build(
            [7] * (length - 3) + [10 + g, 20 + i, 30],
            [0] * (length - 2) + [1, 1],
            [0.0] * (length - 2) + [-10.8, -10.8],
            sample_id=4 * g + i,
            group_id=g,
            prompt_index=g,
            advantage=float(i) - 0.5,
        )
        for g in range(num_groups)
        for i in range(2)
    ]


def test_trainer_that_cannot_form_a_step_exits_non_zero_with_the_cause(tmp_path):
    # Every sample is longer than the 16-token budget: before, the run ended "successfully" after 0 steps.
    code, output = _offline_trainer(tmp_path, _samples(3, length=40), max_steps=5)
    assert code != 0, output[-2000:]
    error = (tmp_path / "out" / "trainer_error.txt").read_text()
    assert error.startswith("rank 0: NothingToTrainError: the samples ended after step 0 of train.max_steps=5")
    assert "6 samples (3 whole groups) longer than packing.token_budget=16" in error
    assert not (tmp_path / "out" / "train_end.json").exists()


def test_trainer_that_runs_out_of_samples_records_fewer_steps_and_why(tmp_path):
    code, output = _offline_trainer(tmp_path, _samples(2, length=12), max_steps=50)
    assert code == 0, output[-2000:]
    end = json.loads((tmp_path / "out" / "train_end.json").read_text())
    steps = [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert end["steps"] == steps[-1] >= 1 and end["max_steps"] == 50
    assert "the samples ended after step" in end["stopped_early"] and "rollout.num_epochs: null" in end["stopped_early"]


def _grpo_train(tmp_path: Path, prefect_api, *overrides: str) -> subprocess.CompletedProcess:
    """``grpo train`` of configs/tiny.yaml with ``overrides``, its flow run on the session's ``prefect_api``."""
    cmd = grpo_train_command(tmp_path, "train.flush_partial_after_s=1", *overrides)
    env = grpo_env(tmp_path, **prefect_api.client_env())
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # a whole `grpo train`; the default tier keeps the one below
@pytest.mark.timeout(1200)
def test_grpo_train_with_no_reward_variance_fails_naming_cause_and_keys(tmp_path, prefect_api):
    # The verifier alone gives a random model 0 on every rollout: every group has zero reward variance.
    # Before: the flow ended Completed with "steps 0" and reward nan.
    done = _grpo_train(
        tmp_path, prefect_api, "rollout.reward_functions=[]", "rollout.dataset_size=2", "train.max_steps=3"
    )
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1, output[-3000:]
    assert "Flow run" in output and "Finished in state Failed" in output
    assert "NothingToTrainError: the samples ended after step 0 of train.max_steps=3" in output
    assert "2 groups by the rollout" in output and "rollout.reward_functions" in output


@pytest.mark.timeout(1200)  # the default tier's `grpo train` end to end: every process of the flow, one step
def test_grpo_train_that_trains_fewer_steps_than_asked_says_so_and_exits_3(tmp_path, prefect_api):
    # configs/tiny.yaml as shipped trains (its reward varies on a random model); one prompt makes one step.
    done = _grpo_train(tmp_path, prefect_api, "rollout.dataset_size=1", "train.max_steps=4")
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 3, output[-3000:]
    assert "Finished in state Completed" in output
    assert "1 of 4 asked: the samples ended after step 1" in output
    assert "trained 1 of 4 steps" in output


def test_a_step_with_a_non_finite_gradient_is_skipped_counted_and_never_saved(tmp_path):
    # Group 0's advantage is NaN (a poisoned signal): its step's gradient norm is NaN. Before, the NaN went
    # through optimizer.step() into the weights, every later loss was NaN, and the checkpoint kept it.
    samples = _samples(2, length=12)
    for s in samples[:2]:
        s.advantage = float("nan")
    code, output = _offline_trainer(tmp_path, samples, max_steps=2, save_steps=1, logging_steps=1)
    assert code == 0, output[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["train/skipped_nonfinite_steps"] for m in metrics] == [1, 1]
    assert [m["policy_version"] for m in metrics] == [0, 1]  # no sync after the skipped step
    assert "grad_norm" not in metrics[0] or not math.isfinite(metrics[0]["grad_norm"])
    assert math.isfinite(metrics[1]["loss"]) and math.isfinite(metrics[1]["grad_norm"]) and metrics[1]["grad_norm"] > 0
    checkpoints = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert checkpoints == ["step-0000002"]
    assert json.loads((tmp_path / "out" / "train_end.json").read_text())["skipped_nonfinite_steps"] == 1
