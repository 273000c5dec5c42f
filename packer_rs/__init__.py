"""packer_rs: the Rust prefix-trie packer of grpo-flow (see packer_rs/src/lib.rs).

Use it through ``grpo_core.packing``; only that package imports ``packer_rs``.

The extension module ``packer_rs._native`` is built in place by ``make install`` (``pip install -e .``) or lives in
an installed wheel. A checkout whose extension was not built in place, run from its own folder (every grpo process
puts its working folder first on ``sys.path``), shadows the installed package with this source folder: the
extension is then looked for in every other ``packer_rs`` folder on ``sys.path`` (:func:`pkgutil.extend_path`), so
the installed wheel's is found; with none anywhere, the ``ImportError`` says what to run.
"""

import pkgutil

try:
    from . import _native
except ImportError as _first:
    # This folder holds no built extension: look in the other packer_rs folders on sys.path (an installed wheel's).
    __path__ = pkgutil.extend_path(__path__, __name__)
    try:
        from . import _native  # noqa: F401 - found here or not at all; its names are imported below
    except ImportError:
        raise ImportError(
            f"packer_rs: the Rust extension packer_rs._native is not built in {__path__[0]} and no installed "
            "packer_rs on sys.path has one; in the checkout run `make install` (builds it in place: "
            "pip install -e . with cargo on PATH), or `pip install .` to install the package",
            name="packer_rs._native",
        ) from _first

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
