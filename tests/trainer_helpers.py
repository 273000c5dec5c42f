"""Helpers of the trainer tests: synthetic sample files and torchrun launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from grpo_core.packing import Sample, write_samples_ipc

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 49152  # SmolLM2 tokenizer, shared by the tiny registry models


def write_samples(path: Path, num_prompts: int, group_size: int = 4, seed: int = 0) -> Path:
    """Groups of samples sharing a prompt; sampler log-probs near a uniform-ish policy."""
    rng = np.random.default_rng(seed)
    samples = []
    for p in range(num_prompts):
        prompt = rng.integers(0, VOCAB, int(rng.integers(4, 12))).tolist()
        for g in range(group_size):
            completion = rng.integers(0, VOCAB, int(rng.integers(2, 10))).tolist()
            ids = prompt + completion
            mask = [0] * len(prompt) + [1] * len(completion)
            lp = [0.0] * len(prompt) + rng.normal(-10.8, 0.05, len(completion)).tolist()
            samples.append(Sample.build(ids, mask, lp, sample_id=len(samples), group_id=p, prompt_index=p,
                                        advantage=float(g - (group_size - 1) / 2)))
    write_samples_ipc(path, samples)
    return path


def trainer_config(tmp: Path, samples: Path, server: dict | None = None, **train) -> Path:
    """A YAML run config for an offline trainer run on a tiny model."""
    cfg = {
        "model": {"name": "tiny-qwen3"},
        "server": {"max_model_len": 128, **(server or {})},
        "rollout": {"max_completion_length": 32, "num_sampler_logprobs": 0, "temperature": 1.0},
        "packing": {"token_budget": 96},
        "train": {"output_dir": str(tmp / "out"), "samples_path": str(samples), "score_centering": False,
                  "learning_rate": 1e-3, "max_steps": 6, "save_steps": 2, "device": "cpu", **train},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def torchrun(config: Path, nproc: int, server_urls: list[str] = (), **popen) -> subprocess.Popen:
    """Start ``torchrun --nproc-per-node N -m grpo_core.train --config FILE [--server-url URL …]``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "grpo_core.train.launch", "--nproc-per-node", str(nproc),
           "-m", "grpo_core.train", "--config", str(config)]
    for url in server_urls:
        cmd += ["--server-url", url]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, **popen)


def read_jsonl(path: Path) -> list[dict]:
    """All JSON records of a file (empty if missing)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
