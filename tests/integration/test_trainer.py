"""The FSDP2 trainer under torchrun (gloo, CPU): world sizes 1 and 2. Exact resume after a hard kill of every
rank (weights, optimizer state, prompts neither skipped nor repeated) is test_resume_faults.py's."""

import os
import subprocess

import pytest
from trainer_helpers import ROOT, read_jsonl, torchrun, trainer_config, write_samples

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


# One rank goes to the slow tier (~13 s on the loaded CI box): the 2-rank case trains every prompt once across the
# ranks' shares, and the default tier launches one-rank trainers to the end in test_loss_normalization (whose 1-rank
# step equals the 2-rank one), test_weight_sync and test_time_metrics.
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.slow), 2])
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
