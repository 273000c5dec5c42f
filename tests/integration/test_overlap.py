"""Overlapped training (issue 25, item 7; ``train.overlap_micro_batches``): a micro-batch's forward/backward runs as
soon as its rows are packed, while the step's later rows are still pulled, and the step's loss and update are those
of training the whole step at once.

- the provisional divisors and the rescale reproduce each rule's final divisor (the arithmetic of
  ``loss_normalisers``' definition, written out here);
- the trainer under torchrun (gloo, CPU; 1 and 2 ranks, 2 micro-batches per step, 3 steps) logs the same loss and
  gradient norm each step and ends with the same weights with overlap on and off (within 1e-6 relative);
- the first micro-batch's backward starts before the step's last pull (rank 0's event order, no clock).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from trainer_helpers import ROOT, read_jsonl, torchrun, trainer_config, write_samples

from grpo_core.train.loss import overlap_rescale, provisional_normaliser

NUM_PROMPTS = 12
GAS = 2


@pytest.mark.parametrize("normalization", ["step_tokens", "micro_batch"])
@pytest.mark.parametrize("terms", [[7, 3, 12], [5], [1, 0]])
@pytest.mark.parametrize("world_size", [1, 2])
def test_provisional_divisors_rescale_to_the_final_ones(normalization, terms, world_size):
    """Gradient accumulated = Σ_m g_m / p_m; times the rescale it must be Σ_m g_m / d_m with d_m the rule's
    divisor: N / W (step_tokens, N = Σ N_m) or N_m · M / W (micro_batch, M micro-batches), a count of 0 as 1."""
    planned = 3  # train.gradient_accumulation_steps; the step may end with fewer
    provisional = [provisional_normaliser(n, terms[0], planned, world_size, normalization) for n in terms]
    if normalization == "step_tokens":
        final = [max(sum(terms), 1) / world_size] * len(terms)
    else:
        final = [max(n, 1) * len(terms) / world_size for n in terms]
    scale = overlap_rescale(provisional, final)
    for p, d in zip(provisional, final):
        assert scale / p == pytest.approx(1 / d, rel=1e-12)


def test_a_rescale_that_cannot_be_exact_is_refused():
    with pytest.raises(ValueError, match="not one multiple"):
        overlap_rescale([1.0, 2.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="one provisional divisor per micro-batch"):
        overlap_rescale([1.0], [1.0, 1.0])


def run(tmp_path, nproc, overlap):
    run_dir = tmp_path / f"ranks{nproc}-overlap{overlap}"
    run_dir.mkdir()
    samples = write_samples(run_dir / "samples.arrow", NUM_PROMPTS)
    config = trainer_config(
        run_dir,
        samples,
        max_steps=3,
        save_steps=100,
        gradient_accumulation_steps=GAS,
        overlap_micro_batches=overlap,
        learning_rate=1e-4,
    )
    config.write_text(config.read_text().replace("token_budget: 96", "token_budget: 48"))
    with open(run_dir / "log", "w") as log:
        code = torchrun(config, nproc, stdout=log, stderr=subprocess.STDOUT).wait(timeout=600)
    log = (run_dir / "log").read_text()
    assert code == 0, log[-4000:]
    # the path asked for was taken
    assert ("train as soon as packed" if overlap else "train once the whole step is pulled") in log
    metrics = read_jsonl(run_dir / "out" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[0]["batch/microbatches_per_step"] == GAS  # steps of several micro-batches
    weights = load_file(run_dir / "out" / "final_model" / "model.safetensors")
    return metrics, weights


# One rank goes to the slow tier (two launches, ~20 s on the loaded CI box): the 2-rank case holds the same promise
# and more (the gradient shards' rescale after the reduce-scatter), and the 1-rank divisors stay checked by
# test_provisional_divisors_rescale_to_the_final_ones and test_a_streamed_step_holds_what_a_whole_step_holds.
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_overlap_trains_the_same_loss_and_weights(tmp_path, nproc):
    on_metrics, on_weights = run(tmp_path, nproc, True)
    off_metrics, off_weights = run(tmp_path, nproc, False)
    for on, off in zip(on_metrics, off_metrics):
        for key in ("batch/samples_per_step", "batch/microbatches_per_step"):  # the same steps
            assert on[key] == off[key], (on["step"], key)
        # the loss is a mean of terms of either sign (advantages -1.5 … 1.5) that mostly cancel: its rounding is
        # that of the terms, 1e-6 absolute (step 3, two AdamW steps in, 2 ranks: 6.7e-8 on -0.065)
        for key, tol in (("loss", 1e-6), ("grad_norm", 1e-9), ("entropy", 1e-9)):
            assert on[key] == pytest.approx(off[key], rel=1e-6, abs=tol), (on["step"], key)
    assert all(m["grad_norm"] > 0 and m["learning_rate"] > 0 for m in on_metrics)  # the weights moved
    assert on_weights.keys() == off_weights.keys()
    for name, w in off_weights.items():
        # relative to the tensor's largest weight: AdamW divides by sqrt(v) + 1e-8, so a gradient entry near 1e-8
        # turns fp32 rounding into a larger share of its update (1.06e-6 of the largest weight at lr 1e-3)
        diff = float((on_weights[name] - w).abs().max())
        assert diff <= 1e-6 * float(w.abs().max()), (name, diff)


EVENTS = """
import json, sys
from grpo_core.config import load_trainer_config
from grpo_core.train.distributed import init_world
from grpo_core.train.trainer import Trainer
from grpo_core.transport.file_source import ArrowFileSource

