"""The checkpoint fingerprint records the loss (issue 27, item 2): a resume with another ``train.loss_type`` (set
directly or by an ``algorithm`` preset) is refused naming the field, the other loss settings are applied and logged,
and a checkpoint written before the loss type was recorded still resumes."""

from __future__ import annotations

import json
import logging

import pytest

from grpo_core.config import RunConfig
from grpo_core.errors import ConfigError
from grpo_core.train.fingerprint import FINGERPRINT_FILE, check_resume, fingerprint_text


def _checkpoint(tmp_path, **run):
    folder = tmp_path / "step-0000002"
    folder.mkdir(exist_ok=True)
    (folder / FINGERPRINT_FILE).write_text(fingerprint_text(RunConfig(**run).trainer_process()))
    return folder


def test_a_resume_with_another_loss_type_is_refused_naming_it(tmp_path):
    folder = _checkpoint(tmp_path, train={"score_centering": False, "loss_type": "gspo"})
    assert json.loads((folder / FINGERPRINT_FILE).read_text())["config"]["train.loss_type"] == "gspo"
    assert (
        check_resume(RunConfig(train={"score_centering": False, "loss_type": "gspo"}).trainer_process(), folder) == []
    )
    with pytest.raises(ConfigError, match=r"train.loss_type: 'gspo' -> 'cispo'(.|\n)*another loss"):
        check_resume(RunConfig(train={"score_centering": False, "loss_type": "cispo"}).trainer_process(), folder)
    with pytest.raises(ConfigError, match=r"train.loss_type: 'gspo' -> 'grpo'"):
        check_resume(RunConfig(algorithm="dapo").trainer_process(), folder)  # a preset's loss is another loss too
    assert check_resume(RunConfig(algorithm="gspo").trainer_process(), folder)  # same loss, other ε: applied


def test_the_other_loss_settings_are_applied_and_logged(tmp_path, caplog):
    folder = _checkpoint(tmp_path)
    changed = {
        "tis_cap": 2.0,
        "sequence_mask": "geometric",
        "sequence_mask_min": 0.999,
        "sequence_mask_max": 1.001,
        "kl_coef": 0.04,
    }
    rollout = {"scale_rewards": "none", "mask_truncated_completions": True}
    with caplog.at_level(logging.WARNING):
        safe = check_resume(RunConfig(train=changed, rollout=rollout).trainer_process(), folder)
    assert sorted(safe) == sorted(
        [
            "train.tis_cap: None -> 2.0",
            "train.sequence_mask: 'none' -> 'geometric'",
            "train.sequence_mask_min: 0.5 -> 0.999",
            "train.sequence_mask_max: 2.0 -> 1.001",
            "train.kl_coef: 0.0 -> 0.04",
            "rollout.scale_rewards: 'group' -> 'none'",
            "rollout.mask_truncated_completions: False -> True",
        ]
    )
    assert "config change applied: train.tis_cap: None -> 2.0" in caplog.text


def test_a_checkpoint_without_the_loss_type_resumes(tmp_path):
    folder = _checkpoint(tmp_path)
    data = json.loads((folder / FINGERPRINT_FILE).read_text())
    for key in ("train.loss_type", "train.tis_cap", "train.sequence_mask", "rollout.scale_rewards"):
        del data["config"][key]  # written before these were recorded
    (folder / FINGERPRINT_FILE).write_text(json.dumps(data))
    assert check_resume(
        RunConfig(train={"score_centering": False, "loss_type": "cispo"}).trainer_process(), folder
    ) == ["train.score_centering: True -> False"]
