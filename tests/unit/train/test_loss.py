"""GRPO loss: gradients of the packed loss equal a straightforward per-sample
implementation in float64, and known cases behave as the formulas say."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from grpo_core.packing import Sample, TokenLists, get_packer
from grpo_core.train.attention import TREE_ATTENTION, TreeMask, register_tree_attention
from grpo_core.train.loss import LossSettings, grpo_loss
from grpo_core.train.policy import row_logprobs

VOCAB, K = 53, 4


def model64():
    register_tree_attention()
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=TREE_ATTENTION).double()


def samples_with_sampler(model, rng):
    """Samples whose sampler log-probs are the model's own, perturbed, with top-k."""
    prompt = rng.integers(0, VOCAB, 6).tolist()
    out = []
    for i in range(5):
        ids = prompt + rng.integers(0, VOCAB, int(rng.integers(2, 7))).tolist()
        t = torch.as_tensor(ids)[None]
        model.config._attn_implementation = "sdpa"
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=t).logits[0], -1)
        model.config._attn_implementation = TREE_ATTENTION
        noise = torch.as_tensor(rng.normal(0, 0.3, logp.shape))
        mu = torch.log_softmax(logp + noise, -1)  # the "sampler"
        lp = np.zeros(len(ids), np.float32)
        topk_ids = np.zeros((len(ids), K), np.int32)
        topk_lp = np.zeros((len(ids), K), np.float32)
        for p in range(1, len(ids)):
            lp[p] = mu[p - 1, ids[p]]
            v = torch.topk(mu[p - 1], K)
            topk_ids[p], topk_lp[p] = v.indices.numpy(), v.values.numpy()
        s = Sample.build(
            ids,
            [0] * len(prompt) + [1] * (len(ids) - len(prompt)),
            lp,
            sample_id=i,
            group_id=0,
            advantage=float(rng.normal()),
        )
        s.sampler_topk = TokenLists(
            np.arange(0, K * len(ids) + 1, K, dtype=np.int32), topk_ids.ravel(), topk_lp.ravel()
        )
        out.append(s)
    return out


def reference_loss(model, samples, settings, normaliser):
    """Per sample, plain causal attention, the manual's gradient formula with stop-gradients."""
    model.config._attn_implementation = "sdpa"
    total = 0.0
    for s in samples:
        ids = torch.as_tensor(s.input_ids, dtype=torch.long)
        logp_all = torch.log_softmax(model(input_ids=ids[None]).logits[0], -1)
        for t in np.nonzero(s.completion_mask)[0]:
            logp = logp_all[t - 1, ids[t]]
            mu = float(s.sampler_logprobs[t])
            r = torch.exp(logp.detach() - mu)
            if not (settings.clip_min <= r <= settings.clip_max):
                continue
            if settings.score_centering:
                v_ids, v_mu = s.sampler_topk.entry(t)
                centre = 0.0
                for v, m in zip(v_ids.tolist(), v_mu.tolist()):
                    lv = logp_all[t - 1, v]
                    rv = torch.exp(lv.detach() - m)
                    f = rv if settings.clip_min <= rv <= settings.clip_max else 0.0
                    centre = centre + np.exp(m) * f * lv
                total = total + s.advantage * (r * logp - centre)
            else:
                ratio = torch.exp(logp - mu)
                eh = settings.epsilon_high or settings.epsilon
                total = total + torch.minimum(
                    ratio * s.advantage, ratio.clamp(1 - settings.epsilon, 1 + eh) * s.advantage
                )
    model.config._attn_implementation = TREE_ATTENTION
    return -total / normaliser


def packed_loss(model, samples, settings, normaliser):
    row = get_packer("rust").pack_row(samples, 1024)

    def col(n):
        return torch.from_numpy(row.column(n).copy())

    topk = row.loss.column("sampler_topk_ids")
    topk_ids = torch.as_tensor(np.stack(topk.to_numpy(zero_copy_only=False)), dtype=torch.long)
    topk_mu = torch.as_tensor(
        np.stack(row.loss.column("sampler_topk_logprobs").to_numpy(zero_copy_only=False)), dtype=torch.float64
    )
    out = row_logprobs(
        model,
        col("input_ids").long(),
        col("position_ids").long(),
        TreeMask(col("subtree_end")),
        col("token_index").long(),
        col("target_id").long(),
        topk_ids=topk_ids,
        chunk_size=5,
    )
    loss, stats = grpo_loss(
        out.logprobs,
        col("sampler_logprob").double(),
        col("advantage").double(),
        normaliser,
        settings,
        out.topk_logprobs,
        topk_mu,
    )
    return loss, stats


def grads(model, loss):
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize(
    "settings",
    [
        LossSettings(),
        LossSettings(clip_min=0.9, clip_max=1.1),
        LossSettings(score_centering=False, epsilon=0.1, epsilon_high=0.3),
    ],
)
def test_packed_gradient_equals_per_sample_reference(settings):
    model = model64()
    samples = samples_with_sampler(model, np.random.default_rng(3))
    normaliser = 2.0 * sum(s.num_trained for s in samples)  # e.g. two ranks' worth
    loss, stats = packed_loss(model, samples, settings, normaliser)
    g_packed = grads(model, loss)
    g_ref = grads(model, reference_loss(model, samples, settings, normaliser))
    assert g_packed.abs().max() > 1e-4  # a real gradient
    torch.testing.assert_close(g_packed, g_ref, atol=1e-5, rtol=1e-5)
    if settings.clip_min == 0.9:
        assert 0 < stats["masked"].mean() < 1  # the narrow range really masks some tokens