cfg = load_trainer_config(sys.argv[1])
trainer = Trainer(cfg, init_world("cpu"), ArrowFileSource(cfg.train.samples_path))
assert trainer.train_step()
print("EVENTS " + json.dumps(list(trainer.events)))
"""


def test_the_first_backward_starts_before_the_step_is_pulled(tmp_path):
    samples = write_samples(tmp_path / "samples.arrow", NUM_PROMPTS)
    config = trainer_config(tmp_path, samples, max_steps=1, gradient_accumulation_steps=3)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1", "RANK": "0"}
    out = subprocess.run(
        [sys.executable, "-c", EVENTS, str(config)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("EVENTS ")]
    events = [tuple(e) for e in json.loads(line.removeprefix("EVENTS "))]
    # the file source hands out one group per pull: the step of 3 rows of 96 tokens needs several
    pulls = [i for i, e in enumerate(events) if e[0] == "pull"]
    backwards = [i for i, e in enumerate(events) if e[0] == "backward"]
    assert [events[i][1] for i in backwards] == [0, 1, 2], events
    assert len(pulls) > 1, events
    assert backwards[0] < pulls[-1], f"the first backward came after the step's last pull: {events}"
    assert events.index(("micro_batch", 0)) < backwards[0]


def step_ids(step):
    return [[r.samples.column("sample_id").to_pylist() for r in mb] for mb in step.micro_batches]


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_a_streamed_step_holds_what_a_whole_step_holds(tmp_path, num_ranks):
    """Two planners over the same samples, one assembling whole steps (next_step), one handing out micro-batches as
    they are packed (stream_step): the same micro-batches, step by step, in the same order, until both end."""
    from grpo_core.train.checkpoint import PromptTracker
    from grpo_core.train.planner import Planner
    from grpo_core.transport.file_source import ArrowFileSource

    path = write_samples(tmp_path / "samples.arrow", NUM_PROMPTS)
    whole, streamed = (
        Planner(ArrowFileSource(path), num_ranks, 48, "rust", PromptTracker(), flush_after_s=0.0) for _ in range(2)
    )
    steps = 0
    while True:
        expected = whole.next_step(3, 0)
        stream, handed = streamed.stream_step(3, 0), []
        try:
            while True:
                handed.append(next(stream))
        except StopIteration as end:
            got = end.value
        if expected is None:
            assert got is None and not handed
            break
        assert handed == got.micro_batches
        assert step_ids(got) == step_ids(expected)
        assert got.stats == expected.stats
        whole.step_trained(expected)
        streamed.step_trained(got)
        steps += 1
    assert steps >= 2  # several steps were compared
