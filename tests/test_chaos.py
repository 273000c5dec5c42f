"""Chaos on the trainer (issue 10, item 10, trainer part): SIGKILL of every process of the attempt at moments
drawn from a seeded RNG, one of them while a checkpoint is being written, then a resume, until the run ends.

Invariants: every optimizer step is logged exactly once in ``metrics.jsonl`` and ``trained_prompts.jsonl``, no
prompt is trained twice, and every prompt below the final watermark is trained or pending in the final
checkpoint. The seed is printed (pytest shows it on failure); ``GRPO_CHAOS_SEED`` replays one.
"""

from __future__ import annotations

import os
import random
import subprocess
import time

from grpo_core.durable import read_jsonl
from trainer_helpers import (assert_each_step_and_prompt_once, kill_all, process_tree, torchrun, trainer_config,
                             write_samples)

NUM_PROMPTS, MAX_STEPS, SAVE_STEPS = 40, 8, 2


def _kill_when(proc, out, ready, log) -> str:
    """Wait until ``ready()`` says what it saw, then SIGKILL torchrun and every rank; returns what it saw."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        seen = ready()
        if seen:
            kill_all(process_tree(proc.pid))
            return seen
        assert proc.poll() is None, f"the attempt ended before its kill:\n{log.read_text()[-3000:]}"
        time.sleep(0.002)
    raise AssertionError("the kill moment never came")


def test_seeded_kills_of_the_trainer_lose_no_step_and_no_prompt(tmp_path):
    seed = int(os.environ.get("GRPO_CHAOS_SEED", random.randrange(2**31)))
    print(f"chaos seed {seed} (GRPO_CHAOS_SEED={seed} replays it)")  # noqa: T201 - shown by pytest on failure
    rng = random.Random(seed)
    samples = write_samples(tmp_path / "samples.arrow", NUM_PROMPTS)
    config = trainer_config(tmp_path, samples, max_steps=MAX_STEPS, save_steps=SAVE_STEPS, save_total_limit=2)
    out = tmp_path / "out"
    steps_done = lambda: len(read_jsonl(out / "trained_prompts.jsonl"))  # noqa: E731

    def in_checkpoint_write(since: float) -> str:
        """A checkpoint folder this attempt is writing now (a killed attempt's leftover ``.tmp`` is older)."""
        for path in (out / "checkpoints").glob("step-*.tmp"):
            try:
                if path.stat().st_mtime >= since:
                    return f"during the write of {path.name}"
            except FileNotFoundError:  # renamed into place meanwhile
                pass
        return ""

    kills = []
    for attempt in range(3):
        log = tmp_path / f"log{attempt}"
        with log.open("w") as f:
            proc = torchrun(config, 2, stdout=f, stderr=subprocess.STDOUT)
            if attempt == 1:
                since = time.time()
                kills.append(_kill_when(proc, out, lambda: in_checkpoint_write(since), log))
            else:
                target = steps_done() + rng.randint(1, 3)
                kills.append(_kill_when(proc, out, lambda t=target: f"after step {t}" if steps_done() >= t else "",
                                        log))
            proc.wait()
    log = tmp_path / "log_final"
    with log.open("w") as f:
        code = torchrun(config, 2, stdout=f, stderr=subprocess.STDOUT).wait(timeout=600)
    assert code == 0, log.read_text()[-4000:]
    print(f"chaos seed {seed}: kills {kills}")  # noqa: T201

    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == list(range(1, MAX_STEPS + 1))
    assert_each_step_and_prompt_once(out, MAX_STEPS)
