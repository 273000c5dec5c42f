"""The issue-12 diagnostic end to end on CPU in fp32: the rollout's opt-in dump and benchmarks/logprob_parity.py.

The real rollout loop samples from the embedded server (tiny model, temperature 0.7, top log-probs) with
``GRPO_DEBUG_ROLLOUT_DUMP`` set; the script then recomputes every sampled token's log-prob with a plain
transformers forward (fp32, eager, one sequence at a time) and through the trainer's own path (Trainer,
planner, packer, tree rows, fused head). Independent facts checked: the dump holds exactly the rollouts that
were generated (policy version 0, capped at the count asked for); a plain forward of the same weights gives
the sampler's log-probs (mean exp(Δ) within 1e-3 of 1); the trainer's packed rows give the plain forward's
log-probs token by token (max |Δ| < 1e-4 in fp32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from rollout_helpers import run_count_groups
from serving_helpers import embedded_server
from trainer_helpers import ROOT

from grpo_core.config import ModelConfig
from grpo_core.models import resolve_model_dir
from grpo_core.rollout.debug_dump import COUNT_ENV, DUMP_ENV, RolloutDump

TEMPERATURE, TOP, COMPLETION, G = 0.7, 4, 24, 4


def test_dump_and_parity_script_on_the_embedded_server_in_fp32(tmp_path, monkeypatch):
    dump = tmp_path / "rollouts.jsonl"
    monkeypatch.setenv(DUMP_ENV, str(dump))
    monkeypatch.setenv(COUNT_ENV, "10")  # 3 groups of 4 rollouts: the cap cuts the third group
    with embedded_server(tmp_path / "server") as server:  # model.dtype auto: float32 on CPU
        _, loop = run_count_groups(
            server.url,
            3,
            max_completion_length=COMPLETION,
            num_sampler_logprobs=TOP,
            num_generations=G,
            temperature=TEMPERATURE,
        )
    assert loop.debug_dump is not None and loop.debug_dump.written == 10  # the variable reached the loop
    lines = [json.loads(x) for x in dump.read_text().splitlines()]
    assert len(lines) == 10
    assert [(x["group_id"], x["rollout"]) for x in lines] == [(g, r) for g in range(3) for r in range(G)][:10]
    for x in lines:
        assert x["policy_version"] == 0 and x["sampling"]["temperature"] == TEMPERATURE
        assert set(x["finish_reasons"]) <= {"stop", "length"}
        (seq,) = x["sequences"]
        assert seq["input_ids"] == x["prompt_ids"] + x["completion_ids"]
        assert sum(seq["completion_mask"]) == len(x["completion_ids"]) > 0
        assert all(len(e) >= TOP for e, m in zip(seq["topk"], seq["completion_mask"]) if m)  # + the sampled id

    model_dir = resolve_model_dir(ModelConfig(name="tiny-qwen3"))
    out = tmp_path / "parity.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop(DUMP_ENV)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "logprob_parity.py"),
            "--dump",
            str(dump),
            "--model-dir",
            str(model_dir),
            "--device",
            "cpu",
            "--token-budget",
            "256",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "worst tokens, trainer_vs_hf_fp32" in proc.stdout
    res = json.loads(out.read_text())
    tokens = sum(sum(x["sequences"][0]["completion_mask"]) for x in lines)
    assert res["setup"]["sampled_tokens"] == res["setup"]["trainer_tokens"] == tokens  # every token, both paths
    assert res["setup"]["rows"] >= 2  # several packed rows (budget 256): the row mapping is exercised
    c = res["comparisons"]
    assert c["hf_fp32_vs_sampler"]["tokens"] == tokens
    assert abs(c["hf_fp32_vs_sampler"]["ratio_mean"] - 1) < 1e-3
    assert c["trainer_vs_hf_fp32"]["abs_logp_diff_max"] < 1e-4
    assert c["trainer_loss_ratio"]["ratio_mean"] == pytest.approx(c["trainer_vs_sampler"]["ratio_mean"], abs=1e-6)
    assert (
        c["hf_bf16_vs_sampler"]["abs_logp_diff_max"] > c["hf_fp32_vs_sampler"]["abs_logp_diff_max"]
    )  # bf16 does differ


def test_the_dump_is_off_without_the_variable_and_refuses_a_bad_count(monkeypatch):
    from grpo_core.config import RolloutConfig

    monkeypatch.delenv(DUMP_ENV, raising=False)
    assert RolloutDump.from_env(RolloutConfig()) is None
    monkeypatch.setenv(DUMP_ENV, "/tmp/x.jsonl")
    monkeypatch.setenv(COUNT_ENV, "0")
    with pytest.raises(ValueError, match=COUNT_ENV):
        RolloutDump.from_env(RolloutConfig())
