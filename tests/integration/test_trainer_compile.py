"""Trainer speed settings under torchrun (gloo, CPU): the top length bucket is compiled before the first step and
again after a resume, a smaller one when a row first needs it (once, on every rank together; no step compiles
anything else), and the FSDP2 settings (reshard after forward, prefetch) leave the training numbers unchanged on two
ranks."""

import re
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


#: a length bucket compiled when a row first needed it: (rank, bucket, step)
FIRST_USE = re.compile(
    r"\[rank (\d+)\] grpo_core\.train\.trainer: compiled length bucket (\d+) on its first use, at step (\d+)"
)


def first_uses(log: str, rank: int = 0) -> list[tuple[int, int]]:
    """(bucket, step) of each bucket a rank compiled on its first use, in the order they were logged."""
    return [(int(b), int(s)) for r, b, s in FIRST_USE.findall(log) if int(r) == rank]


@pytest.mark.slow  # torch.compile, twice
def test_the_top_bucket_compiles_before_the_first_step_and_the_others_on_first_use_also_after_a_resume(tmp_path):
    write_samples(tmp_path / "samples.arrow", 14)
    settings = dict(compile=True, compile_backend="aot_eager", length_buckets=4, save_steps=3)
    run(tmp_path, 1, max_steps=3, **settings)
    first_log = (tmp_path / "log").read_text()
    metrics = run(tmp_path, 1, max_steps=50, **settings)  # resumes from the step-3 checkpoint to the end
    log = (tmp_path / "log").read_text()
    buckets = length_buckets(96, 4, 16)
    assert buckets == (32, 48, 80, 96) and "resumed from" in log[len(first_log) :]
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1)) and len(metrics) >= 5
    # before the first step of each start: the top bucket only (every full row pads to it)
    for part in (first_log, log[len(first_log) :]):
        assert part.count("compiled length bucket 96 (the top: full rows)") == 1, part[-3000:]
    assert [m["step"] for m in metrics if "perf/compile_warmup_s" in m] == [1, 4]  # reported once per start
    assert all(m["perf/compile_warmup_s"] > 0 for m in metrics if "perf/compile_warmup_s" in m)
    # the other buckets: compiled by the step whose rows first need one, once per process, never the top again
    by_step = {m["step"]: m for m in metrics}
    compiled_at: dict[int, int] = {}
    for part, steps in ((first_log, range(1, 4)), (log[len(first_log) :], range(4, len(metrics) + 1))):
        uses = first_uses(part)
        assert len({b for b, _ in uses}) == len(uses), uses  # each bucket once per process
        assert all(b in buckets[:-1] and s in steps for b, s in uses), (uses, steps)
        for step in steps:  # a step whose largest row is in a smaller bucket: that bucket compiled by then
            met = bucket_length(int(by_step[step]["batch/row_tokens_max"]), buckets)
            assert met == 96 or any(b == met and s <= step for b, s in uses), (step, met, uses)
        compiled_at.update({s: b for b, s in uses})
        # the seconds of those compiles are logged with the steps that ran them, and nowhere else
        assert {s for s in steps if "perf/compile_s" in by_step[s]} == {s for _, s in uses}
    assert compiled_at, "no row needed a smaller bucket: the test did not exercise the compile on first use"
    assert all(by_step[s]["perf/compile_s"] > 0 for s in compiled_at)
    # graphs stay bounded: no step compiled anything but a bucket it met for the first time
    assert [m["perf/recompile_count"] for m in metrics] == [0] * len(metrics)
    met = {bucket_length(int(m["batch/row_tokens_max"]), buckets) for m in metrics}
    assert len(met) >= 2, met  # the rows really landed in different buckets
    for m in metrics:  # padding to the bucket, as the row lengths say
        n = m["batch/row_tokens_max"]
        assert m["batch/pad_frac"] == pytest.approx(1 - n / bucket_length(int(n), buckets))


@pytest.mark.slow  # torch.compile on two ranks, and the same run eager
def test_two_ranks_compile_a_bucket_on_first_use_together_and_train_the_eager_numbers(tmp_path):
    """Rows of one micro-batch differ in length between ranks, and a compile runs a forward/backward (FSDP2
    all-gathers and reduce-scatters): every rank compiles the buckets any rank's row first needs, at the same
    step and in the same order, between micro-batches of a step (gradient accumulation), without changing the
    step's update."""
    runs = {}
    for name, train in {
        "eager": dict(compile=False),
        "compiled": dict(compile=True, compile_backend="aot_eager", length_buckets=4),
    }.items():
        (tmp_path / name).mkdir()
        write_samples(tmp_path / name / "samples.arrow", 40)
        # bounds no ratio reaches: the synthetic rows' terms (sampler log-prob -1, far from a random model's) are not
        # masked, so a compile whose gradient leaked into the step would change grad_norm
        train.update(clip_min=1e-9, clip_max=1e9)
        runs[name] = run(tmp_path / name, 2, max_steps=4, gradient_accumulation_steps=2, **train)
    log = (tmp_path / "compiled" / "log").read_text()
    uses = first_uses(log, 0)
    assert uses and first_uses(log, 1) == uses, log[-4000:]  # the same buckets at the same steps, same order
    assert log.count("compiled length bucket 96 (the top: full rows)") == 2  # one per rank
    assert len(runs["compiled"]) == len(runs["eager"]) == 4
    for m in runs["compiled"]:
        assert m["perf/recompile_count"] == 0, m["step"]
    for a, b in zip(runs["compiled"], runs["eager"]):  # padding to the buckets and the synthetic rows change nothing
        for key in ("loss", "grad_norm", "entropy", "sampling/importance_sampling_ratio/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


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
