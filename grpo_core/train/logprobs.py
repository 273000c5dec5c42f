"""Log-probs of the trained tokens of a packed row, without full-vocabulary logits
for every position, and the fused log-prob head that the trainer runs.

The decoder runs on the row's forwarded tokens (tree attention, positions =
depth); only the ``M`` hidden states that predict a trained token are gathered,
and the vocabulary projection runs over chunks of those ``M`` rows.

Two paths share that shape:

* :func:`projected_logprobs` returns differentiable log-probs; the loss is
  computed outside and autograd recomputes each chunk's logits in the backward
  pass (activation checkpointing). It is the reference, and what inference-only
  callers use.
* :func:`fused_grpo_loss` is the training path, after Liger-Kernel's fused
  linear cross-entropy (Hsu et al., 2024, "Liger Kernel", §3.2): the GRPO loss
  of a loss term depends only on that term's log-probs, so its derivative with
  respect to them (``dL/dlogp``, ``dL/dlogp_topk``) is known in the forward pass
  (from :func:`grpo_core.train.loss.grpo_loss` itself, through autograd on the
  chunk's ``[c]``/``[c, k]`` log-probs). Each chunk's logits are computed once
  (bf16 operands, fp32 accumulation, on the sampler's grid: :func:`head_logits`), reduced to log-probs, entropy
  and top-k terms, turned into ``dL/dlogits`` and multiplied back into the gradients of the hidden
  states and of the output embedding, then freed: no ``[M, V]`` tensor exists and
  nothing is recomputed in the backward pass, which only scales the stored
  gradients by the incoming scalar.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .loss import LossSettings, grpo_loss, sequence_log_ratios, sequence_mask_log_ratios

#: ``fused_grpo_loss``'s default settings (one frozen instance, shared as a default argument's would be).
_DEFAULT_SETTINGS = LossSettings()


@dataclass
class TokenLogProbs:
    """Trainer-side view of each loss term.

    Attributes:
        logprobs: ``float[M]`` log π(target) after temperature (and, with a
            sampling mask, renormalised over the candidate set); differentiable.
        entropy: ``float[M]`` entropy of that distribution (nats), detached.
        topk_logprobs: ``float[M, k]`` log π at the sampler's top-k ids
            (score centering), differentiable; ``-inf`` where the id is padding.
    """

    logprobs: Tensor
    entropy: Tensor
    topk_logprobs: Tensor | None = None


def head_logits(h: Tensor, weight: Tensor, fp32_logits: bool = False) -> Tensor:
    """``float32[c, V]`` logits ``h @ weightᵀ`` as the sampler computes them.

    The product accumulates in fp32; unless ``fp32_logits``, it lands in the compute dtype of ``h``
    (bf16/fp16 logits, then upcast), as a generation server holding the model in that dtype computes
    its lm_head: vLLM 0.25.1 runs the head in the model dtype (its fp32 ``head_dtype`` serves pooling
    models only) and the embedded server runs the transformers model in ``model.dtype``. Keeping
    fp32 logits on one side only puts up to half a bf16 step (1/16 nat at logits of 16-32) between
    trainer and sampler log-probs of the same weights. fp32 inputs give fp32 logits either way.
    """
    if fp32_logits:
        return _matmul_f32(h, weight.t())
    return torch.mm(h, weight.t()).float()  # the GEMM's own output dtype, as the sampler's lm_head


def _chunk(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float,
    topk_ids: Tensor | None,
    candidates: Tensor | None,
    fp32_logits: bool = False,
) -> tuple[Tensor, ...]:
    logits = head_logits(h, weight, fp32_logits) / temperature  # [c, V]
    if candidates is not None:
        logits = logits.masked_fill(~candidates, float("-inf"))
    logz = torch.logsumexp(logits, dim=-1, keepdim=True)
    logp_all = logits - logz
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    with torch.no_grad():
        p = logp_all.exp()
        entropy = -(p * logp_all.nan_to_num(neginf=0.0)).sum(-1)
    if topk_ids is None:
        return logp, entropy
    topk = logp_all.gather(1, topk_ids.clamp_min(0)).masked_fill(topk_ids < 0, float("-inf"))
    return logp, entropy, topk


def candidate_mask(offsets: Tensor, ids: Tensor, vocab_size: int, start: int = 0, stop: int | None = None) -> Tensor:
    """Dense ``bool[stop - start, V]`` candidate sets of loss terms ``start:stop`` from a CSR sampling mask.

    An empty entry means "the full vocabulary" (samples without a mask). Rows
    outside ``start:stop`` are routed to a scratch row instead of being sliced
    out, so nothing here waits for the device.

    Args:
        offsets: ``int64[M + 1]`` CSR offsets into ``ids``.
        ids: ``int64[E]`` candidate token ids.
        vocab_size: ``V``.
        start, stop: the loss terms wanted (default: all ``M``).
    """
    m = offsets.shape[0] - 1
    stop = m if stop is None else stop
    counts = (offsets[1:] - offsets[:-1]).to(ids.device)
    rows = torch.repeat_interleave(torch.arange(m, device=ids.device), counts, output_size=ids.shape[0])
    inside = (rows >= start) & (rows < stop)
    rows = torch.where(inside, rows - start, stop - start)  # scratch row for the others
    mask = torch.zeros(stop - start + 1, vocab_size, dtype=torch.bool, device=ids.device)
    mask.index_put_((rows, ids.long()), torch.ones((), dtype=torch.bool, device=ids.device))
    return mask[:-1] | (counts[start:stop] == 0)[:, None]


def projected_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    topk_ids: Tensor | None = None,
    candidates: Tensor | None = None,
    chunk_size: int = 1024,
    fp32_logits: bool = False,
) -> TokenLogProbs:
    """Log-probs of ``targets`` from gathered hidden states, chunked over ``M``.

    Args:
        hidden: ``[M, H]`` hidden states at the loss terms' ``token_index``.
        weight: ``[V, H]`` output embedding (lm_head) weight.
        targets: ``int64[M]`` target ids.
        temperature: sampler temperature (vLLM's processed log-probs divide
            logits by it before the softmax).
        topk_ids: optional ``int64[M, k]`` sampler top-k ids, ``-1`` = padding.
        candidates: optional ``bool[M, V]`` sampling-mask candidate sets.
        chunk_size: loss terms per chunk of the vocabulary projection.
        fp32_logits: keep the logits in fp32 instead of the compute dtype (:func:`head_logits`).
    """
    outs = []
    for a in range(0, hidden.shape[0], chunk_size):
        sl = slice(a, a + chunk_size)
        args = (
            hidden[sl],
            weight,
            targets[sl],
            temperature,
            None if topk_ids is None else topk_ids[sl],
            None if candidates is None else candidates[sl],
            fp32_logits,
        )
        if torch.is_grad_enabled() and hidden.requires_grad:
            outs.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            outs.append(_chunk(*args))
    cat = [torch.cat(parts) for parts in zip(*outs)] if outs else []
    if not cat:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return TokenLogProbs(empty, empty, None if topk_ids is None else hidden.new_zeros(0, topk_ids.shape[1]))
    return TokenLogProbs(cat[0], cat[1], cat[2] if len(cat) > 2 else None)


# -- the fused head -----------------------------------------------------------------------


@dataclass
class LossTerms:
    """Per-term inputs of the GRPO loss, besides the policy's own log-probs (rows of ``RowTensors``).

    Attributes:
        targets: ``int64[M]`` trained token ids.
        sampler_logprobs: ``float32[M]`` sampler log μ of the targets.
        advantages: ``float32[M]``.
        topk_ids: ``int64[M, k]`` sampler top-k ids (``-1`` = padding), or None.
        sampler_topk_logprobs: ``float32[M, k]`` sampler log μ at those ids (``-inf`` padding), or None.
        candidates: CSR sampling mask ``(offsets int64[M + 1], ids int64[E])``, or None.
        sequence_index: ``int64[M]`` the sample of each term in its row; needed by GSPO, else unused.
        sequence_log_ratio: ``float32[M]`` GSPO's per-sequence mean log-ratio of each term's sample, filled in by
            :func:`fused_grpo_loss` (:func:`grpo_core.train.loss.sequence_log_ratios`).
        sequence_mask_log_ratio: ``float32[M]`` the log sequence (or geometric mean) ratio of each term's sample
            for ``train.sequence_mask``, filled in by :func:`fused_grpo_loss`
            (:func:`grpo_core.train.loss.sequence_mask_log_ratios`).
        ref_logprobs: ``float32[M]`` the reference policy's log-probs of the targets (``train.kl_coef`` > 0), or None.
    """

    targets: Tensor
    sampler_logprobs: Tensor
    advantages: Tensor
    topk_ids: Tensor | None = None
    sampler_topk_logprobs: Tensor | None = None
    candidates: tuple[Tensor, Tensor] | None = None
    sequence_index: Tensor | None = None
    sequence_log_ratio: Tensor | None = None
    sequence_mask_log_ratio: Tensor | None = None
    ref_logprobs: Tensor | None = None


@dataclass
class HeadLoss:
    """What :func:`fused_grpo_loss` returns.

    Attributes:
        loss: scalar loss of the row (as :func:`grpo_loss`), differentiable with
            respect to ``hidden`` and ``weight``.
        logprobs: the terms' log-probs, entropy and top-k log-probs (detached).
        stats: :func:`grpo_loss`'s per-term statistics (detached ``float[M]``).
    """

    loss: Tensor
    logprobs: TokenLogProbs
    stats: dict[str, Tensor]


def _matmul_f32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` in fp32: bf16/fp16 operands accumulate and land in fp32 (cuBLAS ``out_dtype``)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _out_dtype_mm_works():
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


@functools.cache
def _out_dtype_mm_works() -> bool:
    try:
        x = torch.ones(16, 16, dtype=torch.bfloat16, device="cuda")
        return bool(torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32)
    except (RuntimeError, TypeError):
        return False


def _term_stats(
    logits: Tensor, candidates: Tensor | None, ids: Tensor, temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Log-normaliser ``float[c]``, log π at ``ids`` ``float[c, 1 + k]`` (``-inf`` at padding ids) and entropy."""
    z = logits / temperature
    if candidates is not None:
        z = z.masked_fill(~candidates, float("-inf"))
    m = z.amax(-1, keepdim=True)
    e = torch.exp(z - m)
    s = e.sum(-1, keepdim=True)
    ez = torch.where(e > 0, e * z, 0.0).sum(-1, keepdim=True)  # Σ e·z over the candidates
    logz = m + torch.log(s)
    entropy = (logz - ez / s).squeeze(1)  # H = log Z − E_π[z]
    picked = z.gather(1, ids.clamp_min(0)) - logz
    return logz.squeeze(1), picked.masked_fill(ids < 0, float("-inf")), entropy


