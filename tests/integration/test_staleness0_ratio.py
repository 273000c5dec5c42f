"""Trainer and sampler compute the same distribution: at staleness 0 the importance ratio is 1.

Real pieces end to end on CPU in fp32: the embedded server samples (temperature 0.7, top log-probs),
the real rollout loop turns groups into samples, the trainer (torchrun) forwards them as tree rows
before any update. Each sampled token's ratio π/μ must be 1 up to float error, so the logged
``sampling/importance_sampling_ratio/staleness0_mean`` is within 1e-3 of 1 (the issue-12 goal; seed 2
held 0.9993-1.0004 on GPUs).
"""

from __future__ import annotations

import subprocess

import pytest
import yaml
from rollout_helpers import run_count_groups
from serving_helpers import embedded_server
from trainer_helpers import read_jsonl, torchrun, trainer_config

from grpo_core.packing import write_samples_ipc

TEMPERATURE, TOP, COMPLETION = 0.7, 4, 40


@pytest.mark.slow  # server, rollout and trainer end to end; test_logprob_parity holds the parity in the default tier
def test_staleness0_ratio_is_one_on_the_embedded_server_in_fp32(tmp_path):
    with embedded_server(tmp_path / "server") as server:  # model.dtype auto: float32 on CPU
        samples, _ = run_count_groups(
            server.url,
            4,
            max_completion_length=COMPLETION,
            num_sampler_logprobs=TOP,
            num_generations=4,
            temperature=TEMPERATURE,
        )
    assert samples.num_rows == 16 and set(samples.column("policy_version").to_pylist()) == {0}
    write_samples_ipc(tmp_path / "samples.arrow", samples)
    config = trainer_config(tmp_path, tmp_path / "samples.arrow", max_steps=1, score_centering=True)
    cfg = yaml.safe_load(config.read_text())
    cfg["server"]["max_model_len"] = 256
    cfg["rollout"].update(num_sampler_logprobs=TOP, temperature=TEMPERATURE, max_completion_length=COMPLETION)
    cfg["packing"]["token_budget"] = 4096
    config.write_text(yaml.safe_dump(cfg))
    with open(tmp_path / "log", "w") as log:
        code = torchrun(config, 1, stdout=log, stderr=subprocess.STDOUT).wait(timeout=600)
    assert code == 0, (tmp_path / "log").read_text()[-4000:]
    (step,) = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert step["batch/samples_per_step"] == 16 and step["sample/staleness_max"] == 0  # every sample, fresh
    assert step["sampling/importance_sampling_ratio/staleness0_token_count"] == step["batch/trained_tokens_per_step"]
    assert abs(step["sampling/importance_sampling_ratio/staleness0_mean"] - 1) < 1e-3
    assert abs(step["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3
    assert step["sampling/sampling_logp_difference/max"] < 1e-4  # token by token, not only on average


def test_run_level_staleness0_ratio_weighs_every_fresh_token_the_same():
    """benchmarks/gpu_e2e.py's figure: a step with one fresh token is one token, not half the run."""
    import importlib.util

    from trainer_helpers import ROOT

    spec = importlib.util.spec_from_file_location("gpu_e2e", ROOT / "benchmarks" / "gpu_e2e.py")
    gpu_e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_e2e)
    key = "sampling/importance_sampling_ratio/staleness0_"
    records = [
        {"step": 1, key + "mean": 1.0, key + "token_count": 999.0},
        {"step": 2, key + "mean": 2.0, key + "token_count": 1.0},
    ]
    figures = gpu_e2e.figures(records, warmup=0)
    assert figures["is_ratio_staleness0_mean"] == pytest.approx((999 * 1.0 + 1 * 2.0) / 1000)
    assert figures["staleness0_tokens"] == 1000
