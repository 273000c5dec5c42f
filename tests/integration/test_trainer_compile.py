"""Trainer speed settings under torchrun (gloo, CPU): every length bucket is compiled before the
first step and again after a resume (no step compiles anything), and the FSDP2 settings
(reshard after forward, prefetch) leave the training numbers unchanged on two ranks."""

import subprocess

import pytest
from trainer_helpers import read_jsonl, torchrun, trainer_config, write_samples

from grpo_core.train.rows import bucket_length, length_buckets


def run(tmp_path, nproc, **train):
    config = trainer_config(tmp_path, tmp_path / "samples.arrow", **train)
    with open(tmp_path / "log", "a") as log:
        code = torchrun(config, nproc, stdout=log, stderr=subprocess.STDOUT).wait(timeout=900)
    assert code == 0, (tmp_path / "log").read_text()[-4000:]
    return read_jsonl(tmp_path / "out" / "metrics.jsonl")


@pytest.mark.slow  # torch.compile of every length bucket, twice
def test_every_length_bucket_compiles_before_the_first_step_and_after_a_resume(tmp_path):
    write_samples(tmp_path / "samples.arrow", 14)
    settings = dict(compile=True, compile_backend="aot_eager", length_buckets=4, save_steps=3)
    run(tmp_path, 1, max_steps=3, **settings)
    metrics = run(tmp_path, 1, max_steps=50, **settings)  # resumes from the step-3 checkpoint to the end
    log = (tmp_path / "log").read_text()
    assert log.count("compiled 4 length buckets [32, 48, 80, 96]") == 2 and "resumed from" in log
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1)) and len(metrics) >= 5
    assert [m["step"] for m in metrics if "perf/compile_warmup_s" in m] == [1, 4]  # reported once per start
    assert all(m["perf/compile_warmup_s"] > 0 for m in metrics if "perf/compile_warmup_s" in m)
    assert [m["perf/recompile_count"] for m in metrics] == [0] * len(metrics)  # no step met an uncompiled shape
    buckets = length_buckets(96, 4, 16)
    met = {bucket_length(int(m["batch/row_tokens_max"]), buckets) for m in metrics}
    assert len(met) >= 2, met  # the rows really landed in different buckets
    for m in metrics:  # padding to the bucket, as the row lengths say
        n = m["batch/row_tokens_max"]
        assert m["batch/pad_frac"] == pytest.approx(1 - n / bucket_length(int(n), buckets))


def test_fsdp_settings_leave_the_numbers_unchanged(tmp_path):
    runs = {}
    for name, train in {
        "reshard": dict(fsdp_reshard_after_forward="always", fsdp_prefetch=0),
        "keep": dict(fsdp_reshard_after_forward="never", fsdp_prefetch=2),
    }.items():
        (tmp_path / name).mkdir()
        write_samples(tmp_path / name / "samples.arrow", 8)
        runs[name] = run(tmp_path / name, 2, max_steps=4, **train)
    assert len(runs["keep"]) == len(runs["reshard"]) >= 3
    assert "FSDP2: reshard_after_forward=False, prefetch=2" in (tmp_path / "keep" / "log").read_text()
    assert "FSDP2: reshard_after_forward=True, prefetch=0" in (tmp_path / "reshard" / "log").read_text()
    for a, b in zip(runs["keep"], runs["reshard"]):
        for key in ("loss", "grad_norm", "entropy", "sampling/importance_sampling_ratio/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
