"""Off-policy corrections of the trainer/sampler mismatch (issue 27, item 2), each against a float64 reference written
from its source's formula, with r_t = π_t/μ_t (grpo-flow's old policy is the sampler's, μ):

* IcePop (Ring-1T, inclusionAI 2025): a token whose ratio k_t lies outside [α, β] is dropped, M(k) = k·1[α ≤ k ≤ β]:
  the existing masked-importance-sampling range ``[train.clip_min, train.clip_max]`` (defaults 0.5, 5 = the paper's
  α, β).
* Truncated IS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"):
  min(π_old/μ, C)·∇ of the PPO term; at the step's first gradient π_old = π, so a token's gradient is
  −min(r_t, C)·A_t/N (``train.tis_cap``).
* Sequence and geometric masks (Liu, Li et al. 2025, "When Speed Kills Stability"): a sequence whose ratio Π_t r_t
  (``sequence``) or geometric mean exp(mean_t log r_t) (``geometric``) is outside [lo, hi] gets no loss.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_core.config import TrainConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.train.logprobs import LossTerms, fused_grpo_loss
from grpo_core.train.loss import LossSettings, grpo_loss, sequence_mask_log_ratios

# Sequences of trained terms: (ratios π/μ, advantage).
SEQUENCES = [
    ([1.5, 1.1, 1.0], 1.0),  # Π = 1.65, geometric mean 1.18
    ([3.0, 0.9], 2.0),  # Π = 2.7, geometric mean 1.64; r = 3 above a TIS cap of 2
    ([0.7, 0.75, 0.8, 0.7], -1.0),  # Π = 0.29, geometric mean 0.74
    ([0.9, 8.0, 1.2], -0.5),  # 8.0 outside the token range [0.5, 5]; Π = 8.64, geometric mean 2.05
    ([1.01, 0.99, 1.0], 0.7),  # Π ≈ 1, geometric mean ≈ 1
]
# A surrogate whose clip never binds inside the token range, so each kept term's gradient is its IS weight · A.
WIDE = {"score_centering": False, "epsilon": 10.0, "epsilon_high": 10.0}


def _terms() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ratios = [r for rs, _ in SEQUENCES for r in rs]
    sampler = -torch.linspace(0.3, 2.5, len(ratios), dtype=torch.float64)
    policy = sampler + torch.tensor([math.log(r) for r in ratios], dtype=torch.float64)
    adv = torch.tensor([a for rs, a in SEQUENCES for _ in rs], dtype=torch.float64)
    index = torch.tensor([i for i, (rs, _) in enumerate(SEQUENCES) for _ in rs])
    return policy, sampler, adv, index


def _reference(
    normaliser: float, alpha: float = 0.5, beta: float = 5.0, cap: float | None = None, seq: str = "none", band=(0, 0)
) -> tuple[float, list[float]]:
    """float64 loss and dL/dlog π_t of the unclipped surrogate r·A under the corrections, from the formulas."""
    loss, grad = 0.0, []
    for ratios, a in SEQUENCES:
        logs = [math.log(r) for r in ratios]
        value = {"sequence": math.fsum(logs), "geometric": math.fsum(logs) / len(logs)}.get(seq)
        seq_kept = value is None or band[0] <= math.exp(value) <= band[1]
        for r in ratios:
            if not (seq_kept and alpha <= r <= beta):  # IcePop's M(k) = 0, or a masked sequence
                grad.append(0.0)
                continue
            w = r if cap is None else min(r, cap)  # the (truncated) importance weight of the token
            loss -= w * a / normaliser  # value of sg(w/r)·r·A at π = π_old
            grad.append(-w * a / normaliser)
    return loss, grad


def _run(settings: LossSettings, normaliser: float) -> tuple[float, list[float], dict[str, torch.Tensor]]:
    policy, sampler, adv, index = _terms()
    seq = None
    if settings.sequence_mask != "none":
        seq = sequence_mask_log_ratios(policy - sampler, index, settings)
    policy = policy.clone().requires_grad_()
    loss, stats = grpo_loss(policy, sampler, adv, normaliser, settings, sequence_mask_log_ratio=seq)
    loss.backward()
    assert policy.grad is not None
    return loss.item(), policy.grad.tolist(), stats


def test_the_token_mask_is_icepop():
    settings = LossSettings(clip_min=0.5, clip_max=5.0, **WIDE)
    loss, grad, stats = _run(settings, 9.0)
    want_loss, want_grad = _reference(9.0, alpha=0.5, beta=5.0)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    assert grad == pytest.approx(want_grad, rel=1e-12, abs=1e-15)
    assert grad[10] == 0.0 and stats["masked"].tolist()[10] == 1.0  # r = 8 dropped, every other token trains
    assert sum(g != 0 for g in grad) == len(grad) - 1


def test_truncated_is_caps_the_importance_weight():
    settings = LossSettings(tis_cap=2.0, **WIDE)
    loss, grad, _ = _run(settings, 9.0)
    want_loss, want_grad = _reference(9.0, cap=2.0)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    assert grad == pytest.approx(want_grad, rel=1e-12, abs=1e-15)
    # The set-up has a capped token: r = 3 (A = 2) gets weight 2, not 3; the others keep r.
    assert grad[3] == pytest.approx(-2.0 * 2.0 / 9.0, rel=1e-12)
    assert _reference(9.0)[1][3] == pytest.approx(-3.0 * 2.0 / 9.0, rel=1e-12)
    off_loss, off_grad, _ = _run(LossSettings(**WIDE), 9.0)
    assert off_grad == pytest.approx(_reference(9.0)[1], rel=1e-12, abs=1e-15)  # None = off


def test_truncated_is_leaves_an_overflowing_ratio_masked_and_finite():
    policy = torch.tensor([-1.0, -0.5], dtype=torch.float64, requires_grad=True)
    sampler = torch.tensor([-9999.0, -0.5], dtype=torch.float64)  # vLLM's floor: exp(log π − log μ) overflows
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss, _ = grpo_loss(policy, sampler, adv, 2.0, LossSettings(tis_cap=2.0, **WIDE))
    loss.backward()
    assert policy.grad is not None and policy.grad.tolist() == [0.0, pytest.approx(-0.5, rel=1e-12)]


@pytest.mark.parametrize(
    "kind,masked",
    [("sequence", [False, True, True, True, False]), ("geometric", [False, False, False, True, False])],
)
def test_sequence_masks_drop_whole_sequences_outside_the_band(kind, masked):
    band = (0.5, 2.0)
    settings = LossSettings(sequence_mask=kind, sequence_mask_min=band[0], sequence_mask_max=band[1], **WIDE)
    loss, grad, stats = _run(settings, 9.0)
    want_loss, want_grad = _reference(9.0, seq=kind, band=band)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    assert grad == pytest.approx(want_grad, rel=1e-12, abs=1e-15)
    # The expected sequences are masked whole (the set-up's products and means straddle the band), the rest train.
    start = 0
    for (ratios, _), out in zip(SEQUENCES, masked, strict=True):
        part = grad[start : start + len(ratios)]
        assert all(g == 0 for g in part) if out else sum(g != 0 for g in part) == len(part)
        assert stats["masked"][start : start + len(ratios)].tolist() == [1.0 if out else 0.0] * len(ratios)
        start += len(ratios)


def test_geometric_and_sequence_values_differ_and_a_non_finite_term_masks_its_sequence():
    policy, sampler, _, index = _terms()
    seq = sequence_mask_log_ratios(policy - sampler, index, LossSettings(sequence_mask="sequence"))
    geo = sequence_mask_log_ratios(policy - sampler, index, LossSettings(sequence_mask="geometric"))
    assert seq[0].item() == pytest.approx(math.log(1.5 * 1.1 * 1.0), rel=1e-12)
    assert geo[0].item() == pytest.approx(math.log(1.5 * 1.1 * 1.0) / 3, rel=1e-12)
    log_ratio = (policy - sampler).clone()
    log_ratio[4] = float("inf")
    geo = sequence_mask_log_ratios(log_ratio, index, LossSettings(sequence_mask="geometric"))
    assert math.isnan(geo[3].item()) and math.isfinite(geo[0].item())
    with pytest.raises(ValueError, match="sequence_mask_log_ratio"):
        grpo_loss(policy, sampler, policy, 1.0, LossSettings(sequence_mask="geometric", **WIDE))


def test_fused_head_geometric_mask_and_truncated_is_match_a_float64_reference_when_chunks_split_sequences():
    gen = torch.Generator().manual_seed(2)
    m, h, v, temperature = 12, 16, 40, 1.0
    hidden = torch.randn(m, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) * 0.3
    targets = torch.randint(0, v, (m,), generator=gen)
    index = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    true_lp = torch.log_softmax(hidden @ weight.T / temperature, -1).gather(1, targets[:, None])[:, 0]
    # log r: sequence 0 near 1 with one token at r = e^1 (capped at 2), sequence 1 geometric mean e^0.4 (masked)
    shift = torch.tensor([0.02, 1.0, -0.3, -0.2, -0.3, 0.4, 0.35, 0.45, -0.05, 0.0, 0.02, 0.01], dtype=torch.float64)
    sampler = true_lp - shift
    adv = torch.tensor([1.0] * 5 + [2.0] * 3 + [-1.0] * 4, dtype=torch.float64)
    settings = LossSettings(
        sequence_mask="geometric", sequence_mask_min=0.8, sequence_mask_max=1.25, tis_cap=2.0, **WIDE
    )

    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = torch.log_softmax(h64 @ w64.T / temperature, -1).gather(1, targets[:, None])[:, 0]
    r = torch.exp(lp - sampler)
    ref = torch.zeros((), dtype=torch.float64)
    kept_sequences = 0
    for i in range(3):  # Σ over kept sequences of min(1, C/sg(r))·r·A (gradient min(r, C)·A·∇log π)
        sel = index == i
        geo = math.exp(float((lp - sampler)[sel].mean().detach()))
        if not 0.8 <= geo <= 1.25:
            continue
        kept_sequences += 1
        w = torch.clamp(2.0 / r[sel].detach(), max=1.0)
        ref = ref - (w * r[sel] * adv[sel]).sum() / 5.0
    ref.backward()
    assert kept_sequences == 2 and bool((r > 2.0).any())  # one sequence masked, one weight capped

    h32, w32 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    terms = LossTerms(targets, sampler.float(), adv.float(), sequence_index=index)
    res = fused_grpo_loss(h32, w32, terms, 5.0, settings, temperature, chunk_size=3)  # chunks split sequences
    res.loss.backward()
    assert res.loss.item() == pytest.approx(ref.item(), rel=1e-4)
    assert h32.grad is not None and w32.grad is not None and h64.grad is not None and w64.grad is not None
    torch.testing.assert_close(h32.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w32.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)
    assert res.stats["masked"].tolist() == [0.0] * 5 + [1.0] * 3 + [0.0] * 4


def test_the_settings_default_to_off_and_a_bad_band_is_refused():
    tc = TrainConfig()
    assert tc.tis_cap is None and tc.sequence_mask == "none"
    cfg = load_config(None, ["train.tis_cap=2", "train.sequence_mask=geometric"])
    assert cfg.train.tis_cap == 2.0 and cfg.train.sequence_mask == "geometric"
    with pytest.raises(ConfigError, match="train.sequence_mask_min"):
        load_config(None, ["train.sequence_mask_min=1.001", "train.sequence_mask_max=0.999"])
