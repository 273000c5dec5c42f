"""The trainer's ``reward``: at every step that trained, the mean reward of exactly the samples it trained.

The reward used to come from the rollout's metric window (groups scored since the last logged step), so a
step during which no group was scored had no ``reward`` and the others mixed groups trained at other steps.
Here the samples come from a file (``train.samples_path``) with a reward chosen per sample, and which
samples each step trained is read from ``trained_prompts.jsonl``.
"""

import math
import subprocess

import numpy as np
import pytest

from grpo_core.packing import Sample, write_samples_ipc
from trainer_helpers import VOCAB, read_jsonl, torchrun, trainer_config

NUM_PROMPTS, GROUP = 10, 4
PROMPT_LEN, COMPLETION_LEN = 8, 4
BUDGET = 4 * (PROMPT_LEN + GROUP * COMPLETION_LEN)  # forwarded tokens of exactly four whole groups


def reward_of(prompt: int, g: int) -> float:
    """The reward written for sample ``g`` of ``prompt``; NaN (not known) for one sample, which no mean counts."""
    return math.nan if (prompt, g) == (3, 1) else prompt + 0.25 * g


def write_group_samples(path):
    rng = np.random.default_rng(7)
    samples = []
    for p in range(NUM_PROMPTS):
        prompt = rng.integers(0, VOCAB, PROMPT_LEN).tolist()
        for g in range(GROUP):
            ids = prompt + rng.integers(0, VOCAB, COMPLETION_LEN).tolist()
            mask = [0] * PROMPT_LEN + [1] * COMPLETION_LEN
            lp = [0.0] * PROMPT_LEN + [-10.8] * COMPLETION_LEN
            samples.append(Sample.build(ids, mask, lp, sample_id=len(samples), group_id=p, prompt_index=p,
                                        advantage=g - 1.5, reward=reward_of(p, g)))
    write_samples_ipc(path, samples)
    return path


def test_every_step_logs_the_mean_reward_of_the_samples_it_trained(tmp_path):
    samples = write_group_samples(tmp_path / "samples.arrow")
    config = trainer_config(tmp_path, samples, max_steps=50, save_steps=100)
    text = config.read_text().replace("token_budget: 96", f"token_budget: {BUDGET}")
    config.write_text(text)
    with open(tmp_path / "log", "w") as log:
        code = torchrun(config, 1, stdout=log, stderr=subprocess.STDOUT).wait(timeout=600)
    assert code == 0, (tmp_path / "log").read_text()[-4000:]
    out = tmp_path / "out"
    metrics = {m["step"]: m for m in read_jsonl(out / "metrics.jsonl")}
    completed = {r["step"]: r["prompt_indices"] for r in read_jsonl(out / "trained_prompts.jsonl")}
    assert sorted(p for ps in completed.values() for p in ps) == list(range(NUM_PROMPTS))
    assert len(metrics) >= 3, "several steps, so a step without a freshly scored group is covered"
    for step, m in metrics.items():
        # Set-up check: no group was split across steps, so a step's samples are its completed prompts' groups.
        assert m["batch/samples_per_step"] == GROUP * len(completed[step]), (step, m, completed[step])
        expected = [r for p in completed[step] for g in range(GROUP) if not math.isnan(r := reward_of(p, g))]
        assert m["reward"] == pytest.approx(np.mean(expected)), (step, expected)