def _logit_grad(
    logits: Tensor, candidates: Tensor | None, logz: Tensor, coef_sum: Tensor, temperature: float, dtype: torch.dtype
) -> Tensor:
    """Dense part of ``dL/dlogits``: ``−(Σ_a coef_a)·π / T`` over the candidates, exactly 0 in rows whose terms
    carry no gradient (a select, so a masked term adds nothing even where its logits are not finite)."""
    p = torch.exp(logits / temperature - logz[:, None])
    keep = (coef_sum != 0)[:, None]
    if candidates is not None:
        keep = keep & candidates
    return torch.where(keep, -coef_sum[:, None] * p, 0.0).to(dtype)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=None)


def _kernel(fn: Callable, compiled: bool) -> Callable:
    """``fn`` itself (eager, any device) or compiled with the terms dimension (and ``k``) dynamic."""
    if not compiled:
        return fn
    compiled_fn = _compiled(fn)

    def call(*args: Any) -> Any:
        for a in args:
            if isinstance(a, Tensor) and a.dim() >= 1:
                torch._dynamo.maybe_mark_dynamic(a, 0)  # noqa: SLF001 - torch's public API lives there
                if a.dim() == 2 and a.dtype == torch.int64:
                    torch._dynamo.maybe_mark_dynamic(a, 1)  # noqa: SLF001
        return compiled_fn(*args)

    return call


