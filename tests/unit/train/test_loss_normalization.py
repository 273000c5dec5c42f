"""The loss is normalised by the trained tokens of the whole optimizer step (DESIGN.md §5 "Loss", revised 2026-12):
however the packer splits one step's samples into micro-batches and ranks, the gradient is the one of
``-(1/N) Σ term`` over all N trained tokens of the step. Checked against float64 references written from the
formula: in-process on the packed rows, and end to end through the trainer under torchrun (1 and 2 ranks)."""

import subprocess

import numpy as np
import pytest
import torch
from test_loss import grads, model64, packed_loss, reference_loss, samples_with_sampler
from trainer_helpers import read_jsonl, torchrun, trainer_config

from grpo_core.packing import Sample, get_packer, write_samples_ipc
from grpo_core.train.loss import LossSettings, loss_normalisers


def split(samples, num_ranks, budget):
    """The micro-batches the token-budget batcher makes of ``samples``: per micro-batch, per rank, the samples."""
    batcher = get_packer("rust").batcher(num_ranks, budget)
    by_id = {s.sample_id: s for s in samples}
    mbs = batcher.push_samples(samples) + batcher.finish()
    return [[[by_id[i] for i in row.samples.column("sample_id").to_pylist()] for row in mb] for mb in mbs]


def step_gradient(model, micro_batches, num_ranks, settings, normalization):
    """The step's gradient as the trainer forms it: each rank backpropagates each of its rows with the micro-batch's
    divisor, gradients accumulate over micro-batches, and FSDP averages them over ranks (sum / num_ranks)."""
    terms = [sum(s.num_trained for row in mb for s in row) for mb in micro_batches]
    total = None
    for mb, norm in zip(micro_batches, loss_normalisers(terms, num_ranks, normalization)):
        for row in mb:
            if row:
                g = grads(model, packed_loss(model, row, settings, norm)[0])
                total = g if total is None else total + g
    return total / num_ranks


def two_groups(model):
    """Two groups of five samples of 2-6 trained tokens (sample ids 0-9)."""
    samples = samples_with_sampler(model, np.random.default_rng(5)) + samples_with_sampler(
        model, np.random.default_rng(6)
    )
    for i, s in enumerate(samples):
        s.sample_id, s.group_id = i, i // 5
    return samples


def test_step_gradient_does_not_depend_on_the_split():
    settings = LossSettings()  # score centering; the divisor does not depend on the per-term formula
    model = model64()
    samples = two_groups(model)
    num_trained = sum(s.num_trained for s in samples)
    g_ref = grads(model, reference_loss(model, samples, settings, float(num_trained)))
    assert g_ref.abs().max() > 1e-4  # a real gradient
    splits = {(1, 1024): 1, (1, 24): 3, (2, 1024): 1, (2, 24): 2}  # (ranks, token budget): micro-batches
    for (num_ranks, budget), num_mbs in splits.items():
        mbs = split(samples, num_ranks, budget)
        assert len(mbs) == num_mbs, (num_ranks, budget, len(mbs))  # the split really happened
        assert sorted(s.sample_id for mb in mbs for row in mb for s in row) == sorted(s.sample_id for s in samples)
        g = step_gradient(model, mbs, num_ranks, settings, "step_tokens")
        torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-6, msg=f"{num_ranks} ranks, {num_mbs} micro-batches")


def test_micro_batch_normalization_is_the_mean_of_micro_batch_means():
    """The former rule, kept as ``train.loss_normalization: micro_batch``: reference = mean over micro-batches of
    each one's per-token mean; on an uneven split it differs from the step's per-token mean."""
    settings = LossSettings()
    model = model64()
    samples = samples_with_sampler(model, np.random.default_rng(5))
    mbs = split(samples, 1, 24)
    sizes = [sum(s.num_trained for s in mb[0]) for mb in mbs]
    assert len(set(sizes)) > 1, sizes  # uneven micro-batches
    ref = sum(grads(model, reference_loss(model, mb[0], settings, float(n * len(mbs)))) for mb, n in zip(mbs, sizes))
    torch.testing.assert_close(step_gradient(model, mbs, 1, settings, "micro_batch"), ref, atol=1e-6, rtol=1e-6)
    step = grads(model, reference_loss(model, samples, settings, float(sum(sizes))))
    assert (ref - step).norm() > 1e-3 * step.norm()


