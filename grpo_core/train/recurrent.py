"""Gated DeltaNet layers over packed tree rows (the linear-attention half of Qwen3.5-style hybrids).

A hybrid such as Qwen3.5 or Qwen3-Next alternates full attention with Gated DeltaNet layers:
a short depthwise causal convolution (kernel ``K``, 4 in Qwen3.5) over the q/k/v projections,
then the gated delta rule, a recurrence over a matrix state ``S`` per head
(Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025, eq. 10):
``S_t = exp(g_t) S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T``, ``o_t = S_t q_t``.

A packed row is a prefix trie laid out depth first (``grpo_core.train.attention``), so both
parts must follow the trie, not the row (the seed manual's tree-packing section):

* the convolution mixes each token with its ``K - 1`` nearest trie **ancestors** (zeros above
  the root), never with the row neighbours of another branch;
* the chunked delta rule runs per **segment** (a maximal chain of tokens each of which is the only
  child of the token before it) and starts each segment from the recurrent state at the end of its
  parent segment (zeros for a root).

Segments at the same depth of the segment tree run as one batch of the chunked kernel
(``torch_chunk_gated_delta_rule`` of the model's transformers module, which is FLA's Triton
kernel when ``fla`` is installed), padded to the longest with ``k = 0, b = 0, g = 0`` so the
padded steps leave the state unchanged. The plan (parents, segments, levels) is computed once per
row from the row's ``subtree_end`` and cached on its :class:`TreeMask`.

:func:`install_tree_recurrence` routes the supported layers through :func:`tree_gated_delta_net`
whenever ``forward`` receives a ``tree_mask`` (an attention-implementation-like hook; without it
the layer runs its own code, e.g. with a KV/recurrent cache in the embedded server).
:func:`check_packable` refuses, at start, layers that cannot be packed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import TreeMask

#: Gated DeltaNet classes whose projections this module knows (transformers 5.17).
SUPPORTED_RECURRENT = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet")


def trie_parents(subtree_end: np.ndarray) -> np.ndarray:
    """Parent of every packed position, from the row's visibility array.

    Args:
        subtree_end: ``int[L]``; key ``j`` is an ancestor of (or equal to) ``q`` iff
            ``j <= q < subtree_end[j]`` (padding positions hold ``p + 1``).

    Returns:
        ``int64[L]``: the nearest ancestor of each position, ``-1`` for roots (and padding).
        In depth-first order the parent of ``i`` is the last position before ``i`` whose depth is
        ``depth(i) - 1``; depths come from a difference array over the ``(j, subtree_end[j])`` spans.
    """
    end = np.asarray(subtree_end, dtype=np.int64)
    n = end.shape[0]
    idx = np.arange(n, dtype=np.int64)
    diff = np.bincount(idx + 1, minlength=n + 1) - np.bincount(end, minlength=n + 1)
    depth = np.cumsum(diff)[:n]
    key = depth * (n + 1) + idx
    order = np.argsort(key, kind="stable")
    pos = np.searchsorted(key[order], (depth - 1) * (n + 1) + idx) - 1
    cand = order[np.clip(pos, 0, None)]
    ok = (depth > 0) & (pos >= 0) & (depth[cand] == depth - 1)
    return np.where(ok, cand, -1)


@dataclass
class _Level:
    """One batched kernel call: the segments of one depth of the segment tree.

    Attributes:
        index: ``int64[B, T]`` packed positions of each segment, padded with ``L`` (a zero row).
        parent: ``int64[B]`` index of each segment's parent in the previous level's batch (None at level 0).
        src: ``int64[V]`` flat positions in ``B * T`` holding real tokens.
        dest: ``int64[V]`` their packed positions.
    """

    index: Tensor
    parent: Tensor | None
    src: Tensor
    dest: Tensor


@dataclass
class RecurrencePlan:
    """How a packed row runs through recurrent layers (shared by every layer of a forward).

    Attributes:
        length: padded row length ``L``.
        ancestors: ``int64[K - 1, L]``; row ``d`` holds each position's ``(d + 1)``-th ancestor,
            ``L`` (a zero row) where there is none.
        levels: the batched kernel calls, parents' level first.
    """

    length: int
    ancestors: Tensor
    levels: list[_Level]


def _segments(parent: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segment starts, lengths and parent segments (``-1`` for roots); isolated positions
    (no parent, no child: padding) belong to no segment."""
    n = parent.shape[0]
    idx = np.arange(n)
    children = np.bincount(parent[parent >= 0], minlength=n)
    active = ~((parent < 0) & (end == idx + 1))
    start = active.copy()
    start[1:] &= children[:-1] != 1
    starts = np.nonzero(start)[0]
    seg_of = np.cumsum(start) - 1
    lengths = np.bincount(seg_of[active], minlength=len(starts))
    first_parent = parent[starts]
    parent_seg = np.where(first_parent >= 0, seg_of[np.clip(first_parent, 0, None)], -1)
    has = parent_seg >= 0
    # Internal invariant: a segment's parent token (>= 2 children, or a sample end) ends its segment.
    assert np.all(starts[parent_seg[has]] + lengths[parent_seg[has]] - 1 == first_parent[has])
    return starts, lengths, parent_seg