def test_ratio_one_clipped_surrogate_is_minus_mean_advantage():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, stats = grpo_loss(logp, logp.detach(), adv, 3.0, LossSettings(score_centering=False))
    assert loss.item() == pytest.approx(-adv.mean().item())
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv / 3)
    assert stats["ratio"].tolist() == [1.0, 1.0, 1.0]


def test_advantage_sign_sets_direction_and_masked_tokens_contribute_nothing():
    logp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    mu = torch.tensor([-1.0, -1.0, -3.0])  # third ratio = e^2 ≈ 7.4 > clip_max 5
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss, stats = grpo_loss(logp, mu, adv, 3.0, LossSettings(score_centering=False))
    loss.backward()
    assert logp.grad[0] < 0 < logp.grad[1]  # descent raises logπ for A > 0, lowers it for A < 0
    assert logp.grad[2] == 0
    assert stats["masked"].tolist() == [0.0, 0.0, 1.0]


def test_score_centering_needs_topk():
    with pytest.raises(ValueError, match="top-k"):
        grpo_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), 2.0, LossSettings())


def test_logprobs_renormalise_over_the_sampling_mask():
    from grpo_core.train.logprobs import candidate_mask, projected_logprobs

    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    targets = torch.tensor([2, 5, 7])
    # term 0: candidates {2, 3, 9}; term 1: full vocabulary (empty entry); term 2: {7}
    offsets, ids = torch.tensor([0, 3, 3, 4]), torch.tensor([2, 3, 9, 7])
    out = projected_logprobs(
        hidden, weight, targets, temperature=0.7, candidates=candidate_mask(offsets, ids, 11), chunk_size=2
    )
    logits = hidden @ weight.T / 0.7
    expected = torch.stack(
        [
            torch.log_softmax(logits[0, [2, 3, 9]], -1)[0],
            torch.log_softmax(logits[1], -1)[5],
            torch.tensor(0.0, dtype=torch.float64),  # the only candidate has probability 1
        ]
    )
    torch.testing.assert_close(out.logprobs.double(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("score_centering", [True, False])
@pytest.mark.parametrize("bad", [-9999.0, float("nan"), float("-inf")])
def test_sampler_logprob_floor_or_nan_gives_finite_loss_and_gradient_equal_to_dropping_the_term(score_centering, bad):
    # vLLM reports -9999 for a token outside its candidate set: log π − log μ ≈ 9999 overflows exp().
    # Expected: exactly the loss and gradient of the same batch without that term (same normaliser).
    torch.manual_seed(0)
    logits = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    targets, topk_ids = torch.tensor([1, 2, 3, 4]), torch.tensor([[1, 0, 5], [2, 1, 0], [3, 2, 1], [4, 0, 2]])
    mu = torch.log_softmax(torch.randn(4, 6, dtype=torch.float64), -1)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=torch.float64)
    # Wide ranges: every unpoisoned term is kept and moves the weights (ratios here are far from 1).
    settings = LossSettings(
        score_centering=score_centering, clip_min=0.01, clip_max=100.0, epsilon=0.99, epsilon_high=100.0
    )

    def loss_and_grad(rows, poison):
        logits.grad = None
        logp = torch.log_softmax(logits, -1)
        sampler = mu.gather(1, targets[:, None])[:, 0].clone()
        sampler_topk = mu.gather(1, topk_ids).clone()
        if poison:
            sampler[2] = bad  # the sampled token of term 2
            sampler_topk[0, 2] = bad  # one top-k entry of term 0 (its own term stays)
        rows = torch.as_tensor(rows)
        loss, _ = grpo_loss(
            logp.gather(1, targets[:, None])[:, 0][rows],
            sampler[rows],
            adv[rows],
            4.0,
            settings,
            logp.gather(1, topk_ids)[rows] if score_centering else None,
            sampler_topk[rows] if score_centering else None,
        )
        loss.backward()
        return loss.detach(), logits.grad.clone()

    loss, grad = loss_and_grad([0, 1, 2, 3], poison=True)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    # Term 2 drops out whole; term 0 keeps its sampled token and loses only the poisoned top-k entry.
    ref_loss, ref_grad = _reference_without_poison(logits, mu, targets, topk_ids, adv, settings, score_centering)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    assert grad[2].abs().sum() == 0 and (grad[[0, 1, 3]].abs().sum(-1) > 1e-6).all()


def _reference_without_poison(logits, mu, targets, topk_ids, adv, settings, score_centering):
    """The same loss written out per term with the poisoned pieces left out by hand (no masking code)."""
    logits.grad = None
    logp = torch.log_softmax(logits, -1)
    total = 0.0
    for t in (0, 1, 3):  # term 2 dropped
        lp, m = logp[t, targets[t]], mu[t, targets[t]]
        ratio = torch.exp(lp - m)
        if score_centering:
            ids = [v for j, v in enumerate(topk_ids[t].tolist()) if not (t == 0 and j == 2)]
            centre = sum(
                torch.exp(logp[t, v])
                for v in ids
                if settings.clip_min <= float(torch.exp(logp[t, v] - mu[t, v]).detach()) <= settings.clip_max
            )
            total = total + adv[t] * (ratio - centre)
        else:
            eh = settings.epsilon_high or settings.epsilon
            total = total + torch.minimum(ratio * adv[t], ratio.clamp(1 - settings.epsilon, 1 + eh) * adv[t])
    loss = -total / 4.0
    loss.backward()
    return loss.detach(), logits.grad.clone()
