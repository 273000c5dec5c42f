"""The fused log-prob head (grpo_core.train.logprobs.fused_grpo_loss) against today's path:
checkpointed chunked log-probs (projected_logprobs) + grpo_loss + autograd, in fp32 on CPU.

Log-probs must agree to 1e-5 and the gradients of the hidden states and of the output
embedding to 1e-5 relative, in both loss modes, with temperature, top-k padding and
sampling-mask renormalisation."""

import numpy as np
import pytest
import torch

from grpo_core.train.logprobs import LossTerms, candidate_mask, fused_grpo_loss, projected_logprobs
from grpo_core.train.loss import LossSettings, grpo_loss

V, H, M, K = 67, 16, 23, 5


def case(seed: int, with_topk: bool, with_mask: bool):
    """Hidden states, weight and loss terms whose sampler log-probs are near the policy's own."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    targets = torch.randint(0, V, (M,), generator=g)
    candidates = None
    if with_mask:  # per term a random candidate set holding the target; every 4th term unmasked (empty entry)
        sets = []
        for i in range(M):
            ids = set() if i % 4 == 0 else {int(targets[i])} | set(torch.randint(0, V, (9,), generator=g).tolist())
            sets.append(sorted(ids))
        offsets = torch.tensor(np.cumsum([0] + [len(s) for s in sets]), dtype=torch.int64)
        candidates = (offsets, torch.tensor([i for s in sets for i in s], dtype=torch.int64))
    with torch.no_grad():
        ref = projected_logprobs(hidden, weight, targets, 0.7, chunk_size=M)
    sampler = ref.logprobs + 0.3 * torch.randn(M, generator=g)
    topk_ids = topk_lp = None
    if with_topk:
        topk_ids = torch.randint(0, V, (M, K), generator=g)
        topk_ids[::3, -2:] = -1  # padding
        topk_lp = torch.log_softmax(torch.randn(M, V, generator=g), -1).gather(1, topk_ids.clamp_min(0))
        topk_lp = topk_lp.masked_fill(topk_ids < 0, float("-inf"))
    adv = torch.randn(M, generator=g)
    return hidden, weight, LossTerms(targets, sampler, adv, topk_ids, topk_lp, candidates)


def reference(hidden, weight, terms, settings, temperature, normaliser):
    """Today's path: differentiable chunked log-probs, then the loss, then autograd."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    cand = None if terms.candidates is None else candidate_mask(*terms.candidates, V)
    out = projected_logprobs(h, w, terms.targets, temperature, terms.topk_ids, cand, chunk_size=7)
    loss, stats = grpo_loss(
        out.logprobs,
        terms.sampler_logprobs,
        terms.advantages,
        normaliser,
        settings,
        out.topk_logprobs,
        terms.sampler_topk_logprobs,
    )
    loss.backward()
    return loss.detach(), out, stats, h.grad, w.grad


def fused(hidden, weight, terms, settings, temperature, normaliser, chunk_size=6):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    res = fused_grpo_loss(h, w, terms, normaliser, settings, temperature, chunk_size)
    (res.loss * 1.5).backward()  # a non-unit upstream gradient is scaled in
    return res, h.grad / 1.5, w.grad / 1.5


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


SETTINGS = [
    LossSettings(),
    LossSettings(clip_min=0.8, clip_max=1.25),
    LossSettings(score_centering=False, epsilon=0.1, epsilon_high=0.3),
    LossSettings(score_centering=False, clip_min=0.8, clip_max=1.25),
]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_equals_chunked_logprobs_plus_loss(settings, with_mask, temperature):
    hidden, weight, terms = case(1, settings.score_centering, with_mask)
    loss_ref, out_ref, stats_ref, gh_ref, gw_ref = reference(hidden, weight, terms, settings, temperature, 40.0)
    res, gh, gw = fused(hidden, weight, terms, settings, temperature, 40.0)
    assert (res.logprobs.logprobs - out_ref.logprobs).abs().max() <= 1e-5
    assert (res.logprobs.entropy - out_ref.entropy).abs().max() <= 1e-5
    if settings.score_centering:
        finite = torch.isfinite(out_ref.topk_logprobs)
        assert torch.equal(finite, torch.isfinite(res.logprobs.topk_logprobs))  # padding and non-candidates
        assert (res.logprobs.topk_logprobs[finite] - out_ref.topk_logprobs[finite]).abs().max() <= 1e-5
    assert res.loss.item() == pytest.approx(loss_ref.item(), rel=1e-5, abs=1e-7)
    assert gh_ref.abs().max() > 1e-4 and gw_ref.abs().max() > 1e-4  # a real gradient
    assert rel(gh, gh_ref) <= 1e-5 and rel(gw, gw_ref) <= 1e-5
    for k in stats_ref:
        torch.testing.assert_close(res.stats[k], stats_ref[k], atol=1e-5, rtol=1e-5)
    if settings.clip_min == 0.8:
        assert 0 < stats_ref["masked"].mean() < 1  # the narrow range really masks some terms


