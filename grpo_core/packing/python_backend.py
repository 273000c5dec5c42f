"""The ``python`` packing backend: a straightforward pure-Python reference.

Written for clarity, not speed: it is the executable specification that the
Rust backend must match output for output (tests/unit/packing/test_packing_equivalence.py). The
Arrow layout of its rows is the Rust core's (``row_schema``), and its errors carry the
Rust core's ``kind``, ``field`` and ``sample_id``.
Layout rules (DESIGN.md §5): a row's samples form a prefix trie keyed on
(parent, token); the trie is laid out depth first with children in insertion
order; ``position_ids`` is the depth; a trained token at position ``t`` of a
sample is predicted at the packed position of its token ``t - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ..errors import PackingError
from .base import ROW_PARTS, MicroBatch, PackedRow, row_schema
from .sample import Sample, TokenLists, sample_schema

_DTYPES = {"input_ids": np.int32, "completion_mask": np.int8, "sampler_logprobs": np.float32}


def _validate_lists(s: Sample, name: str, lists: TokenLists | None, n: int) -> None:
    if lists is None:
        return
    off = np.asarray(lists.offsets)
    bad = None
    if len(off) != n + 1:
        bad = f"has {len(off) - 1} entries but the sample has {n} tokens"
    elif off[0] != 0 or (np.diff(off) < 0).any():
        bad = "offsets must start at 0 and never decrease"
    elif off[-1] != len(lists.ids):
        bad = "offsets do not end at the number of ids"
    elif lists.logprobs is not None and len(lists.logprobs) != len(lists.ids):
        bad = "has a different number of log-probs than token ids"
    if bad:
        raise PackingError(
            f"sample {s.sample_id}: `{name}` {bad}", kind="BadTokenLists", field=name, sample_id=s.sample_id
        )


def validate(s: Sample) -> None:
    """Check one sample; the error names the field (same rules as packer_rs)."""
    for name, dtype in _DTYPES.items():
        a = getattr(s, name)
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != dtype:
            raise PackingError(
                f"`{name}` must be a 1-D numpy array of {np.dtype(dtype).name}; "
                f"convert it with np.asarray(x, dtype=np.{np.dtype(dtype).name})",
                field=name,
            )
    n, sid = len(s.input_ids), s.sample_id
    if n == 0:
        raise PackingError(
            f"sample {sid}: `input_ids` is empty; a sample needs at least a prompt token and a trained token",
            kind="EmptySample",
            field="input_ids",
            sample_id=sid,
        )
    for name in ("completion_mask", "sampler_logprobs"):
        if len(getattr(s, name)) != n:
            raise PackingError(
                f"sample {sid}: `{name}` has {len(getattr(s, name))} entries but `input_ids` has {n}; "
                "every per-token field needs one entry per token",
                kind="LengthMismatch",
                field=name,
                sample_id=sid,
            )
    mask = {"field": "completion_mask", "sample_id": sid}
    bad = [i for i, m in enumerate(s.completion_mask.tolist()) if m not in (0, 1)]
    if bad:
        raise PackingError(
            f"sample {sid}: `completion_mask[{bad[0]}]` is {s.completion_mask[bad[0]]}; use 0 or 1",
            kind="BadMask",
            **mask,
        )
    if s.completion_mask[0]:
        raise PackingError(
            f"sample {sid}: `completion_mask[0]` is set, but the first token has no predecessor",
            kind="FirstTokenTrained",
            **mask,
        )
    if not s.completion_mask[1:].any():
        raise PackingError(
            f"sample {sid}: `completion_mask` marks no trained token after position 0", kind="NoTrainedToken", **mask
        )
    _validate_lists(s, "sampler_topk", s.sampler_topk, n)
    _validate_lists(s, "sampling_mask", s.sampling_mask, n)


@dataclass
class Node:
    """One trie node: a token at a depth, and its children in insertion order."""

    token: int
    depth: int
    children: dict[int, Node] = field(default_factory=dict)


class TreeRow:
    """One rank's row: samples folded into a prefix trie (see module docs)."""

    def __init__(self) -> None:
        self.roots: dict[int, Node] = {}
        self.samples: list[Sample] = []
        self.sample_nodes: list[list[Node]] = []
        self.groups: set[int] = set()
        self.num_forwarded = 0
        self.num_trained = 0
        self.num_raw = 0
        self.load = 0

    def shared_prefix(self, sample: Sample) -> int:
        """How many leading tokens of ``sample`` are already in the trie."""
        children, shared = self.roots, 0
        for token in sample.input_ids.tolist():
            if token not in children:
                break
            children = children[token].children
            shared += 1
        return shared

    def added_load(self, sample: Sample) -> int:
        """Attention cost ``sample`` would add: sum over its new tokens of depth + 1."""
        return sum(d + 1 for d in range(self.shared_prefix(sample), sample.num_tokens))

    def fits(self, sample: Sample, budget: int) -> bool:
        """Whether forwarded and trained tokens both stay within ``budget`` with ``sample``."""
        new_tokens = sample.num_tokens - self.shared_prefix(sample)
        return self.num_forwarded + new_tokens <= budget and self.num_trained + sample.num_trained <= budget

    def add(self, sample: Sample) -> None:
        """Insert ``sample`` (no budget check)."""
        children, nodes = self.roots, []
        for depth, token in enumerate(sample.input_ids.tolist()):
            if token not in children:
                children[token] = Node(token, depth)
                self.num_forwarded += 1
                self.load += depth + 1
            nodes.append(children[token])
            children = children[token].children
        self.samples.append(sample)
        self.sample_nodes.append(nodes)
        self.groups.add(sample.group_id)
        self.num_trained += sample.num_trained
        self.num_raw += sample.num_tokens

    def pack(self) -> PackedRow:
        """Lay the trie out depth first and list the loss terms."""
        cols: dict[str, list] = {name: [] for names in ROW_PARTS.values() for name in names}
        position: dict[int, int] = {}  # id(node) -> packed position
        cols["cu_seqlens_q"].append(0)
        cols["cu_seqlens_k"].append(0)

        def visit(node: Node, path: list[int]) -> None:
            pos = len(cols["input_ids"])
            position[id(node)] = pos
            cols["input_ids"].append(node.token)
            cols["position_ids"].append(node.depth)
            cols["subtree_end"].append(None)  # filled after the subtree
            path = path + [pos]
            if len(node.children) != 1:  # a segment ends at a leaf or a branch
                cols["cu_seqlens_q"].append(pos + 1)
                cols["kv_index"].extend(path)
                cols["cu_seqlens_k"].append(len(cols["kv_index"]))
            for child in node.children.values():
                visit(child, path)
            cols["subtree_end"][pos] = len(cols["input_ids"])

        stack_limit_guard(max((s.num_tokens for s in self.samples), default=0))
        for root in self.roots.values():
            visit(root, [])
        extra = self._loss_terms(cols, position)
        for s in self.samples:
            for name, value in (
                ("sample_id", s.sample_id),
                ("group_id", s.group_id),
                ("prompt_index", s.prompt_index),
                ("policy_version", s.policy_version),
                ("num_tokens", s.num_tokens),
                ("num_trained", s.num_trained),
            ):
                cols[name].append(value)
        parts = {part: _batch(part, cols) for part in ROW_PARTS}
        if extra:
            parts["loss"] = _batch("loss", cols | extra, "sampler_topk_ids" in extra, "sampling_mask" in extra)
        return PackedRow(
            **parts,
            num_forwarded=self.num_forwarded,
            num_trained=self.num_trained,
            num_raw=self.num_raw,
            num_samples=len(self.samples),
            load=self.load,
        )

    def _loss_terms(self, cols: dict[str, list], position: dict[int, int]) -> dict[str, list]:
        """Fill the loss columns; return the optional list columns (empty dict if none)."""
        with_topk = any(s.sampler_topk is not None for s in self.samples)
        with_mask = any(s.sampling_mask is not None for s in self.samples)
        extra = ({"sampler_topk_ids": [], "sampler_topk_logprobs": []} if with_topk else {}) | (
            {"sampling_mask": []} if with_mask else {}
        )
        for i, (s, nodes) in enumerate(zip(self.samples, self.sample_nodes)):
            for t in range(1, s.num_tokens):
                if not s.completion_mask[t]:
                    continue
                cols["token_index"].append(position[id(nodes[t - 1])])
                cols["target_id"].append(int(s.input_ids[t]))
                cols["sampler_logprob"].append(float(s.sampler_logprobs[t]))
                cols["advantage"].append(float(s.advantage))
                cols["sample_index"].append(i)
                if with_topk:
                    ids, lps = _entry(s.sampler_topk, t)
                    extra["sampler_topk_ids"].append(ids)
                    extra["sampler_topk_logprobs"].append(lps)
                if with_mask:
                    extra["sampling_mask"].append(_entry(s.sampling_mask, t)[0])
        return extra