def plan_recurrence(subtree_end: Tensor, kernel_size: int) -> RecurrencePlan:
    """Build the :class:`RecurrencePlan` of a row (one host copy of ``subtree_end``).

    Args:
        subtree_end: ``int[L]`` on the model's device (see :class:`TreeMask`).
        kernel_size: the convolution's kernel ``K``.
    """
    device = subtree_end.device
    end = subtree_end.detach().cpu().numpy().astype(np.int64)
    n = end.shape[0]
    parent = trie_parents(end)
    parent_ext = np.append(np.where(parent >= 0, parent, n), n)
    anc = [parent_ext[:n]]
    for _ in range(kernel_size - 2):
        anc.append(parent_ext[anc[-1]])
    starts, lengths, parent_seg = _segments(parent, end)
    level = np.zeros(len(starts), dtype=np.int64)
    for s in range(len(starts)):  # parents precede children in depth-first order
        if parent_seg[s] >= 0:
            level[s] = level[parent_seg[s]] + 1
    slot = np.zeros(len(starts), dtype=np.int64)
    levels = []
    for lv in range(int(level.max()) + 1 if len(starts) else 0):
        segs = np.nonzero(level == lv)[0]
        slot[segs] = np.arange(len(segs))
        t = int(lengths[segs].max())
        index = starts[segs, None] + np.arange(t)[None, :]
        valid = np.arange(t)[None, :] < lengths[segs, None]
        index = np.where(valid, index, n)
        src = np.nonzero(valid.ravel())[0]

        def as_t(a: np.ndarray) -> Tensor:
            return torch.as_tensor(a, dtype=torch.int64, device=device)

        levels.append(
            _Level(as_t(index), None if lv == 0 else as_t(slot[parent_seg[segs]]), as_t(src), as_t(index.ravel()[src]))
        )
    ancestors = torch.as_tensor(np.stack(anc) if anc else np.zeros((0, n), np.int64), dtype=torch.int64, device=device)
    return RecurrencePlan(n, ancestors, levels)


def recurrence_plan(tree_mask: TreeMask, kernel_size: int) -> RecurrencePlan:
    """The row's plan for kernel ``K``, built on first use and cached on the mask."""
    plan = tree_mask.recurrence.get(kernel_size)
    if plan is None:
        plan = tree_mask.recurrence[kernel_size] = plan_recurrence(tree_mask.subtree_end, kernel_size)
    return plan


def tree_causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None, ancestors: Tensor) -> Tensor:
    """Depthwise causal convolution along trie paths, then SiLU.

    Args:
        x: ``[L, C]`` pre-convolution features.
        weight: ``[C, K]`` (``nn.Conv1d`` weight squeezed); tap ``K - 1 - d`` reads the ``d``-th ancestor.
        bias: ``[C]`` or None.
        ancestors: ``int64[K - 1, L]`` from the plan (``L`` = none).

    Returns:
        ``[L, C]`` in ``x``'s dtype; equals transformers' ``causal_conv1d_fn`` on each sample alone.
    """
    k = weight.shape[1]
    xw = x.to(weight.dtype)
    ext = torch.cat([xw, xw.new_zeros(1, xw.shape[1])])
    out = xw * weight[:, k - 1]
    for d in range(1, k):
        out = out + ext.index_select(0, ancestors[d - 1]) * weight[:, k - 1 - d]
    if bias is not None:
        out = out + bias
    return F.silu(out).to(x.dtype)


