"""The GRPO loss over packed loss terms (DESIGN.md §5; seed manual, "computing the loss").

Old policy = the sampler's log-probs μ (vLLM ``processed_logprobs``), so one
importance ratio ``r = π/μ`` covers both the train/inference mismatch and the
policy lag. Tokens with ``r`` outside ``[clip_min, clip_max]`` are masked out of
the loss entirely (masked importance sampling, MIS).

* ``score_centering=True`` (default): per position the gradient is
  ``A·(f(r_t)∇logπ(o_t) − Σ_v μ(v) f(r_v)∇logπ(v))`` with ``f(r) = r`` inside
  the clip range and 0 outside, the inner sum over the sampler's top-k ids.
  Since ``f(r)∇logπ = ∇r`` and ``μ(v) f(r_v)∇logπ(v) = ∇π(v)`` inside the range,
  the surrogate ``A·(r_t − Σ_v 1[v in range]·π(v))`` has exactly that
  gradient. A position whose sampled token is masked drops out whole.
* ``score_centering=False``: the clipped surrogate
  ``min(r·A, clip(r, 1−ε, 1+ε_high)·A)`` (PPO/GRPO; ``ε_high > ε`` is DAPO's
  clip-higher, Yu et al. 2025, §3.1), on the same MIS mask.
* ``loss_type="cispo"`` (CISPO, MiniMax-M1, Chen et al. 2025, eq. 4): the term
  ``sg(clip(r, 1−ε, 1+ε_high))·A·log π``: the clipped IS weight is a constant,
  so no token inside the MIS range loses its gradient to the clip.
* ``loss_type="gspo"`` (GSPO, Zheng et al. 2025, §4.1 and the GSPO-token form of
  §4.3): one ratio per sequence, ``s = exp(mean over the sequence's kept terms
  of log π − log μ)``, in ``min(s·A, clip(s, 1−ε, 1+ε_high)·A)`` per term with
  ``s_t = sg(s)·π_t/sg(π_t)`` (value ``s``, gradient ``s·∇log π_t``). Summed over
  the terms and divided by the step's trained tokens, a sequence weighs its
  kept tokens (the paper averages sequences, 1/G each). The per-sequence mean
  comes in precomputed (:func:`sequence_log_ratios`), so chunks can split a
  sequence.

The sum over loss terms is divided by ``num_trained_global``, which
:func:`loss_normalisers` gives per micro-batch. By default
(``train.loss_normalization: step_tokens``, DESIGN.md §5 revised 2026-12) it is
the trained tokens of the whole optimizer step (every micro-batch of the
accumulation window, across all ranks), so every trained token of the step
weighs the same and the gradient does not depend on how the packer split the
step. ``micro_batch`` keeps the former rule (each micro-batch normalised by its
own trained tokens, the micro-batches averaged), under which a token in a short
micro-batch weighs more than one in a long micro-batch.

Masking semantics (keep them in any fused or chunked rewrite): a term is kept
when its log-ratio ``log π − log μ`` is finite and ``r`` lies in
``[clip_min, clip_max]``; a dropped term contributes exactly 0 to the loss and
to every gradient. Masking is done by selection before any ``exp`` (the
log-ratio of a dropped term is replaced by 0, and a top-k id outside the range
by ``-inf``), never by multiplying by a 0/1 mask: a sampler log-prob at vLLM's
−9999 floor makes ``exp(log π − log μ)`` overflow to inf, and ``inf · 0`` is
NaN in the loss and in the gradient. An inf/NaN in a kept term's advantage is
not masked: it surfaces as a non-finite gradient norm, and the trainer skips
that step (``train/skipped_nonfinite_steps``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LossType = Literal["grpo", "cispo", "gspo"]
SequenceMask = Literal["none", "sequence", "geometric"]


@dataclass(frozen=True)
class LossSettings:
    """Loss hyper-parameters (names as in the run config).

    Attributes:
        clip_min, clip_max: MIS range of ``r = π/μ`` (defaults 0.5, 5.0).
        score_centering: score-centred gradient (True) or clipped surrogate.
        epsilon: lower trust-region width ε of the clipped surrogate.
        epsilon_high: upper width (defaults to ``epsilon``).
        loss_type: ``grpo`` (score centering or the clipped surrogate, as ``score_centering`` says) or
            ``cispo`` (clipped IS weight) or ``gspo`` (sequence-level ratio), both with ``score_centering=False``.
        tis_cap: truncated importance sampling cap C (each kept term weighted by ``min(1, C/r)``); None = off.
        sequence_mask: ``none``, ``sequence`` (mask a sample whose ``Π r_t`` is outside the band) or ``geometric``
            (whose ``exp(mean log r_t)`` is).
        sequence_mask_min, sequence_mask_max: the band of ``sequence_mask``.
        kl_coef: β of the KL term to a reference policy (k3 estimator, needs ``ref_logprobs``); 0 = off.
    """

    clip_min: float = 0.5
    clip_max: float = 5.0
    score_centering: bool = True
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: LossType = "grpo"
    tis_cap: float | None = None
    sequence_mask: SequenceMask = "none"
    sequence_mask_min: float = 0.5
    sequence_mask_max: float = 2.0
    kl_coef: float = 0.0

    @property
    def needs_sequences(self) -> bool:
        """Whether the loss reads per-sequence log-ratios (GSPO, a sequence mask): a first pass computes them."""
        return self.loss_type == "gspo" or self.sequence_mask != "none"


LossNormalization = Literal["step_tokens", "micro_batch"]


def loss_normalisers(
    trained_per_micro_batch: Sequence[int], world_size: int, normalization: LossNormalization = "step_tokens"
) -> list[float]:
    """The divisor of each micro-batch's loss on every rank (``num_trained_global`` of :func:`grpo_loss`).

    Each rank's gradient is averaged over the ranks by FSDP2's reduce-scatter (a mean), so the divisors are
    divided by ``world_size`` to make the step's gradient the one of a sum over every rank's terms.

    * ``step_tokens`` (default; DESIGN.md §5 "Loss", revised 2026-12): every micro-batch is divided by the
      trained tokens of the whole step, ``N = Σ_m N_m``, so the step's gradient is that of
      ``-(1/N) Σ_{all trained tokens} term`` however the step was split into micro-batches and ranks
      (the "token-level" aggregation of DAPO, Yu et al. 2025, §3.3, over the accumulation window).
    * ``micro_batch`` (the rule before 2026-12): micro-batch ``m`` is divided by ``N_m · M``, i.e. the mean of
      the micro-batches' per-token means.

    Args:
        trained_per_micro_batch: ``N_m``, the trained tokens (loss terms) of each micro-batch of the step,
            summed over all ranks.
        world_size: data-parallel ranks.
        normalization: ``step_tokens`` or ``micro_batch`` (``train.loss_normalization``).

    Returns:
        One divisor per micro-batch, each > 0 (a step or micro-batch without a trained token counts as 1,
        its loss being 0 anyway).

    Raises:
        ValueError: an unknown ``normalization`` or ``world_size`` < 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    num = len(trained_per_micro_batch)
    if normalization == "step_tokens":
        return [max(sum(trained_per_micro_batch), 1) / world_size] * num
    if normalization == "micro_batch":
        return [max(n, 1) * num / world_size for n in trained_per_micro_batch]
    raise ValueError(f"train.loss_normalization must be 'step_tokens' or 'micro_batch', got {normalization!r}")


