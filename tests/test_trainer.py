"""The FSDP2 trainer under torchrun (gloo, CPU): world sizes 1 and 2, and exact resume
after a hard kill (DESIGN.md §5, resume)."""

import collections
import os
import subprocess
import time

import pytest

from trainer_helpers import ROOT, kill_all, process_tree, read_jsonl, torchrun, trainer_config, write_samples

NUM_PROMPTS = 14


def trained_prompts(out):
    """Prompt indices completed over the whole run (one entry per completion)."""
    return [p for r in read_jsonl(out / "trained_prompts.jsonl") for p in r["prompt_indices"]]


def run_to_end(tmp_path, nproc, **train):
    tmp_path.mkdir(exist_ok=True)
    samples = write_samples(tmp_path / "samples.arrow", NUM_PROMPTS)
    config = trainer_config(tmp_path, samples, **train)
    with open(tmp_path / "log", "w") as log:
        code = torchrun(config, nproc, stdout=log, stderr=subprocess.STDOUT).wait(timeout=600)
    assert code == 0, (tmp_path / "log").read_text()[-4000:]
    return tmp_path / "out"


@pytest.mark.parametrize("nproc", [1, 2])
def test_trains_every_prompt_once_and_logs_metrics(tmp_path, nproc):
    out = run_to_end(tmp_path, nproc, max_steps=50)
    assert sorted(trained_prompts(out)) == list(range(NUM_PROMPTS))
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    first = metrics[0]
    for key in (
        "loss",
        "entropy",
        "grad_norm",
        "sampling/importance_sampling_ratio/mean",
        "sampling/masked_mean",
        "clip_ratio/low_mean",
        "batch/packing_ratio",
        "batch/row_imbalance",
        "batch/samples_per_row",
        "perf/step_s",
        "perf/fwd_bwd_s",
        "perf/tokens_per_s",
        "sample/staleness_max",
    ):
        assert key in first, key
    assert first["batch/packing_ratio"] > 1.0  # prompts are shared inside groups
    assert sum(m["batch/samples_per_step"] for m in metrics) == 4 * NUM_PROMPTS
    assert (out / "checkpoints").is_dir()


def test_a_finished_rank_exits_0_whatever_the_interpreter_teardown_does(tmp_path):
    """Native threads parked in torch/gloo/Arrow can abort a rank in the interpreter's teardown after the run
    has finished (CI once: rank 1 "terminate called without an active exception", SIGABRT, after its last
    checkpoint: the whole run reported failed). Model that teardown with an ``atexit`` hook that aborts, in
    every rank: the finished ranks must still exit 0, with the run's files complete."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import atexit, os\n"
        "if 'LOCAL_RANK' in os.environ:  # torchrun's ranks, not torchrun itself\n"
        "    open(os.path.join(os.environ['HOOK_DIR'], f\"rank{os.environ['RANK']}\"), 'w').close()\n"
        "    atexit.register(os.abort)\n"
    )
    samples = write_samples(tmp_path / "samples.arrow", NUM_PROMPTS)
    config = trainer_config(tmp_path, samples, max_steps=2)
    env = {"PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", str(ROOT))]), "HOOK_DIR": str(hooks)}
    with open(tmp_path / "log", "w") as log:
        code = torchrun(config, 2, env=env, stdout=log, stderr=subprocess.STDOUT).wait(timeout=600)
    assert sorted(p.name for p in hooks.glob("rank*")) == ["rank0", "rank1"]  # the hook really ran in both ranks
    assert code == 0, (tmp_path / "log").read_text()[-4000:]
    assert [m["step"] for m in read_jsonl(tmp_path / "out/metrics.jsonl")] == [1, 2]
    assert (tmp_path / "out/final_model/config.json").is_file()


def test_resume_after_hard_kill_neither_skips_nor_repeats(tmp_path):
    # The uninterrupted run of the same config (2 ranks, save_steps 2) trains every prompt once: that is
    # test_trains_every_prompt_once_and_logs_metrics[2], so the resumed run is held to the same list.
    run = tmp_path / "killed"
    run.mkdir()
    samples = write_samples(run / "samples.arrow", NUM_PROMPTS)
    config = trainer_config(run, samples, max_steps=50, save_steps=2)
    with open(run / "log1", "w") as log:
        proc = torchrun(config, 2, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline and len(read_jsonl(run / "out/trained_prompts.jsonl")) < 3:
            time.sleep(0.05)
        procs = process_tree(proc.pid)  # torchrun and its ranks, each rank in its own session (torch 2.11)
        assert len(procs) >= 3, [p.cmdline() for p in procs]
        kill_all(procs)  # hard, mid-run, every rank at once; asserts none survived
        proc.wait()
    assert 3 <= len(read_jsonl(run / "out/trained_prompts.jsonl"))
    with open(run / "log2", "w") as log:
        code = torchrun(config, 2, stdout=log, stderr=subprocess.STDOUT).wait(timeout=600)
    log2 = (run / "log2").read_text()
    assert code == 0, log2[-4000:]
    assert "resumed from" in log2
    got = trained_prompts(run / "out")
    assert [p for p, n in collections.Counter(got).items() if n > 1] == []  # no prompt trained twice
    assert sorted(got) == list(range(NUM_PROMPTS))  # and none skipped
    steps = [m["step"] for m in read_jsonl(run / "out/metrics.jsonl")]
    assert steps == sorted(set(steps))  # metrics continue without duplicate steps
