"""Algorithm variants (issue 27, item 2), each against a float64 reference written from its paper's formula.

* Dr. GRPO (Liu et al. 2025, §3.2): A = r − mean(r), no division by the group's std (``rollout.scale_rewards``).
* DAPO clip-higher (Yu et al. 2025, §3.1): min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A) with ε_high > ε_low.
* DAPO overlong filtering (§3.4): completions that hit the token limit get no loss (``mask_truncated_completions``).
* CISPO (MiniMax-M1, Chen et al. 2025, eq. 4): sg(clip(r, 1 − ε_low, 1 + ε_high))·A·log π.
* GSPO (Zheng et al. 2025, eq. 5-7): s_i = exp(mean over sequence i of log π − log μ), min(s_i·A, clip(s_i)·A),
  each sequence weighing its tokens over the step's (grpo-flow's token normalisation).
* The ``algorithm`` presets fill those fields in, and a field the config sets wins.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo_core.config import ALGORITHM_PRESETS, RolloutConfig, RunConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.rollout.loop import RolloutLoop
from grpo_core.rollout.rewards import group_advantages
from grpo_core.rollout.scoring import group_samples
from grpo_core.rollout.types import Rollout, RolloutGroup, TurnRecord, reconcile_turns
from grpo_core.train.logprobs import LossTerms, fused_grpo_loss
from grpo_core.train.loss import LossSettings, grpo_loss, in_clip_range, sequence_log_ratios

# -- advantages: GRPO and Dr. GRPO -------------------------------------------------------------------------------


def _reference_advantages(rewards: list[float], scale: str) -> list[float]:
    """float64, from the formulas: A_i = r_i − mean over the scored, divided by their population std for GRPO."""
    scored = [r for r in rewards if not math.isnan(r)]
    mean = math.fsum(scored) / len(scored)
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in scored) / len(scored))
    return [0.0 if math.isnan(r) else (r - mean) / (std if scale == "group" else 1.0) for r in rewards]


@pytest.mark.parametrize("scale", ["group", "none"])
def test_advantages_are_centred_and_divided_by_the_std_only_with_group_scaling(scale):
    rewards = [3.0, float("nan"), 0.5, 1.25, 7.0, 0.0]
    got = group_advantages(np.array(rewards), scale)
    want = _reference_advantages(rewards, scale)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # The two differ on this group (its std is not 1), so the setting really changes A.
    other = _reference_advantages(rewards, "none" if scale == "group" else "group")
    assert max(abs(a - b) for a, b in zip(want, other, strict=True)) > 0.5


def test_dr_grpo_advantages_keep_the_reward_scale_of_large_rewards():
    rewards = [1e30, 3e30, 2e30]  # the centring runs on rewards divided by the largest: no overflow, units kept
    np.testing.assert_allclose(group_advantages(np.array(rewards), "none"), [-1e30, 1e30, 0.0], rtol=1e-6, atol=1e24)


def test_the_rollout_loop_scales_advantages_as_its_config_says():
    group = SimpleNamespace(rewards=np.array([1.0, 0.0, 0.0, 0.0]))
    for scale, want in [("group", [math.sqrt(3), -1 / math.sqrt(3)]), ("none", [0.75, -0.25])]:
        loop = SimpleNamespace(config=RolloutConfig(scale_rewards=scale))
        got = RolloutLoop.compute_advantages(loop, group)  # type: ignore[arg-type]
        np.testing.assert_allclose(got, [want[0], want[1], want[1], want[1]], rtol=1e-6)


def test_unknown_reward_scaling_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="rollout.scale_rewards"):
        group_advantages(np.array([0.0, 1.0]), "batch")
    with pytest.raises(ConfigError, match="scale_rewards"):
        load_config(None, ["rollout.scale_rewards=batch"])


# -- overlong filtering ------------------------------------------------------------------------------------------


def _group(finishes: list[str]) -> RolloutGroup:
    rollouts, sequences = [], []
    for i, finish in enumerate(finishes):
        turn = TurnRecord([1, 2], [10 + i, 20 + i], [-0.5, -0.25], finish_reason=finish)
        rollouts.append(Rollout(completion=[], completion_ids=[10 + i, 20 + i], turns=[turn]))
        sequences.append(reconcile_turns([turn])[0])
    return RolloutGroup(
        prompt_index=3,
        row_index=3,
        epoch=0,
        row={},
        prompts=[[]] * len(finishes),
        rollouts=rollouts,
        sequences=sequences,
        policy_version=0,
        rewards=np.array([1.0, 0.0, 2.0, 0.5]),
    )


def test_truncated_completions_are_left_out_only_when_masking_is_on():
    group = _group(["stop", "length", "stop", "length"])
    advantages = group_advantages(group.rewards)  # computed over all four, truncated ones included
    kept = group_samples(group, advantages, with_topk=False, mask_truncated=True)
    assert [s.input_ids[-1] for s in kept] == [20, 22]  # rollouts 0 and 2 (stop); 1 and 3 hit the limit
    assert [s.advantage for s in kept] == [pytest.approx(float(advantages[0])), pytest.approx(float(advantages[2]))]
    everything = group_samples(group, advantages, with_topk=False)
    assert [s.input_ids[-1] for s in everything] == [20, 21, 22, 23]


# -- the token losses --------------------------------------------------------------------------------------------

# Ratios chosen to land in every region: masked below clip_min, clipped low, inside, between 1 + ε and
# 1 + ε_high, clipped high, far above 1 + ε_high but inside the MIS range, masked above clip_max, and a sampler
# log-prob at vLLM's −9999 floor (non-finite ratio: masked).
RATIOS = [0.3, 0.7, 0.95, 1.1, 1.25, 1.5, 3.0, 6.0]
ADVANTAGES = [1.0, -1.0, 0.5, -2.0, 1.5, 1.0, -0.5, 1.0]


def _terms(settings: LossSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sampler = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.7, -3.0, -1.2, -2.5, -9999.0], dtype=torch.float64)
    log_ratio = torch.tensor([math.log(r) for r in RATIOS] + [0.0], dtype=torch.float64)
    policy = sampler.clone()
    policy[:-1] += log_ratio[:-1]
    policy[-1] = -0.4
    adv = torch.tensor([*ADVANTAGES, 1.0], dtype=torch.float64)
    return policy, sampler, adv


def _reference(kind: str, settings: LossSettings, normaliser: float) -> tuple[float, list[float]]:
    """Loss and dL/dlog π per term in float64, from the papers' formulas (no autograd)."""
    policy, sampler, adv = (t.tolist() for t in _terms(settings))
    lo, hi = 1 - settings.epsilon, 1 + (settings.epsilon if settings.epsilon_high is None else settings.epsilon_high)
    loss, grad = 0.0, []
    for lp, mu, a in zip(policy, sampler, adv, strict=True):
        r = math.exp(lp - mu) if lp - mu < 700 else math.inf
        if not settings.clip_min <= r <= settings.clip_max:  # masked importance sampling: no loss, no gradient
            grad.append(0.0)
            continue
        if kind == "ppo":  # min(r A, clip(r) A); d/dlogπ of r A is r A, of the clipped branch 0
            clipped = min(max(r, lo), hi)
            term = min(r * a, clipped * a)
            loss -= term / normaliser
            grad.append(-r * a / normaliser if r * a <= clipped * a else 0.0)
        else:  # CISPO: sg(clip(r)) A log π; d/dlogπ = clip(r) A
            w = min(max(r, lo), hi)
            loss -= w * a * lp / normaliser
            grad.append(-w * a / normaliser)
    return loss, grad


