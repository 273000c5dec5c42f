"""Per-sequence decode state of the embedded server's running batch, for every kind of layer.

Attention layers keep keys and values ``[B, H_kv, T, D]`` that grow by one column per decode step;
rows of different lengths are left-padded (the attention mask marks the padding). Linear-attention
layers (the Gated DeltaNet layers of Qwen3.5 / Qwen3-Next hybrids) keep a fixed-size state per
sequence instead: the convolution's last inputs ``[B, C, K]`` and the recurrent matrix state
``[B, H, Dk, Dv]``. Left padding never reaches that state (transformers zeroes padded inputs of
recurrent layers, and a zero input leaves a zero state at zero), so joining two batches concatenates
the recurrent states and left-pads only the attention layers, as continuous batching needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """``t`` with zeros prepended along ``dim`` up to ``length``."""
    pad = length - t.shape[dim]
    if pad <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def has_linear_layers(config: PretrainedConfig) -> bool:
    """Whether the model's decoder has linear-attention (recurrent) layers."""
    text = config.get_text_config(decoder=True)
    return "linear_attention" in (getattr(text, "layer_types", None) or [])


@dataclass(frozen=True)
class BatchCache:
    """Decode state of B sequences, one entry per decoder layer.

    Attributes:
        layers: per layer ``(keys, values)`` ``[B, H_kv, T, D]`` (attention) or
            ``(conv_state, recurrent_state)`` ``[B, C, K]`` / ``[B, H, Dk, Dv]`` (linear attention).
        linear: per layer, whether it is a linear-attention layer.
    """

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    linear: tuple[bool, ...]

    @classmethod
    def from_dynamic_cache(cls, cache: DynamicCache) -> BatchCache:
        """Take the state a forward left in transformers' cache."""
        layers, linear = [], []
        for layer in cache.layers:
            is_linear = isinstance(layer, LinearAttentionCacheLayerMixin)
            linear.append(is_linear)
            layers.append(
                (layer.conv_states[0], layer.recurrent_states[0]) if is_linear else (layer.keys, layer.values)
            )
        return cls(layers, tuple(linear))

    def to_dynamic_cache(self, config: PretrainedConfig) -> DynamicCache:
        """A transformers cache holding this state (the next forward appends to it)."""
        if not any(self.linear):
            return DynamicCache(ddp_cache_data=self.layers)
        cache = new_cache(config)
        for layer, (a, b), is_linear in zip(cache.layers, self.layers, self.linear, strict=True):
            if is_linear:
                layer.update_conv_state(a)
                layer.update_recurrent_state(b)
            else:
                layer.update(a, b)
        return cache

    def merge(self, other: BatchCache) -> BatchCache:
        """Rows of ``self`` then ``other``; attention state left-padded to the longer one."""
        length = max(
            (a.shape[2] for (a, _), lin in zip(self.layers + other.layers, self.linear * 2) if not lin), default=0
        )

        def join(x: torch.Tensor, y: torch.Tensor, is_linear: bool) -> torch.Tensor:
            return torch.cat([x, y]) if is_linear else torch.cat([left_pad(x, length, 2), left_pad(y, length, 2)])

        layers = [
            (join(a1, a2, lin), join(b1, b2, lin))
            for (a1, b1), (a2, b2), lin in zip(self.layers, other.layers, self.linear, strict=True)
        ]
        return BatchCache(layers, self.linear)

    def select(self, index: torch.Tensor, start: int) -> BatchCache:
        """Rows ``index``; attention state from column ``start`` on (leading all-padding columns dropped)."""
        layers = [
            (a[index], b[index]) if lin else (a[index, :, start:], b[index, :, start:])
            for (a, b), lin in zip(self.layers, self.linear, strict=True)
        ]
        return BatchCache(layers, self.linear)


def new_cache(config: PretrainedConfig) -> DynamicCache:
    """An empty cache: one layer object per decoder layer of a hybrid model (its recurrent layers
    look their state up by index), else layers created as the forward fills them."""
    return DynamicCache(config=config) if has_linear_layers(config) else DynamicCache()