def _term_slice(terms: LossTerms, a: int, b: int) -> LossTerms:
    sl = slice(a, b)

    def opt(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[sl]

    return LossTerms(
        terms.targets[sl],
        terms.sampler_logprobs[sl],
        terms.advantages[sl],
        opt(terms.topk_ids),
        opt(terms.sampler_topk_logprobs),
        terms.candidates,
        opt(terms.sequence_index),
        opt(terms.sequence_log_ratio),
        opt(terms.sequence_mask_log_ratio),
        opt(terms.ref_logprobs),
    )


def _loss_coefficients(
    picked: Tensor, terms: LossTerms, normaliser: float, settings: LossSettings
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The chunk's loss, ``dL/dlogπ`` at ``ids`` (``float[c, 1 + k]``) and :func:`grpo_loss`'s statistics.

    The derivative comes from :func:`grpo_loss` itself (autograd over the chunk's
    log-probs only), so the fused head keeps the loss's semantics exactly.
    """
    with torch.enable_grad():
        logp = picked[:, 0].detach().requires_grad_(True)
        leaves = [logp]
        topk = None
        if terms.topk_ids is not None:
            topk = picked[:, 1:].detach().requires_grad_(True)
            leaves.append(topk)
        loss, stats = grpo_loss(
            logp,
            terms.sampler_logprobs,
            terms.advantages,
            normaliser,
            settings,
            topk,
            terms.sampler_topk_logprobs,
            terms.sequence_log_ratio,
            terms.sequence_mask_log_ratio,
            terms.ref_logprobs,
        )
        if not loss.requires_grad:  # nothing in the loss depends on the policy (e.g. every term masked)
            return loss.detach(), torch.zeros_like(picked), stats
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
    coef = torch.cat([grads[0][:, None]] + ([grads[1]] if topk is not None else []), 1)
    return loss.detach(), coef, stats


class _ChunkedHead:
    """One pass over the chunks of a row: log-probs, statistics and the gradients of ``hidden``/``weight``."""

    def __init__(
        self,
        terms: LossTerms,
        normaliser: float,
        settings: LossSettings,
        temperature: float,
        chunk_size: int,
        compiled: bool,
        fp32_logits: bool = False,
    ):
        self.terms, self.normaliser, self.settings = terms, normaliser, settings
        self.temperature, self.chunk_size, self.fp32_logits = temperature, chunk_size, fp32_logits
        self.stats_fn = _kernel(_term_stats, compiled)
        self.grad_fn = _kernel(_logit_grad, compiled)

    def run(
        self, hidden: Tensor, weight: Tensor, need_h: bool, need_w: bool
    ) -> tuple[Tensor, Tensor | None, Tensor | None, dict[str, Tensor]]:
        """Returns ``(loss, grad_hidden | None, grad_weight_fp32 | None, outputs)`` with ``outputs`` the
        concatenated ``logprobs``, ``entropy``, ``topk_logprobs`` and statistics."""
        m = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        loss, parts = hidden.new_zeros((), dtype=torch.float32), []
        for a in range(0, m, self.chunk_size):
            b = min(a + self.chunk_size, m)
            c_loss, c_out = self._chunk(hidden[a:b], weight, a, b, None if grad_h is None else grad_h[a:b], grad_w)
            loss = loss + c_loss
            parts.append(c_out)
        outputs = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        return loss, grad_h, grad_w, outputs

    def _chunk(
        self, h: Tensor, weight: Tensor, a: int, b: int, grad_h: Tensor | None, grad_w: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        terms = _term_slice(self.terms, a, b)
        t = self.temperature
        logits = head_logits(h, weight, self.fp32_logits)  # [c, V] fp32 (on the sampler's grid)
        cand = None
        if terms.candidates is not None:
            cand = candidate_mask(*terms.candidates, weight.shape[0], a, b)
        ids = terms.targets[:, None]
        if terms.topk_ids is not None:
            ids = torch.cat([ids, terms.topk_ids], 1)
        logz, picked, entropy = self.stats_fn(logits, cand, ids, t)
        loss, coef, stats = _loss_coefficients(picked, terms, self.normaliser, self.settings)
        out = {"logprobs": picked[:, 0], "entropy": entropy, **stats}
        if terms.topk_ids is not None:
            out["topk_logprobs"] = picked[:, 1:]
        if grad_h is None and grad_w is None:
            return loss, out
        # dL/dlogits_j = (Σ_a coef_a·1[j = id_a] − π_j·Σ_a coef_a) / T, zero outside the candidates
        valid = ids >= 0
        if cand is not None:
            valid = valid & cand.gather(1, ids.clamp_min(0))
        coef = torch.where(valid, coef, 0.0) / t
        dense = self.grad_fn(logits, cand, logz, coef.sum(1), t, weight.dtype)  # [c, V]
        del logits
        rows = ids.clamp_min(0)
        if grad_h is not None:  # [c, H] = dense @ W + Σ_a coef_a·W[id_a]
            sparse = torch.einsum("ca,cah->ch", coef, weight[rows].float())
            grad_h.copy_(_matmul_f32(dense, weight) + sparse)
        if grad_w is not None:  # [V, H] += denseᵀ @ h + Σ coef_a·h at rows id_a
            grad_w.add_(_matmul_f32(dense.t(), h))
            grad_w.index_add_(0, rows.flatten(), (coef[:, :, None] * h[:, None, :].float()).flatten(0, 1))
        return loss, out


class _FusedHeadLoss(torch.autograd.Function):
    """Loss forward that stores the finished gradients; backward scales them by ``dloss``."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, head: _ChunkedHead, outputs: dict) -> Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, grad_h, grad_w, out = head.run(hidden, weight, need_h, need_w)
        outputs.update(out)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx: Any, dloss: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        grad_h, grad_w = ctx.saved_tensors
        gh = None if grad_h is None else grad_h * dloss.to(grad_h.dtype)
        gw = None if grad_w is None else (grad_w * dloss).to(ctx.weight_dtype)
        return gh, gw, None, None


def fused_grpo_loss(
    hidden: Tensor,
    weight: Tensor,
    terms: LossTerms,
    normaliser: float,
    settings: LossSettings = _DEFAULT_SETTINGS,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    compiled: bool = False,
    fp32_logits: bool = False,
) -> HeadLoss:
    """GRPO loss of a row's loss terms, with the gradients of the head computed in the forward pass.

    Same result as ``grpo_loss(projected_logprobs(hidden, weight, ...), ...)``
    (see the module docs), in one pass over chunks of ``chunk_size`` terms.

    Args:
        hidden: ``[M, H]`` hidden states at the terms' ``token_index`` (bf16 or fp32).
        weight: ``[V, H]`` output embedding, same dtype as ``hidden``.
        terms: the per-term inputs (:class:`LossTerms`).
        normaliser: see :func:`grpo_loss` (> 0).
        settings: :class:`LossSettings`.
        temperature: sampler temperature dividing the logits.
        chunk_size: loss terms per chunk; peak extra memory is about ``chunk_size × V × 6`` bytes.
        compiled: run the elementwise/reduction stages through ``torch.compile`` (CUDA), dynamic in ``M``.
        fp32_logits: keep the logits in fp32 instead of rounding them to the compute dtype (:func:`head_logits`).

    Returns:
        :class:`HeadLoss`; ``M = 0`` gives a zero loss that still reaches ``hidden`` and ``weight``.

    Raises:
        ValueError: as :func:`grpo_loss` (score centering without top-k, bad normaliser).
    """
    if hidden.shape[0] == 0:  # a rank without samples (end of the stream): no terms, but every parameter in the graph
        k = 0 if terms.topk_ids is None else terms.topk_ids.shape[1]
        empty = hidden.new_zeros(0, dtype=torch.float32)
        sampler_topk = terms.sampler_topk_logprobs if terms.sampler_topk_logprobs is not None else empty.reshape(0, k)
        loss, stats = grpo_loss(
            empty, empty, empty, normaliser, settings, empty.reshape(0, k), sampler_topk, empty, empty, empty
        )
        loss = loss + hidden.sum() * 0.0 + weight.sum() * 0.0
        return HeadLoss(
            loss, TokenLogProbs(empty, empty, None if terms.topk_ids is None else empty.reshape(0, k)), stats
        )
    if settings.needs_sequences:
        # GSPO's ratio and the sequence masks are one per sequence, and a chunk may hold part of a sequence: a first
        # pass (no gradient, the head's matmul once more) gives every term's log π, hence each sequence's log-ratio.
        if terms.sequence_index is None:
            raise ValueError(
                f"train.loss_type {settings.loss_type!r} / train.sequence_mask need the terms' sequence_index"
            )
        plain = replace(
            settings, loss_type="grpo", score_centering=False, sequence_mask="none", tis_cap=None, kl_coef=0.0
        )
        with torch.no_grad():
            _, _, _, first = _ChunkedHead(terms, normaliser, plain, temperature, chunk_size, compiled, fp32_logits).run(
                hidden.detach(), weight.detach(), False, False
            )
        log_ratio = first["logprobs"].float() - terms.sampler_logprobs.float()
        index = terms.sequence_index
        if settings.loss_type == "gspo":
            terms = replace(terms, sequence_log_ratio=sequence_log_ratios(log_ratio, index, settings))
        if settings.sequence_mask != "none":
            seq = sequence_mask_log_ratios(log_ratio, index, settings)
            terms = replace(terms, sequence_mask_log_ratio=seq)
    head = _ChunkedHead(terms, normaliser, settings, temperature, chunk_size, compiled, fp32_logits)
    outputs: dict[str, Tensor] = {}
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss = _FusedHeadLoss.apply(hidden, weight, head, outputs)
    else:
        loss, _, _, out = head.run(hidden, weight, False, False)
        outputs.update(out)
    token = TokenLogProbs(outputs.pop("logprobs"), outputs.pop("entropy"), outputs.pop("topk_logprobs", None))
    return HeadLoss(loss, token, outputs)