def _run(settings: LossSettings, normaliser: float) -> tuple[float, list[float]]:
    policy, sampler, adv = _terms(settings)
    policy = policy.clone().requires_grad_()
    loss, _ = grpo_loss(policy, sampler, adv, normaliser, settings)
    loss.backward()
    assert policy.grad is not None
    return loss.item(), policy.grad.tolist()


def test_clip_higher_keeps_the_gradient_of_ratios_between_one_plus_epsilon_and_one_plus_epsilon_high():
    settings = LossSettings(score_centering=False, epsilon=0.2, epsilon_high=0.28)
    loss, grad = _run(settings, 7.0)
    want_loss, want_grad = _reference("ppo", settings, 7.0)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    assert grad == pytest.approx(want_grad, rel=1e-12, abs=1e-15)
    # The set-up covers the asymmetric band: r = 1.25 with A > 0 has a gradient here and none when symmetric.
    sym_grad = _reference("ppo", LossSettings(score_centering=False, epsilon=0.2), 7.0)[1]
    assert RATIOS[4] == 1.25 and ADVANTAGES[4] > 0 and grad[4] != 0.0 and sym_grad[4] == 0.0
    assert grad[-1] == 0.0 and all(math.isfinite(g) for g in grad)  # the -9999 floor is masked, not NaN


