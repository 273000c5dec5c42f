"""Helpers of the trainer tests: synthetic sample files and torchrun launches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import yaml

from grpo_core.packing import Sample, write_samples_ipc
from grpo_core.run.commands import local_trainer_command

ROOT = Path(__file__).resolve().parents[2]
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
            samples.append(
                Sample.build(
                    ids,
                    mask,
                    lp,
                    sample_id=len(samples),
                    group_id=p,
                    prompt_index=p,
                    advantage=float(g - (group_size - 1) / 2),
                )
            )
    write_samples_ipc(path, samples)
    return path


def trainer_config(tmp: Path, samples: Path, server: dict | None = None, **train) -> Path:
    """A YAML run config for an offline trainer run on a tiny model."""
    cfg = {
        "model": {"name": "tiny-qwen3"},
        "server": {"max_model_len": 128, **(server or {})},
        "rollout": {"max_completion_length": 32, "num_sampler_logprobs": 0, "temperature": 1.0},
        "packing": {"token_budget": 96},
        "train": {
            "output_dir": str(tmp / "out"),
            "samples_path": str(samples),
            "score_centering": False,
            "learning_rate": 1e-3,
            "max_steps": 6,
            "save_steps": 2,
            "device": "cpu",
            **train,
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def torchrun(
    config: Path, nproc: int, server_urls: list[str] = (), env: dict[str, str] | None = None, **popen
) -> subprocess.Popen:
    """Start ``torchrun --nproc-per-node N -m grpo_core.train --config FILE [--server-url URL …]`` (``env``: extra
    environment entries)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = local_trainer_command(config, nproc, server_urls)  # the flow's own launch (grpo_core.run.commands)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, **popen)


def read_jsonl(path: Path) -> list[dict]:
    """All JSON records of a file (empty if missing)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def process_tree(pid: int) -> list:
    """``psutil.Process`` of ``pid`` and every descendant alive now (torchrun's ranks each run in their own
    session under torch 2.11, so a signal to torchrun's process group misses them: collect them first)."""
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def kill_all(procs: list, timeout_s: float = 60.0) -> None:
    """SIGKILL every process in ``procs`` and wait until none is alive (a zombie counts as dead).

    Raises:
        AssertionError: a process still runs ``timeout_s`` after its SIGKILL.
    """
    import psutil

    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + timeout_s
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.05)
    assert not alive, f"still alive after SIGKILL: {[p.pid for p in alive]}"


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_each_step_and_prompt_once(run_dir: Path, max_steps: int) -> list[int]:
    """The run's invariants after kills and resumes; returns the trained prompt indices.

    Every step 1..max_steps is in ``trained_prompts.jsonl`` once, no prompt is trained twice, and the final
    checkpoint (``step-{max_steps}``) counts as done exactly the trained prompts and those whose samples it
    holds as pending: every prompt below its watermark and every one it lists above.
    """
    from grpo_core.packing import read_samples_ipc

    records = read_jsonl(run_dir / "trained_prompts.jsonl")
    assert [r["step"] for r in records] == list(range(1, max_steps + 1)), "a step is missing or logged twice"
    trained = [p for r in records for p in r["prompt_indices"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    final = run_dir / "checkpoints" / f"step-{max_steps:07d}"
    state = json.loads((final / "rollout_state.json").read_text())
    pending = set()
    if (final / "pending_samples.arrow").exists():
        pending = set(read_samples_ipc(final / "pending_samples.arrow").column("prompt_index").to_pylist())
    assert not pending & set(trained)
    done = set(range(state["first_untrained_prompt_index"])) | set(state["trained_above"])
    assert set(trained) | pending == done, "a prompt below the watermark was neither trained nor pending"
    return trained
