"""Per-row sampling with vLLM's processed log-probs, for the embedded server's batched decode.

The order follows vLLM's V1 sampler (``vllm/v1/sample/sampler.py``): greedy rows take the
argmax of the raw logits and report ``log_softmax(logits)``; random rows divide by the
temperature, apply min-p (relative to the top probability), then top-k, then top-p
(drop the tail whose cumulative mass, counted from the least likely token, is <= 1 - p;
the most likely token is always kept), and sample from the renormalised distribution.
The reported log-probs are ``log_softmax`` of those filtered logits — vLLM's
``--logprobs-mode processed_logprobs`` — so filtered-out tokens get ``-inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowSampling:
    """Sampling parameters of the rows of one decode step, as tensors on the logits' device.

    Attributes:
        temperature: ``[B]`` float32; 0 marks a greedy row.
        top_k: ``[B]`` int64; 0 = off.
        top_p: ``[B]`` float32 in (0, 1]; 1 = off.
        min_p: ``[B]`` float32 in [0, 1]; 0 = off.
        generators: one ``torch.Generator`` or None (unseeded) per row.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    generators: list[torch.Generator | None]


def _apply_filters(logits: torch.Tensor, params: RowSampling) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p on ``[B, V]`` float32 logits; masked entries become -inf."""
    temperature = torch.where(params.temperature > 0, params.temperature, torch.ones_like(params.temperature))
    logits = logits / temperature[:, None]
    if bool((params.min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * params.min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    use_k = params.top_k > 0
    if bool(use_k.any()):
        k = torch.where(use_k, params.top_k, torch.full_like(params.top_k, logits.shape[-1])).clamp(
            max=logits.shape[-1]
        )
        kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if bool((params.top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - params.top_p[:, None])
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, params: RowSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return it with the processed log-probs of every token.

    Args:
        logits: ``[B, V]`` next-token logits (any float dtype; computed in float32).
        params: per-row sampling parameters (``RowSampling``).

    Returns:
        ``(tokens, logprobs)``: ``tokens`` ``[B]`` int64 sampled ids; ``logprobs`` ``[B, V]``
        float32 processed log-probs (vLLM ``processed_logprobs``), ``-inf`` outside the
        candidate set of random rows.
    """
    logits = logits.float()
    greedy = params.temperature <= 0
    processed = _apply_filters(logits, params)
    processed = torch.where(greedy[:, None], logits, processed)
    logprobs = processed.log_softmax(dim=-1)
    tokens = logits.argmax(dim=-1)
    random_rows = (~greedy).nonzero().flatten().tolist()
    if random_rows:
        # Inverse-CDF sampling: one uniform draw per row from that row's generator (seeded rows
        # repeat exactly); token i is drawn when cdf[i-1] <= u < cdf[i], i.e. with probability p_i,
        # and tokens outside the candidate set (p = 0) never are.
        cdf = logprobs[random_rows].exp().cumsum(dim=-1)
        uniform = torch.cat(
            [torch.rand(1, generator=params.generators[row], device=logits.device) for row in random_rows]
        )
        picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(-1)
        tokens[random_rows] = picked.clamp(max=logits.shape[-1] - 1)
    return tokens, logprobs
