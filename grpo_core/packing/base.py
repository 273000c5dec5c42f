"""The packer interface: packed rows, micro-batches, the ``Packer`` protocol and
backend selection by name (built-ins and the ``grpo_core.packers`` entry-point group).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Protocol, runtime_checkable

import numpy as np
import pyarrow as pa

import packer_rs

from ..errors import ConfigError
from .sample import Sample, _rust

ENTRY_POINT_GROUP = "grpo_core.packers"

#: The five record batches of a packed row and their flat columns, as the Rust core defines them
#: (packer_rs/src/arrow.rs ``ROW_PARTS``).
ROW_PARTS: dict[str, tuple[str, ...]] = {part: tuple(packer_rs.row_schema(part).names) for part in packer_rs.ROW_PARTS}
#: The counts of a packed row, in order (packer_rs/src/arrow.rs ``ROW_COUNTS``).
ROW_COUNTS: tuple[str, ...] = tuple(packer_rs.ROW_COUNTS)


def row_schema(part: str, with_topk: bool = False, with_mask: bool = False) -> pa.Schema:
    """The Arrow schema of one part of a packed row, defined by the Rust core (packer_rs/src/arrow.rs).

    ``with_topk`` / ``with_mask`` add the optional ``loss`` columns (``sampler_topk_ids``,
    ``sampler_topk_logprobs``, ``sampling_mask``: ``list<…>`` per loss term).

    Raises:
        PackingError: ``part`` is not one of :data:`ROW_PARTS` (kind ``Schema``).
    """
    return _rust(packer_rs.row_schema, part, with_topk, with_mask)


@dataclass(frozen=True)
class PackedRow:
    """One rank's row of a micro-batch: its samples as a depth-first prefix trie.

    Sizes: ``N`` forwarded tokens, ``S`` segments (maximal unary chains),
    ``K`` total length of the root-to-segment-end key paths, ``M`` loss terms.
    All integer columns are int32, float columns float32; nothing is padded.

    Attributes:
        tokens: ``[N]`` ``input_ids``; ``position_ids`` (= depth in the trie);
            ``subtree_end`` (key ``j`` is visible to query ``q`` iff
            ``j <= q < subtree_end[j]``: ancestors and self).
        segments: ``[S + 1]`` ``cu_seqlens_q`` (segment bounds in the row) and
            ``cu_seqlens_k`` (bounds of each segment's key path in ``kv_index``),
            for varlen attention kernels with causal, bottom-right alignment.
        kv: ``[K]`` ``kv_index``: the packed positions of every segment's
            root-to-end path, laid end to end.
        loss: ``[M]`` one row per trained token: ``token_index`` (packed position
            whose output predicts it), ``target_id``, ``sampler_logprob``,
            ``advantage``, ``sample_index`` (into ``samples``); plus, when any
            sample has them, ``sampler_topk_ids``/``sampler_topk_logprobs`` and
            ``sampling_mask`` as ``list<…>`` columns.
        samples: one row per sample: ``sample_id``, ``group_id``,
            ``prompt_index``, ``policy_version``, ``num_tokens``, ``num_trained``.
        num_forwarded: ``N``. num_trained: ``M``. num_raw: sum of sample lengths.
        num_samples: samples in the row. load: attention cost, sum over
            forwarded tokens of depth + 1.
    """

    tokens: pa.RecordBatch
    segments: pa.RecordBatch
    kv: pa.RecordBatch
    loss: pa.RecordBatch
    samples: pa.RecordBatch
    num_forwarded: int
    num_trained: int
    num_raw: int
    num_samples: int
    load: int

    @classmethod
    def from_dict(cls, d: dict) -> PackedRow:
        """Build from the dict packer_rs returns (same keys as the fields)."""
        return cls(**d)

    def column(self, name: str) -> np.ndarray:
        """A flat column as a numpy array, zero-copy (e.g. ``row.column("input_ids")``).

        Raises:
            KeyError: no part of the row has that column.
        """
        for part, names in ROW_PARTS.items():
            if name in names:
                return getattr(self, part).column(name).to_numpy(zero_copy_only=True)
        raise KeyError(f"packed rows have no flat column {name!r}; columns: {sorted(sum(ROW_PARTS.values(), ()))}")

    @property
    def packing_ratio(self) -> float:
        """Raw tokens per forwarded token (1.0 when nothing is shared)."""
        return self.num_raw / self.num_forwarded if self.num_forwarded else 1.0

    def to_ipc(self) -> bytes:
        """The row's one wire format (rank 0 hands each rank its row in it; nothing is pickled).

        Layout: for each part of :data:`ROW_PARTS` (the Rust core's row layout), a little-endian ``uint64`` length
        and that record batch as an Arrow IPC stream; then the :data:`ROW_COUNTS` as ``uint64``.
        """
        import io
        import struct

        import pyarrow.ipc as ipc

        out = io.BytesIO()
        for part in ROW_PARTS:
            batch: pa.RecordBatch = getattr(self, part)
            sink = pa.BufferOutputStream()
            with ipc.new_stream(sink, batch.schema) as writer:
                writer.write_batch(batch)
            buf = sink.getvalue()
            out.write(struct.pack("<Q", buf.size))
            out.write(buf.to_pybytes())
        out.write(struct.pack(f"<{len(ROW_COUNTS)}Q", *(getattr(self, k) for k in ROW_COUNTS)))
        return out.getvalue()

    @classmethod
    def from_ipc(cls, data: bytes | memoryview) -> PackedRow:
        """Inverse of :meth:`to_ipc` (the record batches reference ``data``, no copy).

        Raises:
            pyarrow.ArrowInvalid: ``data`` is not a row in :meth:`to_ipc`'s layout.
        """
        import struct

        import pyarrow.ipc as ipc

        buf = pa.py_buffer(data)
        pos, parts = 0, {}
        for part in ROW_PARTS:
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8
            parts[part] = ipc.open_stream(buf.slice(pos, n)).read_next_batch()
            pos += n
        counts = struct.unpack_from(f"<{len(ROW_COUNTS)}Q", buf, pos)
        return cls(**parts, **dict(zip(ROW_COUNTS, counts, strict=True)))

    def equals(self, other: PackedRow) -> bool:
        """Exact equality of every record batch and count."""
        return all(getattr(self, p).equals(getattr(other, p)) for p in ROW_PARTS) and all(
            getattr(self, k) == getattr(other, k) for k in ROW_COUNTS
        )


#: A micro-batch: one packed row per data-parallel rank.
MicroBatch = list[PackedRow]


@runtime_checkable
class Batcher(Protocol):
    """Streams samples into one open row per rank under a token budget (DESIGN.md §5).

    Placement of each sample: a row already holding its group if it fits
    there; else the fitting row whose load stays smallest, if some rank's row
    is still empty or the largest row load rises by at most the sample's added
    load ÷ ranks (what it would cost in a balanced next micro-batch); else the
    micro-batch closes. Samples longer than the budget are dropped and counted. Every
    micro-batch closed mid-stream has all rows non-empty; only the last one,
    from :meth:`finish`, may have empty rows (fewer samples than ranks at the
    end of the stream), which the trainer runs as dummy rows with no loss term.
    """

    dropped_oversize_count: int

    def push(self, batch: pa.RecordBatch) -> list[MicroBatch]:
        """Add a Sample-schema batch; returns the micro-batches it closed (in order)."""
        ...

    def push_samples(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """Add Sample objects; returns the micro-batches they closed."""
        ...

    def finish(self) -> list[MicroBatch]:
        """End of stream: the last micro-batch if any row holds a sample (list of 0 or 1)."""
        ...


@runtime_checkable
class Packer(Protocol):
    """A packing backend: builds batchers and single rows with identical outputs."""

    name: str

    def batcher(self, num_ranks: int, token_budget: int) -> Batcher:
        """A batcher for ``num_ranks`` rows of at most ``token_budget`` tokens.

        Raises:
            PackingError: ``num_ranks`` < 1 or ``token_budget`` < 1.
        """
        ...

    def pack_row(self, samples: Sequence[Sample], token_budget: int) -> PackedRow:
        """Pack ``samples`` into one row, in order.

        Raises:
            PackingError: a sample is invalid or does not fit ``token_budget``.
        """
        ...


def micro_batch_stats(rows: MicroBatch, token_budget: int) -> dict[str, float]:
    """``batch/*`` metrics of one micro-batch (names per DESIGN.md §7).

    Returns:
        ``packing_ratio`` (raw ÷ forwarded tokens), ``row_fill_frac`` (mean
        forwarded ÷ budget), ``row_imbalance`` (max ÷ mean row load, 1.0 =
        balanced), ``samples_per_row``, ``row_tokens_mean``, ``row_tokens_max``,
        forwarded/trained/raw token counts, and ``trained_positions``: the forwarded positions whose output
        carries at least one loss term (a position shared by duplicate completions in the trie counts once, while
        ``trained_tokens`` counts each sample's term).
    """
    forwarded = [r.num_forwarded for r in rows]
    loads = [r.load for r in rows]
    mean_load = sum(loads) / len(loads)
    return {
        "packing_ratio": sum(r.num_raw for r in rows) / max(sum(forwarded), 1),
        "row_fill_frac": sum(forwarded) / (len(rows) * token_budget),
        "row_imbalance": max(loads) / mean_load if mean_load else 1.0,
        "samples_per_row": sum(r.num_samples for r in rows) / len(rows),
        "row_tokens_mean": sum(forwarded) / len(rows),
        "row_tokens_max": max(forwarded),
        "forwarded_tokens": sum(forwarded),
        "trained_tokens": sum(r.num_trained for r in rows),
        "trained_positions": sum(int(np.unique(r.column("token_index")).size) for r in rows),
        "raw_tokens": sum(r.num_raw for r in rows),
    }


#: Built-in backends (also usable from a source checkout that is not pip-installed).
BUILTIN_PACKERS = {
    "rust": "grpo_core.packing.rust_backend:RustPacker",
    "python": "grpo_core.packing.python_backend:PythonPacker",
}


@functools.cache
def _entry_points() -> dict[str, EntryPoint]:
    eps = {name: EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in BUILTIN_PACKERS.items()}
    eps.update({ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)})
    return eps


def available_packers() -> list[str]:
    """Names of every installed packing backend (``rust``, ``python``, third-party)."""
    return sorted(_entry_points())


def get_packer(name: str = "rust") -> Packer:
    """The packing backend named ``name``: a built-in (``rust``, ``python``) or one
    registered by another distribution in the ``grpo_core.packers`` entry-point group.

    Raises:
        ConfigError: no backend of that name, or it does not follow :class:`Packer`.
    """
    eps = _entry_points()
    if name not in eps:
        raise ConfigError(
            f"packing.backend: no packer named {name!r}; installed: {available_packers()}. "
            f"Register a third-party backend in the {ENTRY_POINT_GROUP!r} entry-point group."
        )
    packer = eps[name].load()()
    if not isinstance(packer, Packer):
        raise ConfigError(f"packing.backend: {name!r} ({eps[name].value}) does not implement grpo_core.packing.Packer")
    return packer