def provisional_normaliser(
    trained: int, first_trained: int, planned_micro_batches: int, world_size: int, normalization: LossNormalization
) -> float:
    """The divisor a micro-batch's loss is backpropagated with before its step is complete (overlapped training).

    The final divisors (:func:`loss_normalisers`) need every micro-batch of the step. Each rule's final divisor is
    ``c × provisional`` with one ``c`` for the whole step, so the step's gradient is the provisional one divided by
    ``c`` (gradients are linear in the loss; :func:`overlap_rescale`):

    * ``step_tokens``: the same provisional divisor for every micro-batch, ``N_0 · G / world_size`` (``N_0`` the
      first micro-batch's trained tokens, ``G`` the planned micro-batches: an estimate of the step's ``N`` that
      keeps the gradients near their final size); final ``N / world_size``.
    * ``micro_batch``: ``N_m · G / world_size``; final ``N_m · M / world_size`` with ``M`` the micro-batches the
      step had in the end (fewer than ``G`` when the samples ran out or a partial step was flushed).

    Args:
        trained: ``N_m``, this micro-batch's trained tokens summed over ranks.
        first_trained: ``N_0``, the step's first micro-batch's.
        planned_micro_batches: ``G``, ``train.gradient_accumulation_steps``.
        world_size: data-parallel ranks.
        normalization: ``train.loss_normalization``.

    Returns:
        A divisor > 0 (a count of 0 counts as 1, as in :func:`loss_normalisers`).

    Raises:
        ValueError: an unknown ``normalization``, ``world_size`` or ``planned_micro_batches`` < 1.
    """
    if world_size < 1 or planned_micro_batches < 1:
        raise ValueError(
            f"world_size and planned_micro_batches must be >= 1, got {world_size}, {planned_micro_batches}"
        )
    if normalization == "step_tokens":
        return max(first_trained, 1) * planned_micro_batches / world_size
    if normalization == "micro_batch":
        return max(trained, 1) * planned_micro_batches / world_size
    raise ValueError(f"train.loss_normalization must be 'step_tokens' or 'micro_batch', got {normalization!r}")