@pytest.mark.parametrize("bad", [-9999.0, float("nan"), float("-inf"), None])
@pytest.mark.parametrize("score_centering", [True, False])
def test_masked_terms_contribute_exactly_nothing(bad, score_centering):
    """Terms outside the MIS range, or with a sampler log-prob at vLLM's -9999 floor, NaN or -inf, give exactly
    zero rows of dL/dhidden and a finite loss and gradient equal to today's path (select, never multiply)."""
    hidden, weight, terms = case(2, True, False)
    if bad is None:
        terms.sampler_logprobs[:5] = terms.sampler_logprobs[:5] + 10.0  # ratio e^-10: masked
    else:
        terms.sampler_logprobs[:5] = bad
        terms.sampler_topk_logprobs[5, 0] = bad  # one top-k entry of a kept term
    settings = LossSettings(score_centering=score_centering)
    loss_ref, _, _, gh_ref, gw_ref = reference(hidden, weight, terms, settings, 1.0, 10.0)
    res, gh, gw = fused(hidden, weight, terms, settings, 1.0, 10.0)
    assert torch.isfinite(res.loss) and torch.isfinite(gh).all() and torch.isfinite(gw).all()
    assert res.stats["masked"][:5].tolist() == [1.0] * 5
    assert torch.count_nonzero(gh[:5]) == 0 and torch.count_nonzero(gh[5:].abs().sum(1)) > 0
    assert res.loss.item() == pytest.approx(loss_ref.item(), rel=1e-5, abs=1e-7)
    assert rel(gh, gh_ref) <= 1e-5 and rel(gw, gw_ref) <= 1e-5


def test_frozen_weight_and_empty_row():
    hidden, weight, terms = case(3, True, True)
    h = hidden.clone().requires_grad_(True)
    res = fused_grpo_loss(h, weight, terms, 10.0, LossSettings(), 0.7, 4)  # LoRA: lm_head frozen
    res.loss.backward()
    _, _, _, gh_ref, _ = reference(hidden, weight, terms, LossSettings(), 0.7, 10.0)
    assert rel(h.grad, gh_ref) <= 1e-5
    empty = LossTerms(
        terms.targets[:0],
        terms.sampler_logprobs[:0],
        terms.advantages[:0],
        terms.topk_ids[:0],
        terms.sampler_topk_logprobs[:0],
    )
    h0, w0 = hidden[:0].clone().requires_grad_(True), weight.clone().requires_grad_(True)
    res0 = fused_grpo_loss(h0, w0, empty, 1.0, LossSettings())
    res0.loss.backward()
    assert res0.loss.item() == 0.0 and torch.count_nonzero(w0.grad) == 0
    assert res0.logprobs.logprobs.shape == (0,) and res0.logprobs.topk_logprobs.shape == (0, K)
    # a rank's empty row carries no top-k columns at all, with score centering on
    bare = LossTerms(terms.targets[:0], terms.sampler_logprobs[:0], terms.advantages[:0])
    res1 = fused_grpo_loss(hidden[:0].clone().requires_grad_(True), weight, bare, 1.0, LossSettings())
    assert res1.loss.item() == 0.0 and res1.stats["ratio"].shape == (0,)


def test_no_grad_gives_the_same_logprobs():
    hidden, weight, terms = case(4, True, True)
    with torch.no_grad():
        res = fused_grpo_loss(hidden, weight, terms, 10.0, LossSettings(), 0.7, 5)
    _, out_ref, _, _, _ = reference(hidden, weight, terms, LossSettings(), 0.7, 10.0)
    assert (res.logprobs.logprobs - out_ref.logprobs).abs().max() <= 1e-5
    assert not res.loss.requires_grad


def test_candidate_mask_rows_match_the_dense_mask():
    offsets, ids = torch.tensor([0, 3, 3, 4, 6]), torch.tensor([2, 3, 9, 7, 0, 1])
    full = candidate_mask(offsets, ids, 11)
    assert full.sum(1).tolist() == [3, 11, 1, 2]
    assert torch.equal(candidate_mask(offsets, ids, 11, 1, 3), full[1:3])


@pytest.mark.parametrize("fp32_logits", [False, True])
def test_bf16_head_logits_land_on_the_samplers_grid(fp32_logits):
    """vLLM 0.25.1 runs a generation model's lm_head in the model dtype: its log-probs are the log-softmax of
    ``F.linear(h, W)`` in bf16 (logits rounded to bf16). The trainer's head gives exactly those by default, and
    fp32-accumulated logits with ``fp32_logits`` (for a server whose head runs in fp32)."""
    torch.manual_seed(0)
    h = (torch.randn(48, 64) * 2).bfloat16()
    w = (torch.randn(500, 64) * 0.6).bfloat16()  # logits up to ~40: a bf16 step of 1/4 there
    t = torch.randint(0, 500, (48,))
    bf16_head = torch.nn.functional.linear(h, w).float().log_softmax(-1).gather(1, t[:, None]).squeeze(1)
    fp32_head = (h.double() @ w.double().T).log_softmax(-1).gather(1, t[:, None]).squeeze(1).float()
    assert (bf16_head - fp32_head).abs().max() > 0.05  # the two grids really differ here
    expected = fp32_head if fp32_logits else bf16_head
    terms = LossTerms(t, bf16_head.clone(), torch.ones(48))
    settings = LossSettings(score_centering=False)
    fused = fused_grpo_loss(h, w, terms, 48.0, settings, fp32_logits=fp32_logits).logprobs.logprobs
    chunked = projected_logprobs(h, w, t, chunk_size=16, fp32_logits=fp32_logits).logprobs
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked, expected, atol=1e-5, rtol=0)