def _entry(lists: TokenLists | None, t: int) -> tuple[list, list]:
    if lists is None:
        return [], []
    ids, lps = lists.entry(t)
    return ids.tolist(), [] if lps is None else lps.tolist()


def stack_limit_guard(depth: int) -> None:
    """The recursive layout needs one Python frame per trie level."""
    import sys

    if depth + 100 > sys.getrecursionlimit():
        sys.setrecursionlimit(depth + 1000)


def _batch(part: str, cols: dict[str, list], with_topk: bool = False, with_mask: bool = False) -> pa.RecordBatch:
    """One part of a row in the Rust core's layout (:func:`~grpo_core.packing.base.row_schema`)."""
    schema = row_schema(part, with_topk, with_mask)
    return pa.RecordBatch.from_arrays([pa.array(cols[f.name], type=f.type) for f in schema], schema=schema)


class PythonBatcher:
    """The reference :class:`~grpo_core.packing.base.Batcher` (same rules as packer_rs)."""

    def __init__(self, num_ranks: int, token_budget: int):
        if num_ranks < 1:
            raise PackingError(f"`num_ranks` must be at least 1, got {num_ranks}", kind="BadRanks", field="num_ranks")
        _check_budget(token_budget)
        self.num_ranks = num_ranks
        self.token_budget = token_budget
        self.rows = [TreeRow() for _ in range(num_ranks)]
        self.dropped_oversize_count = 0

    def push(self, batch: pa.RecordBatch) -> list[MicroBatch]:
        """Decode with pyarrow, validate all, then place in order."""
        return self.push_samples(samples_from_pyarrow(batch))

    def push_samples(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """Validate all samples first, then place them in order."""
        for s in samples:
            validate(s)
        closed = []
        for s in samples:
            if s.num_tokens > self.token_budget:
                self.dropped_oversize_count += 1
                continue
            rank = self._choose_row(s)
            if rank is None:
                closed.append([row.pack() for row in self.rows])
                self.rows = [TreeRow() for _ in range(self.num_ranks)]
                rank = 0
            self.rows[rank].add(s)
        return closed

    def finish(self) -> list[MicroBatch]:
        """The last micro-batch if any row holds a sample."""
        if all(not row.samples for row in self.rows):
            return []
        rows, self.rows = self.rows, [TreeRow() for _ in range(self.num_ranks)]
        return [[row.pack() for row in rows]]

    def _choose_row(self, s: Sample) -> int | None:
        fitting = [i for i, row in enumerate(self.rows) if row.fits(s, self.token_budget)]
        home = [i for i in fitting if s.group_id in self.rows[i].groups]
        if home:
            return min(home, key=lambda i: (self.rows[i].load, i))
        if not fitting:
            return None
        new_load = {i: self.rows[i].load + self.rows[i].added_load(s) for i in fitting}
        best = min(fitting, key=lambda i: (new_load[i], i))
        any_empty = any(not row.samples for row in self.rows)
        max_load = max(row.load for row in self.rows)
        # A raise of the largest load up to the sample's share (added ÷ ranks) is allowed.
        added = new_load[best] - self.rows[best].load
        return best if any_empty or new_load[best] * self.num_ranks <= max_load * self.num_ranks + added else None


def samples_from_pyarrow(batch: pa.RecordBatch) -> list[Sample]:
    """Decode a Sample-schema batch with pyarrow alone (independent of packer_rs)."""
    required = (
        "sample_id",
        "group_id",
        "prompt_index",
        "input_ids",
        "completion_mask",
        "sampler_logprobs",
        "advantage",
        "policy_version",
    )
    expected = pa.schema(sample_schema(with_topk=True, with_mask=True))
    for name in required:
        if name not in batch.schema.names:
            raise PackingError(
                f"Sample batch: column `{name}` is missing; see the Sample schema (DESIGN.md §6)",
                kind="Schema",
                field=name,
            )
    for name in batch.schema.names:
        if name in expected.names and batch.schema.field(name).type != expected.field(name).type:
            raise PackingError(
                f"Sample batch: column `{name}` has type {batch.schema.field(name).type}, "
                f"expected {expected.field(name).type}",
                kind="Schema",
                field=name,
            )
    rows = batch.to_pylist()
    out = []
    for r in rows:
        topk = sampling = None
        if r.get("sampler_topk_ids") is not None:
            topk = _to_lists(r["sampler_topk_ids"], r["sampler_topk_logprobs"])
        if r.get("sampling_mask") is not None:
            sampling = _to_lists(r["sampling_mask"], None)
        s = Sample.build(
            r["input_ids"],
            r["completion_mask"],
            r["sampler_logprobs"],
            sample_id=r["sample_id"],
            group_id=r["group_id"],
            prompt_index=r["prompt_index"],
            advantage=r["advantage"],
            policy_version=r["policy_version"],
        )
        s.sampler_topk, s.sampling_mask = topk, sampling
        out.append(s)
    return out


def _to_lists(ids: list[list[int]], logprobs: list[list[float]] | None) -> TokenLists:
    offsets = np.cumsum([0] + [len(x) for x in ids]).astype(np.int32)
    flat_ids = np.array([t for x in ids for t in x], dtype=np.int32)
    flat_lp = None if logprobs is None else np.array([v for x in logprobs for v in x], dtype=np.float32)
    return TokenLists(offsets, flat_ids, flat_lp)


class PythonPacker:
    """The reference packing backend."""

    name = "python"

    def batcher(self, num_ranks: int, token_budget: int) -> PythonBatcher:
        """See :class:`~grpo_core.packing.base.Packer`."""
        return PythonBatcher(num_ranks, token_budget)

    def pack_row(self, samples: Sequence[Sample], token_budget: int) -> PackedRow:
        """See :class:`~grpo_core.packing.base.Packer`."""
        _check_budget(token_budget)
        row = TreeRow()
        for s in samples:
            validate(s)
            if not row.fits(s, token_budget):
                raise PackingError(
                    f"sample {s.sample_id} does not fit the row under `token_budget`={token_budget}",
                    kind="DoesNotFit",
                    field="token_budget",
                    sample_id=s.sample_id,
                )
            row.add(s)
        return row.pack()


def _check_budget(token_budget: int) -> None:
    if token_budget < 1:
        raise PackingError(
            f"`token_budget` must be a positive number of tokens, got {token_budget}",
            kind="BadBudget",
            field="token_budget",
        )
