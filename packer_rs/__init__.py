"""packer_rs: the Rust prefix-trie packer of grpo-flow (see packer_rs/src/lib.rs).

Use it through ``grpo_core.packing``; only that package imports ``packer_rs``.
"""

from ._native import (
    PackingError,
    TokenBudgetBatcher,
    TreeRow,
    decode_samples,
    encode_samples,
    read_samples_ipc,
    sample_schema,
    write_samples_ipc,
)

__all__ = [
    "PackingError",
    "TokenBudgetBatcher",
    "TreeRow",
    "decode_samples",
    "encode_samples",
    "read_samples_ipc",
    "sample_schema",
    "write_samples_ipc",
]
