"""Packed rows on the wire and on the device.

Rank 0 plans micro-batches and sends each rank its row as Arrow IPC bytes (no
pickled objects). A rank turns its row into tensors: the forwarded tokens
padded to a length bucket, the tree mask, and the loss-term columns.
"""

from __future__ import annotations

import io
import struct
import warnings
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch
from torch import Tensor

from grpo_core.packing import PackedRow
from grpo_core.packing.base import ROW_PARTS

from .attention import TreeMask, pad_subtree_end

_COUNTS = ("num_forwarded", "num_trained", "num_raw", "num_samples", "load")


def row_to_bytes(row: PackedRow) -> bytes:
    """Serialise a row: its five record batches as IPC streams, then the counts.

    Layout: for each part, ``uint64`` length + IPC stream; then five ``uint64`` counts.
    """
    out = io.BytesIO()
    for part in ROW_PARTS:
        batch: pa.RecordBatch = getattr(row, part)
        sink = pa.BufferOutputStream()
        with ipc.new_stream(sink, batch.schema) as w:
            w.write_batch(batch)
        buf = sink.getvalue()
        out.write(struct.pack("<Q", buf.size))
        out.write(buf.to_pybytes())
    out.write(struct.pack("<5Q", *(getattr(row, k) for k in _COUNTS)))
    return out.getvalue()


def row_from_bytes(data: bytes | memoryview) -> PackedRow:
    """Inverse of :func:`row_to_bytes` (the record batches reference ``data``)."""
    buf = pa.py_buffer(data)
    pos, parts = 0, {}
    for part in ROW_PARTS:
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8
        parts[part] = ipc.open_stream(buf.slice(pos, n)).read_next_batch()
        pos += n
    counts = struct.unpack_from("<5Q", buf, pos)
    return PackedRow(**parts, **dict(zip(_COUNTS, counts)))


def _tensor(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> Tensor:
    with warnings.catch_warnings():  # Arrow buffers are read-only; we never write through them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a).to(device=device, dtype=dtype)


def _padded_topk(row: PackedRow, name: str, dtype: torch.dtype, fill: float, device: torch.device) -> Tensor | None:
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
    return _tensor(out, dtype, device)


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
    end = np.arange(1, length + 1, dtype=np.int32)
    if row.num_forwarded:
        ids[: row.num_forwarded] = row.column("input_ids")
        pos[: row.num_forwarded] = row.column("position_ids")
        pos[row.num_forwarded:] = np.arange(length - row.num_forwarded) + pos[: row.num_forwarded].max() + 1
        end = pad_subtree_end(torch.from_numpy(row.column("subtree_end").astype(np.int32)), length).numpy()
    mask = TreeMask(_tensor(end, torch.int32, device))
    candidates = None
    if "sampling_mask" in row.loss.schema.names:
        col = row.loss.column("sampling_mask")
        candidates = (_tensor(col.offsets.to_numpy(), torch.int64, device),
                      _tensor(col.values.to_numpy(zero_copy_only=False), torch.int64, device))
    return RowTensors(
        input_ids=_tensor(ids, torch.int64, device),
        position_ids=_tensor(pos, torch.int64, device),
        tree_mask=mask,
        token_index=_tensor(row.column("token_index"), torch.int64, device),
        target_id=_tensor(row.column("target_id"), torch.int64, device),
        sampler_logprob=_tensor(row.column("sampler_logprob"), torch.float32, device),
        advantage=_tensor(row.column("advantage"), torch.float32, device),
        sample_index=_tensor(row.column("sample_index"), torch.int64, device),
        topk_ids=_padded_topk(row, "sampler_topk_ids", torch.int64, -1, device),
        topk_logprobs=_padded_topk(row, "sampler_topk_logprobs", torch.float32, float("-inf"), device),
        candidates=candidates,
        policy_version=_tensor(row.column("policy_version"), torch.int32, device),
    )


def length_buckets(token_budget: int, num_buckets: int, multiple: int = 128) -> tuple[int, ...]:
    """``num_buckets`` padded lengths up to the budget (multiples of ``multiple``), ascending."""
    top = -(-token_budget // multiple) * multiple
    sizes = {max(multiple, -(-top * (i + 1) // num_buckets // multiple) * multiple) for i in range(num_buckets)}
    return tuple(sorted(sizes))