def overlap_rescale(provisional: Sequence[float], final: Sequence[float]) -> float:
    """The factor that turns gradients accumulated with the ``provisional`` divisors into those of the ``final``
    ones: ``provisional[m] / final[m]``, the same for every micro-batch ``m`` (:func:`provisional_normaliser`).

    Raises:
        ValueError: the lists differ in length or are empty, or the ratios differ (relative 1e-9): no single
            rescale gives the exact gradient.
    """
    if len(provisional) != len(final) or not final:
        raise ValueError(f"one provisional divisor per micro-batch: got {len(provisional)} for {len(final)}")
    ratios = [p / f for p, f in zip(provisional, final)]
    if any(abs(r - ratios[0]) > 1e-9 * abs(ratios[0]) for r in ratios):
        raise ValueError(f"the provisional divisors are not one multiple of the final ones: ratios {ratios}")
    return ratios[0]


def grpo_loss(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    num_trained_global: float,
    settings: LossSettings = LossSettings(),
    topk_logprobs: Tensor | None = None,
    sampler_topk_logprobs: Tensor | None = None,
    sequence_log_ratio: Tensor | None = None,
    sequence_mask_log_ratio: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of one rank's micro-batch and its per-term statistics.

    Args:
        logprobs: ``float[M]`` trainer log π of each trained token (differentiable).
        sampler_logprobs: ``float[M]`` sampler log μ of the same tokens.
        advantages: ``float[M]``.
        num_trained_global: normaliser, > 0: the micro-batch's entry of :func:`loss_normalisers`.
        settings: :class:`LossSettings`.
        topk_logprobs: ``float[M, k]`` trainer log π at the sampler's top-k ids
            (``-inf`` = padding); needed with score centering.
        sampler_topk_logprobs: ``float[M, k]`` sampler log μ at those ids.
        sequence_log_ratio: ``float[M]``, GSPO only: for each term, the mean log-ratio of its sequence's kept
            terms (:func:`sequence_log_ratios`; a constant, no gradient flows through it).
        sequence_mask_log_ratio: ``float[M]``, with ``settings.sequence_mask`` only: for each term, the log of its
            sequence's ratio (``sequence``: Σ_t log r_t) or geometric mean ratio (``geometric``: mean_t log r_t)
            over all the sequence's terms (:func:`sequence_mask_log_ratios`).
        ref_logprobs: ``float[M]``, with ``settings.kl_coef > 0`` only: the reference policy's log π_ref of the
            same tokens (a constant). Each kept term then subtracts ``kl_coef · k3`` from its objective, with the
            k3 estimator ``π_ref/π − log(π_ref/π) − 1`` of KL(π‖π_ref) (Schulman 2020, "Approximating KL
            Divergence"; DeepSeekMath, Shao et al. 2024, eq. 4).

    Returns:
        ``(loss, stats)``: the scalar loss and detached ``float[M]`` tensors
        ``ratio``, ``masked`` (1 = outside the MIS range or in a masked sequence), ``logp_diff``
        (|log π − log μ|), ``clipped_low``, ``clipped_high`` (trust region),
        ``sampler_mass`` (``float[M]``, with score centering) and ``kl`` (``float[M]``, k3 of each kept term, 0 for
        a dropped one; with ``kl_coef > 0``).

    Raises:
        ValueError: score centering without top-k log-probs, CISPO or GSPO with score centering, GSPO without
            ``sequence_log_ratio``, an unknown ``loss_type``, or a bad normaliser.
    """
    if num_trained_global <= 0:
        raise ValueError(f"num_trained_global must be > 0, got {num_trained_global}")
    if settings.loss_type not in ("grpo", "cispo", "gspo"):
        raise ValueError(f"train.loss_type must be 'grpo', 'cispo' or 'gspo', got {settings.loss_type!r}")
    if settings.loss_type != "grpo" and settings.score_centering:
        raise ValueError(f"train.loss_type {settings.loss_type!r} needs train.score_centering: false")
    if settings.loss_type == "gspo" and sequence_log_ratio is None:
        raise ValueError("train.loss_type 'gspo' needs each term's sequence_log_ratio (sequence_log_ratios)")
    if settings.sequence_mask != "none" and sequence_mask_log_ratio is None:
        raise ValueError("train.sequence_mask needs each term's sequence_mask_log_ratio (sequence_mask_log_ratios)")
    if settings.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("train.kl_coef > 0 needs the reference policy's log-probs (ref_logprobs)")
    log_ratio = logprobs - sampler_logprobs
    keep = in_clip_range(log_ratio.detach(), settings)
    if settings.sequence_mask != "none":
        assert sequence_mask_log_ratio is not None
        seq = sequence_mask_log_ratio.detach()  # NaN (a non-finite term in the sequence) is never kept
        lo, hi = math.log(settings.sequence_mask_min), math.log(settings.sequence_mask_max)
        keep = keep & (seq >= lo) & (seq <= hi)
    # Select before exp: a dropped term's ratio is exp(0) = 1 with no path to logprobs, so neither an
    # overflowing exp nor a NaN can reach the loss or the gradient (see "masking semantics" above).
    ratio = torch.where(keep, log_ratio, torch.zeros_like(log_ratio)).exp()
    r = log_ratio.detach().exp()
    eps_high = settings.epsilon if settings.epsilon_high is None else settings.epsilon_high
    stats = {
        "ratio": r,
        "masked": (~keep).float(),
        "logp_diff": log_ratio.detach().abs(),
        "clipped_low": (r < 1 - settings.epsilon).float(),
        "clipped_high": (r > 1 + eps_high).float(),
    }
    if settings.score_centering:
        if topk_logprobs is None or sampler_topk_logprobs is None:
            raise ValueError("score_centering needs the sampler's top-k log-probs (num_sampler_logprobs > 0)")
        in_v = in_clip_range((topk_logprobs - sampler_topk_logprobs).detach(), settings)  # padding (-inf): out
        pi_v = torch.where(in_v, topk_logprobs, torch.full_like(topk_logprobs, float("-inf"))).exp()
        per_term = advantages * (ratio - pi_v.sum(-1))
        stats["sampler_mass"] = sampler_topk_logprobs.detach().exp().nan_to_num(0.0).sum(-1)
    elif settings.loss_type == "gspo":
        assert sequence_log_ratio is not None
        zero = torch.zeros_like(log_ratio)
        # s_t = sg(s)·π_t/sg(π_t): value s, gradient s·∇log π_t; dropped terms selected out before the exp.
        own = torch.where(keep, logprobs - logprobs.detach(), zero)
        s_t = (own + torch.where(keep, sequence_log_ratio.detach(), zero)).exp()
        clipped = s_t.clamp(1 - settings.epsilon, 1 + eps_high)
        per_term = torch.minimum(s_t * advantages, clipped * advantages)
    elif settings.loss_type == "cispo":
        # sg(clip(r)) · A · log π: the clipped weight is a constant; a dropped term's log π is replaced by 0 too.
        weight = ratio.detach().clamp(1 - settings.epsilon, 1 + eps_high)
        per_term = weight * advantages * torch.where(keep, logprobs, torch.zeros_like(logprobs))
    else:
        clipped = ratio.clamp(1 - settings.epsilon, 1 + eps_high)
        per_term = torch.minimum(ratio * advantages, clipped * advantages)
    if settings.tis_cap is not None:
        # Truncated IS (Yao et al. 2025): the weight r becomes min(r, C), i.e. the term times sg(min(1, C/r)),
        # computed as exp(min(0, log C - log r)) on the kept (finite) log-ratios.
        safe = torch.where(keep, log_ratio.detach(), torch.zeros_like(log_ratio))
        per_term = per_term * (math.log(settings.tis_cap) - safe).clamp_max(0.0).exp()
    if settings.kl_coef > 0:
        assert ref_logprobs is not None
        # k3 = exp(d) − d − 1, d = log π_ref − log π, on the kept terms only (a dropped term's d is selected to 0).
        d = torch.where(keep, ref_logprobs.detach() - logprobs, torch.zeros_like(logprobs))
        k3 = d.exp() - d - 1
        per_term = per_term - settings.kl_coef * k3
        stats["kl"] = k3.detach()
    loss = -torch.where(keep, per_term, torch.zeros_like(per_term)).sum() / num_trained_global
    return loss, stats


def sequence_log_ratios(log_ratio: Tensor, sequence_index: Tensor, settings: LossSettings) -> Tensor:
    """GSPO's per-sequence log-ratio, ``log s_i = mean over the kept terms of sequence i of log π − log μ``,
    given back per term (Zheng et al. 2025, eq. 7; "kept" as :func:`in_clip_range`).

    Args:
        log_ratio: ``float[M]`` ``log π − log μ`` of every term (detached).
        sequence_index: ``int64[M]`` the sequence (sample) of each term, ``0 <= index < M``.
        settings: :class:`LossSettings` (the MIS range).

    Returns:
        ``float[M]``, detached; 0 for a term whose sequence has no kept term.
    """
    log_ratio = log_ratio.detach()
    keep = in_clip_range(log_ratio, settings)
    kept = torch.where(keep, log_ratio, torch.zeros_like(log_ratio))
    index = sequence_index.long()
    size = int(index.max().item()) + 1 if index.numel() else 0
    total = log_ratio.new_zeros(size).index_add_(0, index, kept)
    count = log_ratio.new_zeros(size).index_add_(0, index, keep.to(log_ratio.dtype))
    return (total / count.clamp_min(1))[index]


def sequence_mask_log_ratios(log_ratio: Tensor, sequence_index: Tensor, settings: LossSettings) -> Tensor:
    """The log of each term's sequence ratio for ``settings.sequence_mask``, given back per term.

    ``sequence``: ``log ρ_i = Σ_t (log π − log μ)`` over every term of sequence i (the sequence-level importance
    ratio ``Π_t π/μ``); ``geometric``: ``mean_t (log π − log μ)``, the log of the geometric mean of the token ratios
    (sequence-level and geometric masking, Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL
    Collapse from the Training-Inference Mismatch"). Every term counts, those outside the token range too; a
    non-finite log-ratio makes its sequence's value NaN (never kept).

    Args:
        log_ratio: ``float[M]`` ``log π − log μ`` of every term (detached).
        sequence_index: ``int64[M]`` the sequence (sample) of each term, ``0 <= index < M``.
        settings: :class:`LossSettings` (``sequence_mask``).

    Returns:
        ``float[M]``, detached.

    Raises:
        ValueError: ``settings.sequence_mask`` is ``none`` or unknown.
    """
    if settings.sequence_mask not in ("sequence", "geometric"):
        raise ValueError(f"train.sequence_mask must be 'sequence' or 'geometric', got {settings.sequence_mask!r}")
    log_ratio = log_ratio.detach()
    finite = torch.isfinite(log_ratio)
    values = torch.where(finite, log_ratio, torch.full_like(log_ratio, float("nan")))
    index = sequence_index.long()
    size = int(index.max().item()) + 1 if index.numel() else 0
    total = log_ratio.new_zeros(size).index_add_(0, index, values)
    if settings.sequence_mask == "geometric":
        count = log_ratio.new_zeros(size).index_add_(0, index, torch.ones_like(log_ratio))
        total = total / count.clamp_min(1)
    return total[index]


def in_clip_range(log_ratio: Tensor, settings: LossSettings) -> Tensor:
    """``bool[...]``: terms kept by masked importance sampling, ``clip_min <= exp(log_ratio) <= clip_max``.

    Compared in log space, so no ``exp`` can overflow; NaN and ±inf log-ratios are never kept.
    """
    return (log_ratio >= math.log(settings.clip_min)) & (log_ratio <= math.log(settings.clip_max))
