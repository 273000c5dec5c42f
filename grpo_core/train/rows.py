"""Packed rows on the wire and on the device.

Rank 0 plans micro-batches and sends each rank its row in the row's one wire format
(``PackedRow.to_ipc``: Arrow IPC, no pickled objects). A rank turns its row into tensors: the forwarded tokens
padded to a length bucket, the tree mask, and the loss-term columns.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from grpo_core.packing import PackedRow

from .attention import TreeMask


def _transfer(arrays: dict[str, np.ndarray], dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
    """Arrays to ``device`` as ``dtype`` tensors of the same shapes.

    On CUDA they travel together: one pinned host buffer, one asynchronous copy,
    so building a row never waits for the work already queued on the device.
    """
    if device.type != "cuda":
        with warnings.catch_warnings():  # Arrow buffers are read-only; we never write through them
            warnings.simplefilter("ignore", UserWarning)
            return {k: torch.from_numpy(a).to(dtype) for k, a in arrays.items()}
    sizes = [a.size for a in arrays.values()]
    host = torch.empty(sum(sizes), dtype=dtype, pin_memory=True)
    flat, pos = host.numpy(), 0
    for a, n in zip(arrays.values(), sizes):
        flat[pos : pos + n] = a.reshape(-1)
        pos += n
    dev = host.to(device, non_blocking=True)
    return {k: t.view(a.shape) for (k, a), t in zip(arrays.items(), dev.split(sizes))}


def _padded_topk(row: PackedRow, name: str, fill: float) -> np.ndarray | None:
    if name not in row.loss.schema.names:
        return None
    col = row.loss.column(name)
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    counts = np.diff(offsets)
    k = int(counts.max()) if len(counts) else 0
    out = np.full((len(counts), k), fill, dtype=values.dtype)
    if k:
        rows = np.repeat(np.arange(len(counts)), counts)
        cols = np.arange(len(values)) - np.repeat(offsets[:-1], counts)
        out[rows, cols] = values
    return out


@dataclass
class RowTensors:
    """One rank's row on its device.

    Attributes:
        input_ids, position_ids: ``int64[L]``, padded to the bucket length ``L``
            (padding: token 0, positions continuing past the row).
        tree_mask: :class:`TreeMask` of length ``L``.
        token_index, target_id: ``int64[M]``.
        sampler_logprob, advantage: ``float32[M]``.
        sample_index: ``int64[M]``.
        topk_ids: ``int64[M, k]`` sampler top-k ids (``-1`` padding) or None.
        topk_logprobs: ``float32[M, k]`` (``-inf`` padding) or None.
        candidates: CSR sampling mask ``(offsets int64[M+1], ids int64[E])`` or None.
        policy_version: ``int32[num_samples]`` per sample.
        num_forwarded: the row's forwarded tokens, at the front of ``input_ids`` (the rest is padding); None =
            every position (a row built without one).
    """

    input_ids: Tensor
    position_ids: Tensor
    tree_mask: TreeMask
    token_index: Tensor
    target_id: Tensor
    sampler_logprob: Tensor
    advantage: Tensor
    sample_index: Tensor
    topk_ids: Tensor | None
    topk_logprobs: Tensor | None
    candidates: tuple[Tensor, Tensor] | None
    policy_version: Tensor
    num_forwarded: int | None = None

    @property
    def num_terms(self) -> int:
        """Loss terms ``M``."""
        return int(self.token_index.shape[0])


def to_tensors(row: PackedRow, device: torch.device, length: int | None = None) -> RowTensors:
    """Move a row to ``device``, padded to ``length`` (default: unpadded).

    An empty row (a rank with no sample at the end of the stream) becomes one
    padding token with no loss term, so the rank still joins every collective.
    """
    n = max(row.num_forwarded, 1)
    length = length or n
    ids = np.zeros(length, dtype=np.int64)
    pos = np.arange(length, dtype=np.int64)
    end = np.arange(1, length + 1, dtype=np.int64)
    if row.num_forwarded:
        ids[: row.num_forwarded] = row.column("input_ids")
        pos[: row.num_forwarded] = row.column("position_ids")
        pos[row.num_forwarded :] = np.arange(length - row.num_forwarded) + pos[: row.num_forwarded].max() + 1
        end[: row.num_forwarded] = row.column("subtree_end")
    ints = {"input_ids": ids, "position_ids": pos, "subtree_end": end, "policy_version": row.column("policy_version")}
    for name in ("token_index", "target_id", "sample_index"):
        ints[name] = row.column(name)
    floats = {"sampler_logprob": row.column("sampler_logprob"), "advantage": row.column("advantage")}
    topk_ids = _padded_topk(row, "sampler_topk_ids", -1)
    if topk_ids is not None:
        ints["topk_ids"] = topk_ids
        floats["topk_logprobs"] = _padded_topk(row, "sampler_topk_logprobs", float("-inf"))
    if "sampling_mask" in row.loss.schema.names:
        col = row.loss.column("sampling_mask")
        ints["mask_offsets"] = col.offsets.to_numpy()
        ints["mask_ids"] = col.values.to_numpy(zero_copy_only=False)
    i, f = _transfer(ints, torch.int64, device), _transfer(floats, torch.float32, device)
    return RowTensors(
        input_ids=i["input_ids"],
        position_ids=i["position_ids"],
        tree_mask=TreeMask(i["subtree_end"].to(torch.int32)),
        token_index=i["token_index"],
        target_id=i["target_id"],
        sampler_logprob=f["sampler_logprob"],
        advantage=f["advantage"],
        sample_index=i["sample_index"],
        topk_ids=i.get("topk_ids"),
        topk_logprobs=f.get("topk_logprobs"),
        candidates=(i["mask_offsets"], i["mask_ids"]) if "mask_offsets" in i else None,
        policy_version=i["policy_version"].to(torch.int32),
        num_forwarded=row.num_forwarded,
    )


def synthetic_row(
    length: int, num_terms: int, vocab_size: int, device: torch.device, topk: int = 0, with_mask: bool = False
) -> RowTensors:
    """A row with the shapes of a real row of a length bucket, to compile ahead of the first step.

    One sequence of ``length`` tokens (each sees all before it), ``num_terms`` loss
    terms (``< length``) with non-zero advantages, and, as the run's samples will
    have them, ``topk`` sampler top-k ids and a sampling mask of a few candidates.
    """
    ids = (np.arange(length, dtype=np.int64) * 7919 + 1) % vocab_size
    m = num_terms
    row = {
        "input_ids": ids,
        "position_ids": np.arange(length),
        "subtree_end": np.full(length, length),
        "token_index": np.arange(m),
        "target_id": ids[1 : m + 1],
        "sample_index": np.zeros(m, np.int64),
        "policy_version": np.zeros(1, np.int64),
    }
    floats = {"sampler_logprob": np.full(m, -1.0), "advantage": np.where(np.arange(m) % 2 == 0, 1.0, -1.0)}
    if topk:
        row["topk_ids"] = (ids[1 : m + 1, None] + np.arange(topk)) % vocab_size
        floats["topk_logprobs"] = np.full((m, topk), -2.0)
    if with_mask:
        row["mask_offsets"] = np.arange(m + 1) * 2
        row["mask_ids"] = np.stack([ids[1 : m + 1], (ids[1 : m + 1] + 1) % vocab_size], 1).reshape(-1)
    i, f = _transfer(row, torch.int64, device), _transfer(floats, torch.float32, device)
    return RowTensors(
        i["input_ids"],
        i["position_ids"],
        TreeMask(i["subtree_end"].to(torch.int32)),
        i["token_index"],
        i["target_id"],
        f["sampler_logprob"],
        f["advantage"],
        i["sample_index"],
        i.get("topk_ids"),
        f.get("topk_logprobs"),
        (i["mask_offsets"], i["mask_ids"]) if with_mask else None,
        i["policy_version"].to(torch.int32),
    )


def bucket_length(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= ``n`` (``buckets`` sorted ascending).

    Raises:
        ValueError: ``n`` exceeds the largest bucket.
    """
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"row of {n} tokens exceeds the largest length bucket {buckets[-1]}; raise token_budget")


def length_buckets(token_budget: int, num_buckets: int, multiple: int = 128) -> tuple[int, ...]:
    """``num_buckets`` padded lengths up to the budget (multiples of ``multiple``: FlexAttention's block
    size on CUDA), ascending."""
    top = -(-token_budget // multiple) * multiple
    sizes = {max(multiple, -(-top * (i + 1) // num_buckets // multiple) * multiple) for i in range(num_buckets)}
    return tuple(sorted(sizes))
