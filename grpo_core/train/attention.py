"""Tree attention: each token of a packed row attends to its trie ancestors and itself.

A packed row (``grpo_core.packing.PackedRow``) carries ``subtree_end``: key ``j``
is visible to query ``q`` iff ``j <= q < subtree_end[j]``. That one array drives
both paths, registered as the transformers attention implementation
``"grpo_tree"``:

* CPU (and CUDA fallback): ``scaled_dot_product_attention`` with a dense
  boolean ``[N, N]`` mask (FlexAttention has no backward on CPU).
* CUDA: compiled FlexAttention with a block mask whose ``mask_mod`` reads a
  persistent ``subtree_end`` buffer of the padded length, so rows of the same
  length bucket reuse one compiled kernel and never recompile (DESIGN.md §9).
  Building the next row of a bucket overwrites that buffer, so a row's mask is
  valid only until then: build it just before the row's forward and backward
  (:meth:`TreeMask.check_current` refuses a mask whose buffer was overwritten).

The mask is passed to the model as the ``tree_mask`` keyword of ``forward``;
transformers forwards it to every attention layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

TREE_ATTENTION = "grpo_tree"


@dataclass
class TreeMask:
    """Visibility of one packed (and possibly padded) row.

    Attributes:
        subtree_end: ``int32[L]`` on the model's device; ``L`` >= forwarded
            tokens ``N``; padding positions ``p >= N`` hold ``p + 1`` (they see
            only themselves and nobody sees them).
        dense: ``bool[1, 1, L, L]`` visibility for SDPA, or None on the flex path.
        block_mask: FlexAttention ``BlockMask`` on CUDA, or None.
        recurrence: recurrent-layer plans of this row by convolution kernel size, filled on first
            use by ``grpo_core.train.recurrent`` (Gated DeltaNet hybrids).
        owner: the :class:`FlexTreeMasks` whose shared bucket buffer ``subtree_end`` is, or None.
        generation: which build of that bucket this mask is (see :meth:`check_current`).
    """

    subtree_end: Tensor
    dense: Tensor | None = None
    block_mask: object | None = None
    recurrence: dict = field(default_factory=dict)
    owner: object | None = None
    generation: int = 0

    def check_current(self) -> None:
        """Refuse a flex mask whose bucket buffer a later :meth:`FlexTreeMasks.build` overwrote.

        The ``mask_mod`` of every row of a length bucket reads one buffer, so a mask built before
        another row of the same bucket would attend with that other row's tree (wrong context for
        its tokens, silently). A host-side check, no device work.

        Raises:
            RuntimeError: the buffer now holds another row.
        """
        if self.owner is not None and self.owner.generation(self.length) != self.generation:
            raise RuntimeError(
                f"stale FlexAttention tree mask: another row of length bucket {self.length} was built after it and "
                "overwrote the shared subtree_end buffer; build each row's mask (FlexTreeMasks.build) just before "
                "its forward and backward"
            )

    @property
    def length(self) -> int:
        """Padded row length ``L``."""
        return int(self.subtree_end.shape[0])


def pad_subtree_end(subtree_end: Tensor, length: int) -> Tensor:
    """Pad ``subtree_end`` (``int[N]``) to ``length`` with self-only positions.

    Raises:
        ValueError: ``length`` < ``N``.
    """
    n = subtree_end.shape[0]
    if length < n:
        raise ValueError(f"pad length {length} is shorter than the row ({n} tokens)")
    pad = torch.arange(n + 1, length + 1, dtype=subtree_end.dtype, device=subtree_end.device)
    return torch.cat([subtree_end, pad])


def dense_tree_mask(subtree_end: Tensor) -> Tensor:
    """``bool[1, 1, L, L]``: ``mask[q, j] = j <= q < subtree_end[j]``."""
    idx = torch.arange(subtree_end.shape[0], device=subtree_end.device)
    q, j = idx[:, None], idx[None, :]
    return ((j <= q) & (q < subtree_end[None, :])).unsqueeze(0).unsqueeze(0)


def tree_block_masks(subtree_end: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Block-level visibility of a (padded) row, straight from ``subtree_end``.

    For query block ``a`` and key block ``b < a``: some pair is visible iff a key of
    ``b`` has ``subtree_end > a·B`` (the block's first query), and every pair is
    visible iff every key of ``b`` has ``subtree_end >= (a+1)·B``; a diagonal block is
    always partly visible (each token sees itself) and never wholly (keys after
    queries); blocks above the diagonal see nothing. This is what
    ``create_block_mask`` finds by evaluating the mask at all ``L²`` pairs, in
    ``O(L + (L/B)²)`` work.

    Args:
        subtree_end: ``int32[L]``, ``L`` a multiple of ``block_size``.
        block_size: ``B``.

    Returns:
        ``(partial, full)``: ``int8[1, 1, L/B, L/B]`` each, in FlexAttention's layout.

    Raises:
        ValueError: ``L`` is not a multiple of ``block_size``.
    """
    length = subtree_end.shape[0]
    if length % block_size:
        raise ValueError(f"row length {length} is not a multiple of the attention block size {block_size}")
    ends = subtree_end.view(-1, block_size)
    idx = torch.arange(ends.shape[0], device=subtree_end.device)
    first_q = idx * block_size  # first query of each query block
    below = idx[None, :] < idx[:, None]  # [a, b]: key block b before query block a
    some = below & (ends.amax(1)[None, :] > first_q[:, None])
    full = below & (ends.amin(1)[None, :] >= first_q[:, None] + block_size)
    partial = (some & ~full) | (idx[None, :] == idx[:, None])
    return partial.to(torch.int8)[None, None], full.to(torch.int8)[None, None]