def test_cispo_weights_log_pi_by_the_clipped_ratio_held_constant():
    settings = LossSettings(score_centering=False, loss_type="cispo", epsilon=1.0, epsilon_high=1.0)
    loss, grad = _run(settings, 5.0)
    want_loss, want_grad = _reference("cispo", settings, 5.0)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    assert grad == pytest.approx(want_grad, rel=1e-12, abs=1e-15)
    # Unlike the clipped surrogate, a ratio above 1 + ε_high inside the MIS range keeps a gradient, capped at
    # (1 + ε_high)·A: r = 3.0 with A = −0.5 gives −(2.0·−0.5)/5.
    assert RATIOS[6] == 3.0 and grad[6] == pytest.approx(0.2, rel=1e-12)
    assert grad[0] == 0.0 and grad[7] == 0.0 and grad[-1] == 0.0  # below clip_min, above clip_max, −9999


def test_cispo_with_score_centering_is_refused():
    policy, sampler, adv = _terms(LossSettings())
    with pytest.raises(ValueError, match="score_centering: false"):
        grpo_loss(policy, sampler, adv, 1.0, LossSettings(loss_type="cispo"))
    with pytest.raises(ConfigError, match="train.score_centering: false"):
        load_config(None, ["train.loss_type=cispo", "train.score_centering=true"])


def test_fused_head_cispo_gradients_match_a_float64_reference_through_the_head():
    """The training path (chunked fused head): d loss / d hidden and d weight of CISPO, against float64 autograd
    of the formula on log_softmax(h Wᵀ / T)."""
    gen = torch.Generator().manual_seed(0)
    m, h, v, temperature = 10, 16, 40, 0.7
    hidden = torch.randn(m, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) * 0.3
    targets = torch.randint(0, v, (m,), generator=gen)
    true_lp = torch.log_softmax(hidden @ weight.T / temperature, -1).gather(1, targets[:, None])[:, 0]
    # sampler log-probs: the policy's shifted so the ratios spread over [0.4, 3.5] (some masked below 0.5)
    shift = torch.linspace(math.log(0.4), math.log(3.5), m, dtype=torch.float64)
    sampler = true_lp - shift
    adv = torch.linspace(-1.5, 2.0, m, dtype=torch.float64)
    settings = LossSettings(score_centering=False, loss_type="cispo", epsilon=0.5, epsilon_high=1.0)

    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = torch.log_softmax(h64 @ w64.T / temperature, -1).gather(1, targets[:, None])[:, 0]
    r = torch.exp(lp.detach() - sampler)
    keep = (r >= settings.clip_min) & (r <= settings.clip_max)
    w = r.clamp(1 - settings.epsilon, 1 + settings.epsilon_high)
    ref = -(w * adv * lp)[keep].sum() / 3.0
    ref.backward()
    assert 0 < int(keep.sum()) < m and bool(((r > 2.0) & keep).any())  # masked terms and capped weights present

    h32, w32 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    terms = LossTerms(targets, sampler.float(), adv.float())
    res = fused_grpo_loss(h32, w32, terms, 3.0, settings, temperature, chunk_size=4)
    res.loss.backward()
    assert res.loss.item() == pytest.approx(ref.item(), rel=1e-4)
    assert h32.grad is not None and w32.grad is not None and h64.grad is not None and w64.grad is not None
    torch.testing.assert_close(h32.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w32.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)
    assert torch.equal(in_clip_range(res.logprobs.logprobs.double() - sampler, settings), keep)


