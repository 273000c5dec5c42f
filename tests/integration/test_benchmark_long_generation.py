"""benchmarks/long_generation_sync.py in its CPU form: the trainer's own policy module and weight sync against
the embedded server (the GPU run does the same against real vLLM)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import ROOT

from grpo_core.config import load_config
from grpo_core.models import resolve_model_dir

# serial: the /pause case asserts a race's outcome (the pause, sent once 8 tokens are out, reaches the server before
# the other ~190 of the 200 are): alone on the box, not beside the other worker's whole run.
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def test_long_generation_sync_runs_on_cpu_with_the_trainers_policy(tmp_path):
    cmd = [
        sys.executable,
        "benchmarks/long_generation_sync.py",
        "--cpu-smoke",
        "--tokens",
        "200",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "long_generation_sync.json").read_text())
    keep = result["keep_mode_sync"]
    # The sync happened while the generation ran, and the generation still got every token it asked for.
    assert keep["in_flight_after_interrupt"] and (keep["finish_reason"], keep["tokens"]) == ("length", 200)
    # vLLM 0.25.1's /pause without a mode aborts in-flight requests (DESIGN.md §9); the embedded server does too.
    assert result["pause_without_mode"]["finish_reason"] == "abort"
    assert result["pause_without_mode"]["tokens"] < 200
    # The sync pushed the perturbed weights under the served checkpoint's names.
    synced = load_file(tmp_path / "run" / ".weights" / "v1" / "model.safetensors")
    cfg = load_config(ROOT / "configs" / "gpu-1xh200.yaml", ["model.name=tiny-qwen3", "model.dtype=auto"])
    original = load_file(next(resolve_model_dir(cfg.model).glob("*.safetensors")))
    assert synced.keys() == original.keys()
    assert all(not torch.equal(synced[k].float(), original[k].float()) for k in original if original[k].std() > 0)
