"""Packing: samples → token-budget micro-batches of prefix-trie rows.

Backends are selected by name (``get_packer("rust")``, ``get_packer("python")``)
and third-party ones plug in through the ``grpo_core.packers`` entry-point
group. This package is the only one that imports ``packer_rs``.
"""

from .base import (
    ENTRY_POINT_GROUP,
    Batcher,
    MicroBatch,
    PackedRow,
    Packer,
    available_packers,
    get_packer,
    micro_batch_stats,
)
from .sample import (
    Sample,
    TokenLists,
    read_samples_ipc,
    sample_schema,
    samples_from_arrow,
    samples_to_arrow,
    write_samples_ipc,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Batcher",
    "MicroBatch",
    "PackedRow",
    "Packer",
    "Sample",
    "TokenLists",
    "available_packers",
    "get_packer",
    "micro_batch_stats",
    "read_samples_ipc",
    "sample_schema",
    "samples_from_arrow",
    "samples_to_arrow",
    "write_samples_ipc",
]
