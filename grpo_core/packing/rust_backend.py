"""The ``rust`` packing backend: packer_rs, with rows returned zero-copy as Arrow."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

import packer_rs

from ..errors import PackingError
from .base import MicroBatch, PackedRow
from .sample import Sample, _rust


def _micro_batches(raw: list[list[dict]]) -> list[MicroBatch]:
    return [[PackedRow.from_dict(r) for r in rows] for rows in raw]


class RustBatcher:
    """:class:`~grpo_core.packing.base.Batcher` on ``packer_rs.TokenBudgetBatcher``.

    Decoding, placement and packing run in Rust without the GIL.
    """

    def __init__(self, num_ranks: int, token_budget: int):
        self._inner = _rust(packer_rs.TokenBudgetBatcher, num_ranks, token_budget)

    @property
    def dropped_oversize_count(self) -> int:
        """Samples dropped because they were longer than the token budget."""
        return self._inner.dropped_oversize_count

    def push(self, batch: pa.RecordBatch) -> list[MicroBatch]:
        """See :class:`~grpo_core.packing.base.Batcher`. The batch is validated
        whole before any sample is placed, so a bad batch changes nothing."""
        return _micro_batches(_rust(self._inner.push, batch))

    def push_samples(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """See :class:`~grpo_core.packing.base.Batcher`."""
        return _micro_batches(_rust(self._inner.push_samples, list(samples)))

    def finish(self) -> list[MicroBatch]:
        """See :class:`~grpo_core.packing.base.Batcher`."""
        return _micro_batches(self._inner.finish())


class RustPacker:
    """The default packing backend (packer_rs)."""

    name = "rust"

    def batcher(self, num_ranks: int, token_budget: int) -> RustBatcher:
        """See :class:`~grpo_core.packing.base.Packer`."""
        return RustBatcher(num_ranks, token_budget)

    def pack_row(self, samples: Sequence[Sample], token_budget: int) -> PackedRow:
        """See :class:`~grpo_core.packing.base.Packer`."""
        if token_budget < 1:  # checked here too, so that an empty sample list is rejected as well
            raise PackingError(
                f"`token_budget` must be a positive number of tokens, got {token_budget}",
                kind="BadBudget",
                field="token_budget",
            )
        row = packer_rs.TreeRow()
        for s in samples:
            _rust(row.add, s, token_budget)
        return PackedRow.from_dict(row.pack())