def test_normalisers_refuse_an_unknown_rule():
    with pytest.raises(ValueError, match="train.loss_normalization"):
        loss_normalisers([3], 1, "sequence")
    assert loss_normalisers([0, 0], 2) == [0.5, 0.5]  # a step without a trained token divides by 1, never 0


# ---- end to end: the trainer under torchrun ------------------------------------------------------------------

COMPLETION_LENGTHS = [14, 1, 6]  # per group (+1 for odd members): uneven micro-batches
# (ranks, gradient_accumulation_steps, token budget) -> the step's split, checked in its metrics
RUNS = [(1, 1, 256), (1, 3, 59), (2, 2, 40)]


def tiny_model64():
    from transformers import AutoModelForCausalLM

    from grpo_core.config import ModelConfig
    from grpo_core.models import resolve_model_dir

    path = resolve_model_dir(ModelConfig(name="tiny-qwen3"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").eval()


def sampler_samples(model, rng):
    """Three groups of four; sampler log-probs = the model's own (float64) + N(0, 0.05) noise, so every ratio is
    near 1 and kept; advantages -1.5 … 1.5 per group."""
    samples = []
    for p, length in enumerate(COMPLETION_LENGTHS):
        prompt = rng.integers(0, model.config.vocab_size, 6).tolist()
        for g in range(4):
            ids = prompt + rng.integers(0, model.config.vocab_size, length + g % 2).tolist()
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
            lp = [0.0] * 6 + [float(logp[t - 1, ids[t]]) + rng.normal(0, 0.05) for t in range(6, len(ids))]
            mask = [0] * 6 + [1] * (len(ids) - 6)
            samples.append(
                Sample.build(ids, mask, lp, sample_id=len(samples), group_id=p, prompt_index=p, advantage=g - 1.5)
            )
    return samples


def formula_loss_and_grad_norm(model, samples, epsilon=0.2):
    """float64, sample by sample: ``L = -(1/N) Σ_t min(r_t A, clip(r_t, 1-ε, 1+ε) A)`` over the N trained tokens
    (MIS range [0.5, 5]), and ``‖∇L‖``."""
    model.zero_grad()
    num_trained = sum(s.num_trained for s in samples)
    total = 0.0
    for s in samples:
        ids = torch.as_tensor(s.input_ids, dtype=torch.long)
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0], -1)
        for t in np.nonzero(s.completion_mask)[0]:
            r = torch.exp(logp[t - 1, ids[t]] - float(s.sampler_logprobs[t]))
            assert 0.5 <= float(r.detach()) <= 5.0
            total = total + torch.minimum(r * s.advantage, r.clamp(1 - epsilon, 1 + epsilon) * s.advantage)
    loss = -total / num_trained
    loss.backward()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss), float(norm)


def test_trainer_step_loss_and_gradient_norm_do_not_depend_on_micro_batches_or_ranks(tmp_path):
    model = tiny_model64()
    samples = sampler_samples(model, np.random.default_rng(0))
    ref_loss, ref_norm = formula_loss_and_grad_norm(model, samples)
    path = tmp_path / "samples.arrow"
    write_samples_ipc(path, samples)
    for nproc, gas, budget in RUNS:
        run = tmp_path / f"ranks{nproc}-gas{gas}"
        run.mkdir()
        config = trainer_config(
            run, path, max_steps=1, gradient_accumulation_steps=gas, max_grad_norm=0.0, learning_rate=1e-6
        )
        config.write_text(config.read_text().replace("token_budget: 96", f"token_budget: {budget}"))
        with open(run / "log", "w") as log:
            code = torchrun(config, nproc, stdout=log, stderr=subprocess.STDOUT).wait(timeout=600)
        assert code == 0, (run / "log").read_text()[-4000:]
        (step,) = read_jsonl(run / "out" / "metrics.jsonl")
        assert step["batch/samples_per_step"] == len(samples)  # the whole step, split as intended
        assert step["batch/microbatches_per_step"] == gas
        assert step["batch/trained_tokens_per_step"] == sum(s.num_trained for s in samples)
        assert step["loss"] == pytest.approx(ref_loss, rel=1e-4), (nproc, gas)
        assert step["grad_norm"] == pytest.approx(ref_norm, rel=1e-4), (nproc, gas)
