"""Activation checkpointing, compilation and FSDP2 sharding of the policy, in torchtitan's
order (``torchtitan/models/llama3/infra/parallelize.py``): checkpointing wraps each
decoder layer's forward, ``torch.compile`` compiles that wrapped forward (so a selective
policy sees the individual ops inside the compiled graph), then ``fully_shard`` puts
each layer and the root under FSDP2 (its hooks stay outside the compiled code).

Each step replaces a layer's ``forward`` attribute and never the module, so parameter
names, state dicts and weight-sync names are those of the unwrapped model.

Activation checkpointing policies (``train.gradient_checkpointing``), as torchtitan's:

* ``none``: every activation is kept for the backward pass.
* ``full``: each layer keeps only its inputs and recomputes its forward in backward.
* ``selective``: with ``train.selective_checkpointing = "op"`` every layer keeps the
  outputs of its attention and of every other matmul and recomputes the rest (cheap
  elementwise ops and half the matmuls); with an integer ``n``, every ``n``-th layer is
  fully checkpointed and the others keep everything.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
#: Ops whose outputs op-level selective checkpointing keeps (the compute-bound ones; torchtitan's list).
_SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten.max.default,
    torch.ops.higher_order.flex_attention,
}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (transformers' ``GradientCheckpointingLayer`` instances), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _op_policy() -> Callable:
    """Save the listed ops' outputs, except every second matmul (counted separately in forward and recompute)."""
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in (_aten.mm.default, _aten.addmm.default):
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_op_policy())


def _checkpointed(forward: Callable, op_level: bool) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        if op_level:
            return checkpoint(forward, *args, use_reentrant=False, context_fn=_op_context, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def checkpointed_layers(num_layers: int, mode: str, selective: str | int) -> list[str | None]:
    """Per layer: ``"full"``, ``"op"`` or None (no checkpointing) for a policy (see module docs).

    Raises:
        ValueError: an unknown mode or a bad ``selective`` option.
    """
    if mode == "none":
        return [None] * num_layers
    if mode == "full":
        return ["full"] * num_layers
    if mode != "selective":
        raise ValueError(f"train.gradient_checkpointing must be none, selective or full, got {mode!r}")
    if selective == "op":
        return ["op"] * num_layers
    if isinstance(selective, int) and selective >= 1:
        return ["full" if (i + 1) % selective == 0 else None for i in range(num_layers)]
    raise ValueError(f"train.selective_checkpointing must be 'op' or an integer >= 1, got {selective!r}")


def apply_layer_wrappers(
    policy: nn.Module,
    checkpointing: str = "none",
    selective: str | int = "op",
    compile_layers: bool = False,
    backend: str = "inductor",
) -> list[nn.Module]:
    """Checkpoint and/or compile each decoder layer's forward in place; returns the layers.

    Compilation (``torch.compile`` with ``backend``) is static in shape (rows are
    padded to length buckets) and shared by all layers: one graph per bucket length.
    """
    layers = decoder_layers(policy)
    plan = checkpointed_layers(len(layers), checkpointing, selective)
    for layer, ac in zip(layers, plan):
        forward = layer.forward
        if ac is not None:
            forward = _checkpointed(forward, op_level=ac == "op")
        if compile_layers:
            forward = torch.compile(forward, backend=backend, dynamic=False)
        if forward is not layer.forward:
            layer.forward = forward
    if any(plan):
        logger.info("activation checkpointing %s: %d of %d layers", checkpointing, sum(map(bool, plan)), len(plan))
    return layers


def shard(policy: nn.Module, mixed_precision: bool, reshard_after_forward: bool = True, prefetch: int = 1) -> nn.Module:
    """FSDP2: each decoder layer, then the root. bf16 compute + fp32 reduce when ``mixed_precision``.

    Args:
        policy: the (checkpointed, compiled) policy, unsharded.
        mixed_precision: bf16 parameters in compute, fp32 gradient reduction; the root's inputs (the
            sampler's log-probs, advantages) stay as given (fp32).
        reshard_after_forward: free each layer's gathered parameters after its forward
            (and all-gather them again in backward); False keeps them until the backward
            pass (more memory, one all-gather per layer and step less). The last layer and
            the root never reshard: backward needs them at once.
        prefetch: layers whose all-gather each layer issues explicitly ahead of time, in
            forward (next layers) and backward (previous layers); 0 = FSDP2's implicit order.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    kwargs = {"mp_policy": mp} if mp is not None else {}
    layers = decoder_layers(policy)
    for i, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=reshard_after_forward and i < len(layers) - 1, **kwargs)
    # The root's inputs are token ids, the tree mask and the loss inputs: FSDP2 would cast every float tensor in
    # them (dataclass fields included) to bf16, rounding the sampler's log-probs by up to 1/32 nat at log μ ≈ -10
    # before the importance ratio; only the layers (hidden states) compute in bf16.
    root = (
        {
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
            )
        }
        if mp is not None
        else {}
    )
    fully_shard(policy, reshard_after_forward=False, **root)
    if prefetch > 0 and layers:
        policy.set_modules_to_forward_prefetch(layers[:prefetch])
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + prefetch])
            layer.set_modules_to_backward_prefetch(layers[max(0, i - prefetch) : i][::-1])
    return policy


def resolve_reshard_after_forward(choice: str, policy: nn.Module, device: torch.device) -> bool:
    """``train.fsdp_reshard_after_forward``: ``always`` / ``never``, or ``auto``: on CUDA keep the
    gathered parameters (no reshard) when a full bf16 copy of them takes under a tenth of the device's
    memory (one all-gather, or with one rank one cast-copy, per layer and step less), else reshard;
    on CPU reshard (memory over speed)."""
    if choice != "auto":
        return choice == "always"
    if device.type != "cuda":
        return True
    full_bytes = 2 * sum(p.numel() for p in policy.parameters())
    return full_bytes > torch.cuda.get_device_properties(device).total_memory / 10
