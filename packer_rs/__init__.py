"""packer_rs: the Rust prefix-trie packer of grpo-flow (see packer_rs/src/lib.rs).

Use it through ``grpo_core.packing``; only that package imports ``packer_rs``.
"""

from ._native import (
    ROW_COUNTS,
    ROW_PARTS,
    PackingError,
    TokenBudgetBatcher,
    TreeRow,
    decode_samples,
    encode_samples,
    read_samples_ipc,
    row_schema,
    sample_schema,
    write_samples_ipc,
)

__all__ = [
    "ROW_COUNTS",
    "ROW_PARTS",
    "PackingError",
    "TokenBudgetBatcher",
    "TreeRow",
    "decode_samples",
    "encode_samples",
    "read_samples_ipc",
    "row_schema",
    "sample_schema",
    "write_samples_ipc",
]