def tree_delta_rule(
    chunk_fn: Callable[..., Any],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    plan: RecurrencePlan,
) -> Tensor:
    """Chunked gated delta rule per segment, each started from its parent segment's final state.

    Args:
        chunk_fn: transformers' ``torch_chunk_gated_delta_rule`` (or FLA's ``chunk_gated_delta_rule``).
        query, key: ``[L, H, Dk]``; value: ``[L, H, Dv]``; g (log decay, <= 0), beta: ``[L, H]``.
        plan: the row's :class:`RecurrencePlan`.

    Returns:
        ``[L, H, Dv]``; zeros at positions in no segment (padding).
    """

    def ext(x: Tensor) -> Tensor:
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])

    q, k, v, gx, bx = (ext(x) for x in (query, key, value, g, beta))
    heads, dv = value.shape[1], value.shape[2]
    outs, dests, state = [], [], None
    for lv in plan.levels:
        init = None if lv.parent is None else state.index_select(0, lv.parent)
        o, state = chunk_fn(
            q[lv.index],
            k[lv.index],
            v[lv.index],
            g=gx[lv.index],
            beta=bx[lv.index],
            initial_state=init,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        outs.append(o.reshape(-1, heads, dv).index_select(0, lv.src))
        dests.append(lv.dest)
    core = value.new_zeros(plan.length, heads, dv)
    if not outs:
        return core
    return core.index_copy(0, torch.cat(dests), torch.cat(outs).to(core.dtype))


def _projections(module: nn.Module, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(mixed_qkv [L, 2 Hk Dk + Hv Dv], z [L, Hv, Dv], b [L, Hv], a [L, Hv])``, as the layer's own forward
    makes them."""
    n = h.shape[1]
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: fused, head-interleaved projections
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(h), module.in_proj_ba(h))
        mixed = torch.cat([x.reshape(1, n, -1) for x in (q, k, v)], dim=-1)
        return mixed[0], z.reshape(n, -1, module.head_v_dim), b.reshape(n, -1), a.reshape(n, -1)
    z = module.in_proj_z(h).reshape(n, -1, module.head_v_dim)
    return module.in_proj_qkv(h)[0], z, module.in_proj_b(h)[0], module.in_proj_a(h)[0]


@torch.compiler.disable  # data-dependent batching; the rest of the decoder layer still compiles
def tree_gated_delta_net(module: nn.Module, hidden_states: Tensor, tree_mask: TreeMask) -> Tensor:
    """Forward of a supported Gated DeltaNet layer over one packed row.

    Args:
        module: a ``*GatedDeltaNet`` of :data:`SUPPORTED_RECURRENT`.
        hidden_states: ``[1, L, hidden]``.
        tree_mask: the row's mask (length ``L``).

    Returns:
        ``[1, L, hidden]``: each token's output equals the layer's on its own sample alone.
    """
    n = hidden_states.shape[1]
    if tree_mask.length != n:
        raise ValueError(f"tree_mask covers {tree_mask.length} positions but the row has {n}")
    plan = recurrence_plan(tree_mask, module.conv_kernel_size)
    mixed, z, b, a = _projections(module, hidden_states)
    mixed = tree_causal_conv(mixed, module.conv1d.weight.squeeze(1), module.conv1d.bias, plan.ancestors)
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(n, -1, module.head_k_dim)
    key = key.reshape(n, -1, module.head_k_dim)
    value = value.reshape(n, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    rep = module.num_v_heads // module.num_k_heads
    if rep > 1:
        query, key = query.repeat_interleave(rep, dim=1), key.repeat_interleave(rep, dim=1)
    chunk_fn = sys.modules[type(module).__module__].torch_chunk_gated_delta_rule
    core = tree_delta_rule(chunk_fn, query, key, value, g, beta, plan).to(value.dtype)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, n, -1))


def install_tree_recurrence(model: nn.Module) -> int:
    """Route every supported Gated DeltaNet layer of ``model`` through :func:`tree_gated_delta_net`
    when its forward receives ``tree_mask`` (idempotent). Returns the number of layers routed."""
    count = 0
    for module in model.modules():
        if type(module).__name__ not in SUPPORTED_RECURRENT:
            continue
        count += 1
        if getattr(module, "_grpo_tree_forward", False):
            continue
        original = module.forward

        def forward(
            hidden_states: Tensor,
            *args: Any,
            tree_mask: TreeMask | None = None,
            _module: nn.Module = module,
            _original: Callable[..., Any] = original,
            **kwargs: Any,
        ) -> Any:
            if tree_mask is None:
                return _original(hidden_states, *args, **kwargs)
            return tree_gated_delta_net(_module, hidden_states, tree_mask)

        module.forward = forward
        module._grpo_tree_forward = True  # noqa: SLF001 - our own mark on the patched module
    return count