# -- GSPO ---------------------------------------------------------------------------------------------------------

# Four sequences of trained terms: (ratios π/μ, advantage). Sequence 0's geometric mean ratio (1.18) lies inside
# the clip range although its first token (1.5) is above 1 + ε_high; 1 is clipped high (1.50, A > 0); 2 is clipped
# low (0.74, A < 0); 3 holds a token outside the MIS range, left out of its mean and of the loss.
SEQUENCES = [([1.5, 1.1, 1.0], 1.0), ([1.6, 1.4], 2.0), ([0.7, 0.75, 0.8, 0.7], -1.0), ([0.9, 8.0, 1.2], -0.5)]


def _gspo_reference(settings: LossSettings, normaliser: float) -> tuple[float, list[float]]:
    """float64 loss and dL/dlog π_t: L = −(1/N) Σ_i n_i·min(s_i A_i, clip(s_i) A_i) over the kept terms, whose
    derivative in log π_t (t in sequence i) is −s_i·A_i/N on the unclipped branch (∂ log s_i/∂ log π_t = 1/n_i)."""
    lo, hi = 1 - settings.epsilon, 1 + (settings.epsilon if settings.epsilon_high is None else settings.epsilon_high)
    loss, grad = 0.0, []
    for ratios, a in SEQUENCES:
        kept = [settings.clip_min <= r <= settings.clip_max for r in ratios]
        logs = [math.log(r) for r, k in zip(ratios, kept, strict=True) if k]
        s = math.exp(math.fsum(logs) / len(logs))
        clipped = min(max(s, lo), hi)
        loss -= len(logs) * min(s * a, clipped * a) / normaliser
        g = -s * a / normaliser if s * a <= clipped * a else 0.0
        grad += [g if k else 0.0 for k in kept]
    return loss, grad


def _gspo_terms() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ratios = [r for rs, _ in SEQUENCES for r in rs]
    sampler = -torch.linspace(0.3, 2.5, len(ratios), dtype=torch.float64)
    policy = sampler + torch.tensor([math.log(r) for r in ratios], dtype=torch.float64)
    adv = torch.tensor([a for rs, a in SEQUENCES for _ in rs], dtype=torch.float64)
    index = torch.tensor([i for i, (rs, _) in enumerate(SEQUENCES) for _ in rs])
    return policy, sampler, adv, index


def test_gspo_clips_one_ratio_per_sequence():
    settings = LossSettings(score_centering=False, loss_type="gspo", epsilon=0.2, epsilon_high=0.28)
    policy, sampler, adv, index = _gspo_terms()
    policy = policy.clone().requires_grad_()
    seq = sequence_log_ratios(policy.detach() - sampler, index, settings)
    loss, _ = grpo_loss(policy, sampler, adv, 11.0, settings, sequence_log_ratio=seq)
    loss.backward()
    want_loss, want_grad = _gspo_reference(settings, 11.0)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert policy.grad is not None and policy.grad.tolist() == pytest.approx(want_grad, rel=1e-12, abs=1e-15)
    # The set-up covers each case: sequence 0 trains all its tokens although its first token (r = 1.5) would be
    # clipped token by token; 1 and 2 are clipped whole; 3 keeps two of its three tokens.
    g = policy.grad.tolist()
    assert all(x != 0 for x in g[0:3]) and all(x == 0 for x in g[3:9])
    assert g[9] != 0 and g[10] == 0 and g[11] != 0
    with pytest.raises(ValueError, match="sequence_log_ratio"):
        grpo_loss(policy, sampler, adv, 11.0, settings)


