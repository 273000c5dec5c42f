"""benchmarks/trainer (``python -m benchmarks.trainer``) in its CPU form: the sweep's rows are the workload's samples
(plain rows hold them back to back, tree rows forward each group's prompt once) and it reports every figure."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from trainer_helpers import ROOT

sys.path.append(str(ROOT))  # the benchmarks package, from the repository root
from benchmarks.trainer.sweep import tree_flop_ceiling


@pytest.mark.slow  # a benchmark smoke
def test_trainer_sweep_runs_on_cpu_and_reports_every_figure(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.trainer",
        "sweep",
        "--shapes",
        "tiny",
        "--modes",
        "eager",
        "--budget",
        "384",
        "--groups",
        "3",
        "--group-size",
        "4",
        "--steps",
        "2",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fwd tok/s" in done.stdout and "tree/(ratio·plain)" in done.stdout  # the table
    check, plain, tree = json.loads((tmp_path / "trainer_sweep.json").read_text())
    assert check["eager_logp_max_abs"] <= 1e-5 and check["eager_grad_w_rel"] <= 1e-5  # fp32 on CPU
    assert (plain["row_kind"], tree["row_kind"]) == ("plain", "tree")
    # The workload: 3 groups of 4 samples, a 64-token prompt each, completions of 8-64 tokens.
    assert plain["packing_ratio"] == 1.0
    assert 1.0 < tree["packing_ratio"] < 4.0
    for r in (plain, tree):
        assert r["rows"] == 2 and len(r["step_times_s"]) == 2 and r["max_over_median"] >= 1.0
        assert np.isclose(r["raw_tokens_per_s"], r["forwarded_tokens_per_s"] * r["packing_ratio"])
        assert 0.0 <= r["pad_frac"] < 1.0 and r["warmup_s"] > 0
    assert np.isclose(tree["tree_over_ratio_x_plain"], tree["forwarded_tokens_per_s"] / plain["forwarded_tokens_per_s"])
    # A tree row trains a larger share of what it forwards, so its ceiling is below 1.
    assert (
        tree["trained_tokens_per_s"] / tree["forwarded_tokens_per_s"]
        > plain["trained_tokens_per_s"] / plain["forwarded_tokens_per_s"]
    )
    assert 0.0 < tree["tree_flop_ceiling"] < 1.0


def test_tree_flop_ceiling_of_qwen3_shapes():
    """By hand from the Qwen3 configs (hidden, layers, intermediate, q/kv heads × 128, vocabulary 151,936, tied
    embeddings) and the H200 sweep's trained ÷ forwarded shares (0.3587 plain, 0.7912 tree)."""

    def body(hidden, layers, inter, q_heads, kv_heads):
        q, kv = q_heads * 128, kv_heads * 128
        return layers * (2 * hidden * q + 2 * hidden * kv + 3 * hidden * inter)

    vocab = 151_936
    # 0.6B: (440.5M + 155.6M·0.3587) / (440.5M + 155.6M·0.7912) = 496.3 / 563.6
    assert abs(tree_flop_ceiling(body(1024, 28, 3072, 16, 8), vocab * 1024, 0.3587, 0.7912) - 0.8806) < 1e-3
    # 4B: (3,632M + 389.0M·0.3587) / (3,632M + 389.0M·0.7912)
    assert abs(tree_flop_ceiling(body(2560, 36, 9728, 32, 8), vocab * 2560, 0.3587, 0.7912) - 0.9573) < 1e-3
    assert tree_flop_ceiling(10, 5, 0.5, 0.5) == 1.0  # the same share trained: no head penalty
