"""Faults on the resume path (issue 10): torn log lines, a damaged newest checkpoint, checkpoint rotation, a kill
that kills every rank followed by an exact mid-run resume, the config fingerprint and the run folder's lock.

The trainer runs under torchrun on the tiny model, offline (samples from an Arrow file), so every step's loss
and gradient norm can be compared with an uninterrupted run on the same samples.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import subprocess
import time

import pytest
from trainer_helpers import kill_all, process_tree, torchrun, trainer_config, write_samples

from grpo_core.run.durable import JsonlAppender, read_jsonl
from grpo_core.run.run_lock import RunLock
from grpo_core.train.checkpoint import truncate_step_logs

NUM_PROMPTS = 40
RUN = {"max_steps": 8, "save_steps": 2, "save_total_limit": 2}


def _run(tmp, nproc=2, samples_seed=0, **train):
    """A trainer config in ``tmp`` (samples of ``samples_seed``) and the path of its run folder."""
    tmp.mkdir(parents=True, exist_ok=True)
    samples = write_samples(tmp / "samples.arrow", NUM_PROMPTS, seed=samples_seed)
    return trainer_config(tmp, samples, **{**RUN, **train}), tmp / "out"


def _train(config, log, nproc=2):
    with open(log, "w") as f:
        code = torchrun(config, nproc, stdout=f, stderr=subprocess.STDOUT).wait(timeout=600)
    return code, log.read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 8-step run on two ranks: its metrics.jsonl records by step and its run folder."""
    tmp = tmp_path_factory.mktemp("reference")
    config, out = _run(tmp)
    code, log = _train(config, tmp / "log")
    assert code == 0, log[-4000:]
    return {r["step"]: r for r in read_jsonl(out / "metrics.jsonl")}, out


def test_a_torn_last_line_is_skipped_and_cut_before_appending(tmp_path, caplog):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')  # killed mid-append
    (tmp_path / "trained_prompts.jsonl").write_text('{"step": 1, "prompt_indices": [0]}\n{"step": 2, "prompt_')
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_jsonl(log)] == [
            1,
            2,
        ]
        truncate_step_logs(tmp_path, 1)  # what a resume from step 1 does first
    assert "torn" in caplog.text
    assert log.read_text() == '{"step": 1, "loss": 0.5}\n'
    assert (tmp_path / "trained_prompts.jsonl").read_text() == '{"step": 1, "prompt_indices": [0]}\n'
    log.write_text('{"step": 1}\n{"step": 2, "lo')
    out = JsonlAppender(log)  # the next writer cuts the torn line off: records never merge with it
    out.write({"step": 2})
    out.close()
    assert read_jsonl(log) == [{"step": 1}, {"step": 2}]
    log.write_text('{"step": 1}\n{"st\n{"step": 3}\n')  # damage that is not a torn tail is an error
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON line"):
        read_jsonl(log)


def test_killed_run_resumes_from_a_mid_run_checkpoint_with_the_uninterrupted_losses(tmp_path, reference):
    expected, reference_out = reference
    config, out = _run(tmp_path)
    with open(tmp_path / "log1", "w") as f:
        proc = torchrun(config, 2, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(read_jsonl(out / "trained_prompts.jsonl")) < 5:
            assert proc.poll() is None, (tmp_path / "log1").read_text()[-3000:]
            time.sleep(0.05)
        procs = process_tree(proc.pid)  # torchrun and both ranks (each rank in its own session)
        assert len(procs) >= 3, [p.cmdline() for p in procs]
        kill_all(procs)
    killed_at = max(r["step"] for r in read_jsonl(out / "trained_prompts.jsonl"))
    assert 5 <= killed_at < RUN["max_steps"], "the kill did not land mid-run"
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-???????"))
    assert len(saved) == 2, saved  # train.save_total_limit=2 kept the newest two
    newest, k = out / "checkpoints" / saved[-1], int(saved[0][5:])
    shard = next((newest / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # the newest checkpoint is damaged
    for name in ("metrics.jsonl", "trained_prompts.jsonl"):  # and both logs end in a torn line
        with (out / name).open("a") as f:
            f.write('{"step": 99, "loss": 0.')

    code, log = _train(config, tmp_path / "log2")
    assert code == 0, log[-4000:]
    assert f"checkpoint {newest} is damaged" in log and f"resumed from {out / 'checkpoints' / saved[0]}" in log
    assert 0 < k < RUN["max_steps"]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, RUN["max_steps"] + 1))  # each step logged once
    for m in metrics:  # the steps replayed after k have the uninterrupted run's values
        for key in ("loss", "grad_norm", "batch/samples_per_step"):
            assert m[key] == pytest.approx(expected[m["step"]][key], rel=1e-5, abs=1e-7), (m["step"], key)
    # num_tokens: the running total of forwarded tokens, continued from the checkpoint (summed here from the
    # uninterrupted run's per-step counts, not read from its num_tokens)
    for m in metrics:
        total = sum(expected[s]["batch/forwarded_tokens_per_step"] for s in range(1, m["step"] + 1))
        assert m["num_tokens"] == total, (m["step"], m["num_tokens"], total)
    trained = [p for r in read_jsonl(out / "trained_prompts.jsonl") for p in r["prompt_indices"]]
    assert [p for p, n in collections.Counter(trained).items() if n > 1] == []
    reference_trained = [p for r in read_jsonl(reference_out / "trained_prompts.jsonl") for p in r["prompt_indices"]]
    assert sorted(trained) == sorted(reference_trained)
    final = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert final == ["step-0000006", "step-0000008"], final  # rotation, and the damaged step re-saved over


def test_resume_applies_safe_config_changes_refuses_another_dataset_and_locks_the_folder(tmp_path, reference):
    _, reference_out = reference
    config, out = _run(tmp_path / "a", learning_rate=5e-4, run_lock_timeout_s=1.0)  # a test-sized wait (30 s)
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference_out / "checkpoints" / "step-0000006", out / "checkpoints" / "step-0000006")

    with RunLock(out, "test"):  # another writer holds the run folder
        code, log = _train(config, tmp_path / "locked.log", nproc=1)
        assert code != 0 and f"is in use by pid {os.getpid()}" in log, log[-3000:]
        assert "waited 1 s (train.run_lock_timeout_s)" in log
    assert not (out / "metrics.jsonl").exists()  # it touched nothing

    code, log = _train(config, tmp_path / "a.log", nproc=1)
    assert code == 0, log[-4000:]
    assert "config change applied: train.learning_rate: 0.001 -> 0.0005" in log
    lrs = [m["learning_rate"] for m in read_jsonl(out / "metrics.jsonl")]
    assert lrs == [5e-4, 5e-4], lrs  # steps 7 and 8 at the config's rate, not the optimizer state's 1e-3
    RunLock(out, "test").acquire().release()  # the trainer released the lock on exit

    config, out = _run(tmp_path / "b", samples_seed=1)  # the same run config, other samples
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference_out / "checkpoints" / "step-0000006", out / "checkpoints" / "step-0000006")
    code, log = _train(config, tmp_path / "b.log", nproc=1)
    assert code != 0
    assert "refused" in log and "train.samples_path sha256" in log, log[-3000:]
    assert not (out / "metrics.jsonl").exists()
    stored = json.loads((reference_out / "checkpoints" / "step-0000006" / "fingerprint.json").read_text())
    assert stored["config"]["train.learning_rate"] == 1e-3
