"""The metrics that tell a user where the time goes (issue 25, item 8), as the seed reference manual defines them:
present in ``metrics.jsonl`` with values consistent with their definitions, and aggregated over a logging window by
the rule of DESIGN.md §7 (``…max`` / ``…min`` names keep the extreme).

The trainer's side runs the trainer (one CPU process, a tiny random model) on a seeded sample file whose sampler
log-probs are spread around the model's, so tokens fall outside the trust region on both sides; the rollout's side
runs the rollout process on the embedded server and pulls from it over Flight, as the trainer does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from serving_helpers import TINY, embedded_server
from trainer_helpers import VOCAB, read_jsonl

from grpo_core.config import RunConfig
from grpo_core.packing import Sample, samples_from_arrow, write_samples_ipc
from grpo_core.rollout import start_rollout_process
from grpo_core.tracking.metrics import MetricWindow, aggregation
from grpo_core.transport.flight_client import FlightSource

#: The manual's names (its "metrics" section) this project logs from the trainer on CPU.
TRAINER_NAMES = (
    "sample/forwarded_tokens_mean",
    "sample/forwarded_tokens_max",
    "sample/trained_tokens_mean",
    "perf/fwd_s",
    "perf/fwd_bwd_s",
    "perf/step_s",
    "perf/wall_clock_forwarded_tokens_per_s",
    "perf/wall_clock_trained_tokens_per_s",
    "perf/fwd_bwd_forwarded_tokens_per_s",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
)
#: …and from the rollout (through the sample source's metrics).
ROLLOUT_NAMES = (
    "rollout/score_queue_size",
    "rollout/score_wait_s",
    "rollout/score_s",
    "rollout/score_block_s",
    "sample/time_in_queue_s",
)
#: Every name of the manual with a max/min last part among them, and the extreme its window keeps.
EXTREMES = {
    "sample/forwarded_tokens_max": max,
    "clip_ratio/low_min": min,
    "clip_ratio/high_max": max,
    "sample/staleness_max": max,
    "rollout/turns_max": max,
    "rollout/drift_tokens_max": max,
    "sampling/importance_sampling_ratio/min": min,
    "sampling/importance_sampling_ratio/max": max,
    "sampling/sampling_logp_difference/max": max,
    "batch/row_tokens_max": max,
    "completions/max_length": max,
    "completions/min_length": min,
}
PROMPT_LENGTHS, COMPLETION_LENGTHS = (4, 12), (2, 10)  # [low, high) of the sample file


def test_window_keeps_the_extremes_of_max_and_min_names_and_means_the_rest():
    values = [3.0, 7.0, 5.0]
    for name, extreme in EXTREMES.items():
        assert aggregation(name) == extreme.__name__, name
        w = MetricWindow()
        for v in values:
            w.add(name, v)
        assert w.flush() == {name: extreme(values)}, name
    for name in (
        "rollout/score_queue_size",
        "rollout/score_wait_s",
        "rollout/score_block_s",
        "sample/time_in_queue_s",
        "perf/fwd_s",
    ):
        w = MetricWindow()
        for v in values:
            w.add(name, v)
        assert aggregation(name) == "mean" and w.flush() == {name: 5.0}, name
    w = MetricWindow()  # the rates and per-sample means recorded as totals: total / total over the window
    w.rate("perf/wall_clock_forwarded_tokens_per_s", 300, 1.0)
    w.rate("perf/wall_clock_forwarded_tokens_per_s", 100, 3.0)
    w.rate("sample/trained_tokens_mean", 40, 4)  # 4 samples of 10 tokens, then 1 of 60
    w.rate("sample/trained_tokens_mean", 60, 1)
    assert w.flush() == {"perf/wall_clock_forwarded_tokens_per_s": 100.0, "sample/trained_tokens_mean": 20.0}


def _samples(num_prompts: int, group_size: int, seed: int) -> list[Sample]:
    """Groups sharing a prompt; sampler log-probs ~ N(log 1/VOCAB, 0.3): a random tiny model's own log-probs sit
    near log 1/VOCAB, so its ratio π/μ ≈ exp(N(0, 0.3)) falls below 0.8 or above 1.28 for about a fifth of the
    tokens each (the trust region of epsilon 0.2)."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(num_prompts):
        prompt = rng.integers(0, VOCAB, int(rng.integers(*PROMPT_LENGTHS))).tolist()
        for g in range(group_size):
            completion = rng.integers(0, VOCAB, int(rng.integers(*COMPLETION_LENGTHS))).tolist()
            lp = [0.0] * len(prompt) + rng.normal(-np.log(VOCAB), 0.3, len(completion)).tolist()
            out.append(
                Sample.build(
                    prompt + completion,
                    [0] * len(prompt) + [1] * len(completion),
                    lp,
                    sample_id=len(out),
                    group_id=p,
                    prompt_index=p,
                    advantage=float(g - (group_size - 1) / 2),
                )
            )
    return out


