"""The KL term to a reference policy (``train.kl_coef``, issue 27 item 2), against float64 references written from
the formula: the objective of each kept trained token loses β·k3 with k3 = π_ref/π − log(π_ref/π) − 1 (Schulman
2020, "Approximating KL Divergence"; DeepSeekMath, Shao et al. 2024, eq. 4), so the loss gains β·k3/N and its
derivative in log π is β·(1 − π_ref/π)/N. The reference is the base model with the LoRA adapter disabled, or a
frozen copy of the initial weights for full fine-tuning."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_loss import grads, model64, samples_with_sampler

from grpo_core.config import TrainConfig, load_config
from grpo_core.packing import get_packer
from grpo_core.train.loss import LossSettings, grpo_loss
from grpo_core.train.policy import Policy
from grpo_core.train.rows import to_tensors
from grpo_core.train.trainer import Trainer

WIDE = {"score_centering": False, "epsilon": 10.0, "epsilon_high": 10.0}


def test_the_kl_term_is_k3_on_the_kept_tokens():
    policy = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.2], dtype=torch.float64)
    sampler = policy - torch.tensor([0.1, -0.2, 0.0, math.log(8.0), 0.05], dtype=torch.float64)  # 4th: r = 8, masked
    ref = torch.tensor([-1.5, -1.0, -0.5, -0.1, -2.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 0.3, 2.0, -1.0], dtype=torch.float64)
    beta, n = 0.04, 7.0
    lp = policy.clone().requires_grad_()
    loss, stats = grpo_loss(lp, sampler, adv, n, LossSettings(kl_coef=beta, **WIDE), ref_logprobs=ref)
    loss.backward()
    want_loss, want_grad, want_kl = 0.0, [], []
    for p, mu, q, a in zip(policy.tolist(), sampler.tolist(), ref.tolist(), adv.tolist(), strict=True):
        r = math.exp(p - mu)
        if not 0.5 <= r <= 5.0:
            want_grad.append(0.0)
            want_kl.append(0.0)
            continue
        k3 = math.exp(q - p) - (q - p) - 1
        want_kl.append(k3)
        want_loss += (-r * a + beta * k3) / n
        want_grad.append((-r * a + beta * (1 - math.exp(q - p))) / n)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert lp.grad is not None and lp.grad.tolist() == pytest.approx(want_grad, rel=1e-12, abs=1e-15)
    assert stats["kl"].tolist() == pytest.approx(want_kl, rel=1e-12, abs=1e-15)
    assert all(k > 0 for i, k in enumerate(want_kl) if i not in (2, 3))  # the set-up has real KL; equal log-probs: 0
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, sampler, adv, n, LossSettings(kl_coef=beta, **WIDE))


def _lora_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model64(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a trained adapter: B ≠ 0, so the policy differs from the base model
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    return model.double()


def _reference_loss(policy_model, ref_model, samples, beta, normaliser):
    """float64 per-sample forwards with causal attention: −(r·A − β·k3)/N summed over the kept tokens."""
    total = torch.zeros((), dtype=torch.float64)
    kls = []
    for s in samples:
        ids = torch.as_tensor(s.input_ids, dtype=torch.long)
        logp_all = torch.log_softmax(policy_model(input_ids=ids[None]).logits[0], -1)
        with torch.no_grad():
            ref_all = torch.log_softmax(ref_model(input_ids=ids[None]).logits[0], -1)
        for t in np.nonzero(s.completion_mask)[0]:
            logp, q = logp_all[t - 1, ids[t]], ref_all[t - 1, ids[t]]
            r = torch.exp(logp - float(s.sampler_logprobs[t]))
            if not 0.5 <= float(r.detach()) <= 5.0:
                continue
            k3 = torch.exp(q - logp) - (q - logp) - 1
            kls.append(float(k3.detach()))
            total = total + r * s.advantage - beta * k3
    return -total / normaliser, kls


def _trainer(policy, reference, beta):
    """The trainer's own reference_logprobs, on a stand-in holding only what it reads."""
    return SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(kl_coef=beta)), policy=policy, reference=reference)


@pytest.mark.parametrize("lora", [True, False])
def test_trainer_kl_on_a_tiny_model_matches_a_float64_reference(lora):
    beta = 0.3
    model = _lora_model() if lora else model64()
    initial = model64()  # the reference, built on its own: the base model / the initial weights (same seed)
    if not lora:
        with torch.no_grad():  # training moved the weights away from the frozen initial copy
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    samples = samples_with_sampler(model, np.random.default_rng(5))
    normaliser = float(sum(s.num_trained for s in samples))
    row = get_packer("rust").pack_row(samples, 1024)
    rt = to_tensors(row, torch.device("cpu"))
    settings = LossSettings(kl_coef=beta, **WIDE)

    policy = Policy(model, chunk_size=4)
    stand_in = _trainer(policy, None if lora else Policy(initial, chunk_size=4).requires_grad_(False), beta)
    ref_lp = Trainer.reference_logprobs(stand_in, rt)  # type: ignore[arg-type]
    assert ref_lp is not None and not ref_lp.requires_grad
    res = policy.grpo_loss(rt, settings, normaliser, ref_lp)
    g_packed = grads(model, res.loss)

    model.config._attn_implementation = initial.config._attn_implementation = "sdpa"
    want, kls = _reference_loss(model, initial, samples, beta, normaliser)
    g_ref = grads(model, want)
    assert res.loss.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(g_packed, g_ref, atol=1e-6, rtol=1e-5)
    kept = res.stats["masked"] == 0
    assert res.stats["kl"][kept].sum().item() == pytest.approx(math.fsum(kls), rel=1e-5)
    assert min(kls) > 1e-6  # the reference really differs from the policy (the adapter was disabled)
    # With the adapter back on, the policy's own log-probs are not the reference's.
    assert not torch.allclose(policy.logprobs(rt).logprobs, ref_lp)


def test_kl_off_computes_no_reference_and_the_setting_is_read():
    assert Trainer.reference_logprobs(_trainer(None, None, 0.0), None) is None  # type: ignore[arg-type]
    assert TrainConfig().kl_coef == 0.0
    assert load_config(None, ["train.kl_coef=0.04"]).train.kl_coef == 0.04
    with pytest.raises(ValueError, match="no LoRA adapter"):
        Policy(model64()).adapter_disabled()


@pytest.mark.parametrize("lora", [False, True])
def test_a_trainer_run_with_kl_logs_zero_kl_at_the_first_step_and_more_after(tmp_path, lora):
    """The real trainer (configs/tiny.yaml's, on a seeded sample file): at step 1 the policy is the reference (the
    initial weights; a fresh LoRA adapter's B is 0), so k3 is 0 up to rounding; after updates it is not."""
    import yaml
    from trainer_helpers import ROOT, read_jsonl, torchrun, write_samples

    samples = write_samples(tmp_path / "samples.arrow", num_prompts=24, group_size=4, seed=0)
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["train"].update(
        output_dir=str(tmp_path / "out"), samples_path=str(samples), max_steps=3, save_steps=3, device="cpu"
    )
    cfg["train"].update(kl_coef=0.1, learning_rate=1e-3, lora={"enabled": lora, "r": 4})
    cfg["tracking"] = {**cfg.get("tracking", {}), "dir": str(tmp_path / "mlflow")}
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = torchrun(config, 1)
    assert proc.wait(timeout=600) == 0, "the trainer failed"
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    kl = [r["kl"] for r in records]
    assert abs(kl[0]) < 1e-6 and kl[2] > 1e-6, kl
    assert all(math.isfinite(r["loss"]) for r in records)