def test_fused_head_gspo_matches_a_float64_reference_when_chunks_split_sequences():
    gen = torch.Generator().manual_seed(1)
    m, h, v, temperature = 12, 16, 40, 1.0
    hidden = torch.randn(m, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) * 0.3
    targets = torch.randint(0, v, (m,), generator=gen)
    index = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    true_lp = torch.log_softmax(hidden @ weight.T / temperature, -1).gather(1, targets[:, None])[:, 0]
    shift = torch.tensor([0.1, 0.2, 0.0, -0.1, 0.15, 0.4, 0.35, 0.5, -0.05, 0.0, 0.02, -2.0], dtype=torch.float64)
    sampler = true_lp - shift  # log r = shift: sequence 1 clipped high, the last term masked (r ≈ 0.14)
    adv = torch.tensor([1.0] * 5 + [2.0] * 3 + [-1.0] * 4, dtype=torch.float64)
    settings = LossSettings(score_centering=False, loss_type="gspo", epsilon=0.2, epsilon_high=0.28)

    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = torch.log_softmax(h64 @ w64.T / temperature, -1).gather(1, targets[:, None])[:, 0]
    keep = in_clip_range((lp - sampler).detach(), settings)
    ref = torch.zeros((), dtype=torch.float64)
    for i in range(3):  # n_i · min(s_i A_i, clip(s_i) A_i), s_i differentiable through the mean of its kept terms
        sel = (index == i) & keep
        s_i = torch.exp((lp - sampler)[sel].mean())
        a = adv[sel][0]
        ref = ref - sel.sum() * torch.minimum(s_i * a, s_i.clamp(0.8, 1.28) * a) / 5.0
    ref.backward()
    assert not bool(keep[-1]) and bool(keep[:-1].all())

    h32, w32 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    terms = LossTerms(targets, sampler.float(), adv.float(), sequence_index=index)
    res = fused_grpo_loss(h32, w32, terms, 5.0, settings, temperature, chunk_size=3)  # chunks split sequences 0, 2
    res.loss.backward()
    assert res.loss.item() == pytest.approx(ref.item(), rel=1e-4)
    assert h32.grad is not None and w32.grad is not None and h64.grad is not None and w64.grad is not None
    assert float(h64.grad.abs().max()) > 1e-3  # something trains (not all clipped)
    torch.testing.assert_close(h32.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w32.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


# -- presets -----------------------------------------------------------------------------------------------------


def test_the_default_preset_changes_nothing():
    assert RunConfig().model_dump() == RunConfig(algorithm="grpo").model_dump() == load_config(None).model_dump()
    default = RunConfig()
    assert default.train.score_centering and default.train.loss_type == "grpo" and default.train.epsilon_high is None
    assert default.rollout.scale_rewards == "group" and not default.rollout.mask_truncated_completions


@pytest.mark.parametrize(
    "name, train, rollout",
    [
        (
            "dapo",
            {"score_centering": False, "epsilon": 0.2, "epsilon_high": 0.28},
            {"mask_truncated_completions": True, "overlong_buffer_len": "auto", "overlong_penalty_factor": 1.0},
        ),
        ("dr_grpo", {"score_centering": False, "loss_type": "grpo"}, {"scale_rewards": "none"}),
        ("cispo", {"score_centering": False, "loss_type": "cispo", "epsilon_high": 5.0}, {}),
        ("gspo", {"score_centering": False, "loss_type": "gspo", "epsilon": 3e-4, "epsilon_high": 4e-4}, {}),
    ],
)
def test_a_preset_sets_its_fields(name, train, rollout):
    cfg = load_config(None, [f"algorithm={name}"])
    assert {k: getattr(cfg.train, k) for k in train} == train
    assert {k: getattr(cfg.rollout, k) for k in rollout} == rollout
    assert cfg.algorithm == name


def test_a_field_the_config_sets_wins_over_the_preset(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm: dapo\ntrain:\n  epsilon_high: 0.3\nrollout:\n  mask_truncated_completions: false\n")
    cfg = load_config(path)
    assert cfg.train.epsilon_high == 0.3 and not cfg.rollout.mask_truncated_completions
    assert cfg.train.score_centering is False  # the preset's other fields still apply
    assert load_config(path, ["train.epsilon_high=0.4"]).train.epsilon_high == 0.4
    # A written config (every field explicit, the preset named) reads back the same.
    again = tmp_path / "again.json"
    again.write_text(cfg.model_dump_json())
    assert load_config(again) == cfg


def test_an_unknown_preset_names_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm=ppo"])
    assert "'ppo'" in str(err.value)
    for name in ALGORITHM_PRESETS:
        assert name in str(err.value)


def test_trainer_path_gspo_on_a_tree_packed_row_matches_the_per_sample_formula():
    """Policy.grpo_loss (what the trainer runs) on one prefix-shared row: every sample's sequence ratio is formed
    from its own terms (``RowTensors.sample_index``), against float64 per-sample forwards with causal attention."""
    from test_loss import grads, model64, samples_with_sampler

    from grpo_core.packing import get_packer
    from grpo_core.train.policy import Policy
    from grpo_core.train.rows import to_tensors

    model = model64()
    samples = samples_with_sampler(model, np.random.default_rng(3))  # five samples of one prompt, sampler ≠ policy
    for s, a in zip(samples, [1.0, -0.5, 2.0, -1.0, 0.3], strict=True):
        s.advantage = a
    settings = LossSettings(score_centering=False, loss_type="gspo", epsilon=0.1, epsilon_high=0.15)
    normaliser = float(sum(s.num_trained for s in samples))

    row = get_packer("rust").pack_row(samples, 1024)
    assert row.num_forwarded < row.num_raw  # the prompt really is shared in the tree
    res = Policy(model, chunk_size=4).grpo_loss(to_tensors(row, torch.device("cpu")), settings, normaliser)
    g_packed = grads(model, res.loss)

    model.config._attn_implementation = "sdpa"
    ref, ratios = torch.zeros((), dtype=torch.float64), []
    for s in samples:
        ids = torch.as_tensor(s.input_ids, dtype=torch.long)
        logp_all = torch.log_softmax(model(input_ids=ids[None]).logits[0], -1)
        lr = [logp_all[t - 1, ids[t]] - float(s.sampler_logprobs[t]) for t in np.nonzero(s.completion_mask)[0]]
        kept = [x for x in lr if settings.clip_min <= math.exp(float(x.detach())) <= settings.clip_max]
        s_i = torch.exp(torch.stack(kept).mean())
        ratios.append(float(s_i.detach()))
        a = s.advantage
        ref = ref - len(kept) * torch.minimum(s_i * a, s_i.clamp(0.9, 1.15) * a) / normaliser
    g_ref = grads(model, ref)
    clipped = [(r > 1.15 and a > 0) or (r < 0.9 and a < 0) for r, a in zip(ratios, [1.0, -0.5, 2.0, -1.0, 0.3])]
    assert any(clipped) and not all(clipped), ratios  # some sequences clipped whole, some trained
    assert res.loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(g_packed, g_ref, atol=1e-6, rtol=1e-5)


def test_an_upper_clip_below_the_lower_is_refused_naming_both_fields():
    """``algorithm: gspo`` with ``train.epsilon: 0.2`` kept the preset's epsilon_high 4e-4: a clip range
    [1 - 0.2, 1 + 4e-4], narrower above than below, was accepted."""
    assert ALGORITHM_PRESETS["gspo"]["train"]["epsilon_high"] < 0.2  # the set-up: the preset fills 4e-4 in
    for overrides in (["algorithm=gspo", "train.epsilon=0.2"], ["train.epsilon=0.2", "train.epsilon_high=0.1"]):
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        message = str(err.value)
        assert "train.epsilon_high (" in message and "is below train.epsilon (0.2)" in message, message
        assert "set train.epsilon_high >= train.epsilon" in message, message
    assert load_config(None, ["algorithm=gspo"]).train.epsilon_high == pytest.approx(4e-4)  # the preset alone is kept
    assert load_config(None, ["train.epsilon=0.2", "train.epsilon_high=0.2"]).train.epsilon_high == 0.2  # equal is fine
    # CISPO's epsilon is the lower bound of its weight (1 = none); a cap 1 + epsilon_high below 2 is the paper's use
    cispo = ["algorithm=cispo", "train.epsilon_high=0.28"]
    assert load_config(None, cispo).train.epsilon_high == pytest.approx(0.28)
