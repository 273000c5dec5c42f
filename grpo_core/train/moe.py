"""Mixture-of-experts decoders on packed tree rows: the routers' load-balancing loss and its weight.

A tree row forwards each token of its prefix trie once, with its own sample's history (tree attention), so every
router sees, for every forwarded token, the hidden state that token has in its sample alone. The load-balancing
loss of a row is therefore transformers' ``load_balancing_loss_func`` (Switch Transformer, Fedus et al. 2021,
arXiv 2101.03961, eq. 4-6, as ``transformers.models.qwen3_moe.modeling_qwen3_moe`` computes it for Qwen3-MoE and
the Qwen3.5 MoE hybrids) over the row's forwarded tokens: the padding after them is left out, and a prefix shared
by several samples counts once, as it is forwarded once.

With E experts, top-k routing, the router logits of the row's N forwarded tokens in each of the model's L MoE
layers, p the softmax of a token's logits and T its k chosen experts::

    f_e = Σ_layers Σ_tokens 1[e ∈ T] / (L·N)     P_e = Σ_layers Σ_tokens p_e / (L·N)     aux = E · Σ_e f_e·P_e

Only ``P`` carries a gradient (the top-k choice is not differentiable), as in transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_core.errors import ConfigError


@dataclass(frozen=True)
class MoeRouting:
    """The routing of a mixture-of-experts decoder, from its (text) config.

    Attributes:
        num_experts: experts per MoE layer ``E`` (``num_experts``; ``num_local_experts`` in Mixtral-style configs).
        top_k: experts each token is routed to (``num_experts_per_tok``).
        config_coef: the model config's ``router_aux_loss_coef`` (0 when it has none).
    """

    num_experts: int
    top_k: int
    config_coef: float


def moe_routing(model_config: Any) -> MoeRouting | None:
    """The routing of a transformers model config (a VLM's text config is read), or None for a dense model."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not num_experts or not top_k:
        return None
    return MoeRouting(int(num_experts), int(top_k), float(getattr(cfg, "router_aux_loss_coef", None) or 0.0))


def resolve_router_aux_loss_coef(coef: float | None, model_config: Any, model_name: str) -> float:
    """The weight of the load-balancing loss for ``train.router_aux_loss_coef`` and the model's config.

    Args:
        coef: ``train.router_aux_loss_coef``: None = the model config's value, 0 = off.
        model_config: the model's transformers config (``config.json``).
        model_name: ``model.name``, for the message.

    Returns:
        The weight (>= 0); 0 for a dense model or when turned off.

    Raises:
        ConfigError: a nonzero ``coef`` for a dense model (no ``num_experts``/``num_experts_per_tok`` in its config).
    """
    routing = moe_routing(model_config)
    if routing is None:
        if coef:
            raise ConfigError(
                f"train.router_aux_loss_coef={coef} weighs the router load-balancing loss of mixture-of-experts "
                f"models, but model.name={model_name!r} is dense (its config has no num_experts / "
                "num_experts_per_tok); unset train.router_aux_loss_coef or set it to 0"
            )
        return 0.0
    return routing.config_coef if coef is None else float(coef)


def records_router_logits(decoder: torch.nn.Module) -> bool:
    """Whether a transformers decoder returns its routers' logits when called with ``output_router_logits=True``
    (its class declares a ``router_logits`` output recorder)."""
    return "router_logits" in (getattr(type(decoder), "_can_record_outputs", None) or {})


def load_balancing_loss(router_logits: Sequence[Tensor], num_experts: int, top_k: int, num_tokens: int) -> Tensor:
    """The load-balancing loss of one packed row over its first ``num_tokens`` positions (see the module docs).

    Args:
        router_logits: per MoE layer, ``[L_row, E]`` router logits of the row's positions (the decoder's
            ``router_logits`` output for a batch of one row), any float dtype.
        num_experts: ``E``.
        top_k: experts per token.
        num_tokens: forwarded tokens of the row (``PackedRow.num_forwarded``); the positions after them are padding.

    Returns:
        Scalar float32 loss, differentiable through the routing probabilities; a row without tokens (or a model
        without MoE layer outputs) gives 0 that still reaches the logits.

    Raises:
        ValueError: ``num_tokens`` larger than the row, or logits whose last dimension is not ``num_experts``.
    """
    if not router_logits:
        raise ValueError("no router logits: the decoder recorded none (was it called with output_router_logits=True?)")
    length = router_logits[0].shape[0]
    if not 0 <= num_tokens <= length or router_logits[0].shape[-1] != num_experts:
        raise ValueError(
            f"router logits of shape {tuple(router_logits[0].shape)} for {num_tokens} tokens and {num_experts} experts"
        )
    if num_tokens == 0:
        return torch.stack([logits.float().sum() for logits in router_logits]).sum() * 0.0
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    for logits in router_logits:
        p = torch.softmax(logits[:num_tokens], dim=-1)  # in the logits' dtype, as transformers
        chosen = torch.topk(p, top_k, dim=-1).indices
        counts = counts + torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
        probs = probs + p.float().sum(0)
    rows = float(len(router_logits) * num_tokens)
    return (counts / rows * (probs / rows)).sum() * num_experts
