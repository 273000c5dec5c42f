"""A CPU run of the flow trains the tiny random Qwen3.5 (a Gated DeltaNet hybrid saved as the
vision-language checkpoint Qwen3.5 ships) for a few steps: the embedded server samples it with its
hybrid cache, the trainer packs groups into tree rows and syncs full weights back in the
checkpoint's names, and the exported model keeps the original vision tower."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from flow_helpers import grpo_env, grpo_train_command
from transformers import AutoModelForImageTextToText

from grpo_core.config import ModelConfig
from grpo_core.models import resolve_model_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a whole `grpo train`
@pytest.mark.timeout(1500)
def test_grpo_train_trains_tiny_qwen35_on_the_embedded_server(tmp_path):
    cmd = grpo_train_command(
        tmp_path,
        "model.name=tiny-qwen3.5",
        "train.max_steps=2",
        "rollout.reward_functions=[flow_helpers:varied_reward]",
    )
    env = grpo_env(tmp_path)
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if (p / "metrics.jsonl").exists()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and metrics[-1]["policy_version"] == 2
    first = metrics[0]
    assert first["sample/staleness_max"] == 0 and first["batch/packing_ratio"] > 1.5  # prompts shared in tree rows
    # The trainer's tree-row log-probs (Gated DeltaNet over the trie) equal what the server sampled with.
    assert first["sampling/sampling_logp_difference/max"] < 5e-4
    original = AutoModelForImageTextToText.from_pretrained(resolve_model_dir(ModelConfig(name="tiny-qwen3.5")))
    trained = AutoModelForImageTextToText.from_pretrained(run_dir / "final_model")
    assert type(trained).__name__ == "Qwen3_5ForConditionalGeneration"
    before, after = original.state_dict(), trained.state_dict()
    vision = [k for k in before if k.startswith("model.visual.")]
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)
    assert not torch.equal(
        before["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"],
        after["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"],
    )