class FlexTreeMasks:
    """Block masks for FlexAttention over rows padded to a few length buckets.

    One persistent ``subtree_end`` buffer per bucket; each new row is copied
    into it in place, so the ``mask_mod`` closure (and the compiled kernel that
    reads it) is the same object for every row of that bucket. The block
    structure comes from :func:`tree_block_masks` (no ``L × L`` mask is built and
    nothing waits for the device).
    """

    def __init__(self, device: torch.device, block_size: int = 128):
        self.device = device
        self.block_size = block_size
        self._buffers: dict[int, tuple[Tensor, object]] = {}
        self._generations: dict[int, int] = {}

    def generation(self, length: int) -> int:
        """How many rows of bucket ``length`` were built so far (the latest mask's ``generation``)."""
        return self._generations.get(length, 0)

    def build(self, subtree_end: Tensor, length: int) -> TreeMask:
        """A TreeMask for a row padded to ``length`` (a bucket, a multiple of the block size).

        Valid until the next ``build`` of the same ``length`` (it overwrites the bucket's buffer):
        run the row's forward and backward before building another row of that bucket.
        """
        from torch.nn.attention.flex_attention import _create_sparse_block_from_block_mask

        if length not in self._buffers:
            buf = torch.zeros(length, dtype=torch.int32, device=self.device)

            def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:  # noqa: ARG001 - flex_attention's
                return (kv_idx <= q_idx) & (q_idx < buf[kv_idx])

            self._buffers[length] = (buf, mask_mod)
        buf, mask_mod = self._buffers[length]
        buf.copy_(pad_subtree_end(subtree_end.to(self.device, torch.int32), length))
        block_mask = _create_sparse_block_from_block_mask(
            tree_block_masks(buf, self.block_size), mask_mod, (length, length), self.block_size, self.block_size
        )
        self._generations[length] = self.generation(length) + 1
        return TreeMask(subtree_end=buf, block_mask=block_mask, owner=self, generation=self._generations[length])


@functools.cache
def _compiled_flex_attention() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def tree_attention(
    module: torch.nn.Module,  # noqa: ARG001 - transformers' attention-function signature
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,  # noqa: ARG001 - the tree mask replaces it
    dropout: float = 0.0,
    scaling: float | None = None,
    tree_mask: TreeMask | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The ``grpo_tree`` attention implementation.

    Args:
        query: ``[1, H_q, L, D]``. key, value: ``[1, H_kv, L, D]`` (GQA allowed).
        tree_mask: the row's :class:`TreeMask` (keyword of the model's forward).

    Returns:
        ``([1, L, H_q, D], None)``, the layout transformers expects.

    Raises:
        ValueError: no ``tree_mask`` was passed, or its length differs from ``L``.
    """
    if tree_mask is None:
        raise ValueError(f"attn_implementation={TREE_ATTENTION!r} needs the `tree_mask` keyword in forward()")
    if tree_mask.length != query.shape[2]:
        raise ValueError(f"tree_mask covers {tree_mask.length} positions but the row has {query.shape[2]}")
    gqa = query.shape[1] != key.shape[1]
    if tree_mask.block_mask is not None:
        out = _compiled_flex_attention()(
            query, key, value, block_mask=tree_mask.block_mask, scale=scaling, enable_gqa=gqa
        )
    else:
        mask = tree_mask.dense if tree_mask.dense is not None else dense_tree_mask(tree_mask.subtree_end)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
        )
    return out.transpose(1, 2).contiguous(), None


def register_tree_attention() -> None:
    """Register ``grpo_tree`` with transformers (attention and a no-op mask builder)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TREE_ATTENTION, tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, lambda *args, **kwargs: None)