def test_trainer_logs_per_sample_tokens_forward_time_wall_clock_rates_and_clip_extremes(tmp_path):
    samples = _samples(num_prompts=12, group_size=4, seed=3)
    write_samples_ipc(tmp_path / "samples.arrow", samples)
    cfg = {
        "model": {"name": "tiny-qwen3"},
        "server": {"max_model_len": 128},
        "rollout": {"max_completion_length": 32, "num_sampler_logprobs": 0},
        "packing": {"token_budget": 64},
        "train": {
            "output_dir": str(tmp_path / "out"),
            "samples_path": str(tmp_path / "samples.arrow"),
            "score_centering": False,
            "device": "cpu",
            "max_steps": 100,  # more than the file holds: the run trains every sample once, then ends
            "save_steps": 100,
            "logging_steps": 1,
            "flush_partial_after_s": 0.5,
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    done = subprocess.run(
        [sys.executable, "-m", "grpo_core.train", "--config", str(tmp_path / "run.yaml")],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert len(records) >= 2, "the run trained several steps"
    for r in records:
        missing = [n for n in TRAINER_NAMES if n not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        # nested intervals on one clock: the forwards lie inside forward + backward, which lies inside the step
        assert 0 < r["perf/fwd_s"] <= r["perf/fwd_bwd_s"] <= r["perf/step_s"]
        forwarded, trained = r["batch/forwarded_tokens_per_step"], r["batch/trained_tokens_per_step"]
        assert r["perf/wall_clock_forwarded_tokens_per_s"] == pytest.approx(forwarded / r["perf/step_s"])
        assert r["perf/wall_clock_trained_tokens_per_s"] == pytest.approx(trained / r["perf/step_s"])
        assert r["perf/wall_clock_forwarded_tokens_per_s"] <= r["perf/fwd_bwd_forwarded_tokens_per_s"]
        assert r["perf/wall_clock_trained_tokens_per_s"] <= r["perf/wall_clock_forwarded_tokens_per_s"]
        # per sample: its own prompt + completion; the file's prompts are 4-11 tokens, completions 2-9
        assert r["sample/forwarded_tokens_max"] >= r["sample/forwarded_tokens_mean"]
        assert COMPLETION_LENGTHS[0] <= r["sample/trained_tokens_mean"] < COMPLETION_LENGTHS[1]
        prompt_mean = r["sample/forwarded_tokens_mean"] - r["sample/trained_tokens_mean"]
        assert PROMPT_LENGTHS[0] <= prompt_mean < PROMPT_LENGTHS[1]
        assert 0 <= r["clip_ratio/low_min"] <= r["clip_ratio/low_mean"] <= 1
        assert 0 <= r["clip_ratio/high_mean"] <= r["clip_ratio/high_max"] <= 1
        assert "perf/wall_clock_mfu" not in r and "perf/fwd_bwd_mfu" not in r, "MFU is logged only on a known GPU"
    # the whole file was trained once: the per-sample means weighted by each step's samples give its totals
    assert sum(r["batch/samples_per_step"] for r in records) == len(samples)
    total = sum(r["sample/forwarded_tokens_mean"] * r["batch/samples_per_step"] for r in records)
    assert total == pytest.approx(sum(s.num_tokens for s in samples))
    total = sum(r["sample/trained_tokens_mean"] * r["batch/samples_per_step"] for r in records)
    assert total == pytest.approx(sum(int(s.completion_mask.sum()) for s in samples))
    assert max(r["sample/forwarded_tokens_max"] for r in records) == max(s.num_tokens for s in samples)
    # the sampler log-probs put tokens outside the region on both sides, unevenly per completion
    assert any(r["clip_ratio/low_mean"] > 0 for r in records) and any(r["clip_ratio/high_mean"] > 0 for r in records)
    assert any(r["clip_ratio/high_max"] > r["clip_ratio/high_mean"] for r in records)
    assert any(r["clip_ratio/low_min"] < r["clip_ratio/low_mean"] for r in records)


def test_rollout_logs_the_score_stage_and_the_time_samples_wait_in_the_queue(tmp_path):
    config = RunConfig(
        model={"name": TINY},
        server={"max_model_len": 512},
        rollout={
            "num_generations": 3,
            "max_completion_length": 8,
            "num_sampler_logprobs": 2,
            "rollout_worker_timeout_s": 20,
            "dataset": "rollout_helpers:rows",
            "dataset_kwargs": {"n": 6},
            "reward_functions": ["rollout_helpers:parity_reward"],
        },
    )
    helpers = {
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[1] / "support"), os.environ.get("PYTHONPATH")])
        )
    }
    with embedded_server(tmp_path / "server", max_model_len=512) as server:
        started = start_rollout_process(config, [server.url], tmp_path, env=helpers)
        source = FlightSource(
            started.wait_location(timeout_s=300),
            max_staleness=config.rollout.max_staleness,
            timeout_s=config.rollout.rollout_worker_timeout_s,
            process=started.process,
            error_path=started.error_path,
        )
        try:
            pulled, windows = [], []
            while True:
                batch = source.pull(0, timeout_s=60)
                pulled += samples_from_arrow(batch.samples)
                windows.append(source.metrics())
                if batch.exhausted:
                    break
        finally:
            source.close()
            started.stop()
    assert pulled, "the rollout produced samples"
    seen = {name for w in windows for name in w}
    assert set(ROLLOUT_NAMES) <= seen, f"missing: {set(ROLLOUT_NAMES) - seen}"
    for w in windows:
        if "rollout/score_queue_size" in w:  # groups found unscored: whole groups, at most the prompts
            assert 0 <= w["rollout/score_queue_size"] < 6
        if "rollout/score_wait_s" in w:
            assert w["rollout/score_wait_s"] >= 0
        if "rollout/score_block_s" in w:  # 6 groups, 16 may wait to be scored: the queue never fills
            assert w["rollout/score_block_s"] == 0
        if "sample/time_in_queue_s" in w:
            assert w["sample/time_in_queue_s"] >= 0
    print(json.dumps({k: v for w in windows for k, v in w.items() if k in ROLLOUT_NAMES}))
