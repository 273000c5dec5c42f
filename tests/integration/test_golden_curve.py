"""The golden curve: loss, grad norm, entropy and the importance-sampling ratio per optimizer step of a short
deterministic CPU run of ``configs/tiny.yaml``'s trainer, stored in ``tests/assets/golden_tiny.json``.

A refactor that should not change numbers must reproduce it (STYLE.md, as torchtitan keeps such curves). The run is
the trainer of ``configs/tiny.yaml`` (its model, token budget, learning rate, loss settings; one rank on gloo) fed a
fixed, seeded sample file instead of the rollout: the rollout is asynchronous, so which groups a step of a full
``grpo train`` holds depends on timing and load (two full runs of the tiny config on one idle machine happened to
compose their 4 steps alike — rewards 0.4943 and 0.4648 at steps 1 and 3, losses within 1e-7 — but nothing makes a
loaded CI box do the same), while the trainer's arithmetic on given samples is exact.

A change that alters the math on purpose regenerates the file and says so in its commit:

    .venv/bin/python tests/integration/test_golden_curve.py --write

Tolerance: two runs on one machine agree bit for bit (measured, 2026-12-05); the stored tolerance (relative 1e-4,
absolute 1e-6) leaves room for another CPU's float summation order only.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from trainer_helpers import ROOT, read_jsonl, torchrun, write_samples

GOLDEN = ROOT / "tests" / "assets" / "golden_tiny.json"
METRICS = ("loss", "grad_norm", "entropy", "sampling/importance_sampling_ratio/mean")
STEPS = 6
REL_TOL, ABS_TOL = 1e-4, 1e-6


def run_curve(tmp: Path) -> list[dict[str, float]]:
    """Train ``STEPS`` steps of the tiny config's trainer on a seeded sample file; returns ``METRICS`` per step."""
    samples = write_samples(tmp / "samples.arrow", num_prompts=48, group_size=4, seed=0)
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["train"].update(
        output_dir=str(tmp / "out"), samples_path=str(samples), max_steps=STEPS, save_steps=STEPS, device="cpu"
    )
    cfg["tracking"] = {**cfg.get("tracking", {}), "dir": str(tmp / "mlflow")}
    config = tmp / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = torchrun(config, 1)
    assert proc.wait(timeout=600) == 0, "the golden run's trainer failed"
    records = read_jsonl(tmp / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "every step trained once"
    return [{name: float(r[name]) for name in METRICS} for r in records]


def test_the_tiny_trainer_reproduces_the_golden_curve(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    curve = run_curve(tmp_path)
    assert len(curve) == len(golden["steps"])
    for step, (got, want) in enumerate(zip(curve, golden["steps"], strict=True), start=1):
        for name in METRICS:
            assert math.isclose(got[name], want[name], rel_tol=golden["rel_tol"], abs_tol=golden["abs_tol"]), (
                f"step {step} {name}: {got[name]!r} != golden {want[name]!r} (tests/assets/golden_tiny.json; "
                "regenerate with `python tests/integration/test_golden_curve.py --write` only for a change of the math)"
            )
    losses = [s["loss"] for s in curve]
    assert all(math.isfinite(x) for x in losses) and len(set(losses)) > 1, "the curve moves: a real run, not a stub"


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/integration/test_golden_curve.py --write")
    with tempfile.TemporaryDirectory() as tmp:
        steps = run_curve(Path(tmp))
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(
        json.dumps({"rel_tol": REL_TOL, "abs_tol": ABS_TOL, "metrics": METRICS, "steps": steps}, indent=1)
    )
    print(f"wrote {GOLDEN}")
