"""Log-probs of the trained tokens of a packed row, without full-vocabulary logits
for every position.

The decoder runs on the row's forwarded tokens (tree attention, positions =
depth); only the ``M`` hidden states that predict a trained token are gathered,
and the vocabulary projection runs over chunks of those ``M`` rows under
activation checkpointing, so at most ``chunk_size × V`` logits exist at once,
in the forward and in the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint



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


def _chunk(h: Tensor, weight: Tensor, targets: Tensor, temperature: float,
           topk_ids: Tensor | None, candidates: Tensor | None) -> tuple[Tensor, ...]:
    logits = (h @ weight.T).float() / temperature  # [c, V]
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


def candidate_mask(offsets: Tensor, ids: Tensor, vocab_size: int) -> Tensor:
    """Dense ``bool[M, V]`` candidate set from a CSR sampling mask.

    An empty entry means "the full vocabulary" (samples without a mask).
    """
    m = offsets.shape[0] - 1
    counts = offsets[1:] - offsets[:-1]
    rows = torch.repeat_interleave(torch.arange(m, device=ids.device), counts.to(ids.device))
    mask = torch.zeros(m, vocab_size, dtype=torch.bool, device=ids.device)
    mask[rows, ids.long()] = True
    mask[counts.to(ids.device) == 0] = True
    return mask


def projected_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    topk_ids: Tensor | None = None,
    candidates: Tensor | None = None,
    chunk_size: int = 1024,
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
    """
    outs = []
    for a in range(0, hidden.shape[0], chunk_size):
        sl = slice(a, a + chunk_size)
        args = (hidden[sl], weight, targets[sl], temperature,
                None if topk_ids is None else topk_ids[sl], None if candidates is None else candidates[sl])
        if torch.is_grad_enabled() and hidden.requires_grad:
            outs.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            outs.append(_chunk(*args))
    cat = [torch.cat(parts) for parts in zip(*outs)] if outs else []
    if not cat:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return TokenLogProbs(empty, empty, None if topk_ids is None else hidden.new_zeros(0, topk_ids.shape[1]))
    return TokenLogProbs(cat[0], cat[1], cat[2] if len(cat) > 2 else None)
