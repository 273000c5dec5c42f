"""A checkpoint's manifest of SHA-256 digests, and a DCP metadata reader that unpickles nothing but plain data.

Checkpoints travel: they are downloaded from any MLflow run (``grpo resume``, ``resume_from``) or copied from
a path an MLflow artifact names. Restoring one must never run code, so:

* :func:`write_manifest` writes ``manifest.json`` beside the checkpoint's files when it is saved: the
  SHA-256 digest (hex) of every file under the checkpoint folder, by relative path;
* :func:`verify_manifest` checks it before anything of the checkpoint is read: a file missing, changed,
  or not in the manifest (and a missing manifest) refuses the checkpoint, naming the file. It finds damage,
  not forgery: whoever can rewrite the files can rewrite the manifest, so nothing below relies on it;
* tensors are read with ``torch.load(weights_only=True)`` (the RNG state and DCP's tensor items); the
  scheduler and every non-tensor value are JSON, and DCP's pickled ("bytes") items are refused
  (``grpo_core.train.plain_state``);
* ``torch.distributed.checkpoint`` stores its metadata (``dcp/.metadata``) as a pickle:
  :class:`SafeFileSystemReader` reads it with :class:`MetadataUnpickler`, which builds only the
  metadata's own classes, ``torch.Size`` and dtype/layout/memory-format constants, so even a checkpoint
  whose manifest was forged along with its files cannot run code.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from pathlib import Path
from typing import Any

from grpo_core.errors import CheckpointError
from grpo_core.run.layout import CHECKPOINT_MANIFEST as MANIFEST_FILE

_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    """Hex SHA-256 digest of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    """Relative POSIX paths of every file under ``folder`` but the manifest, sorted."""
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST_FILE
    )


def write_manifest(folder: Path) -> Path:
    """Write ``<folder>/manifest.json``: ``{"algorithm": "sha256", "files": {relative path: hex digest}}`` of
    every file under ``folder``. Call it once every file of the checkpoint is written and closed.

    Returns:
        The manifest's path.
    """
    folder = Path(folder)
    files = {name: file_sha256(folder / name) for name in _files(folder)}
    path = folder / MANIFEST_FILE
    path.write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=1))
    return path


def verify_manifest(folder: Path) -> None:
    """Check every file of a checkpoint against its manifest before any of it is read.

    Raises:
        CheckpointError: the manifest is missing or unreadable, a file it lists is missing or has another
            digest, or a file is not listed (the message names the checkpoint and the file).
    """
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        listed = manifest["files"]
        if manifest.get("algorithm") != "sha256" or not isinstance(listed, dict):
            raise ValueError("not a sha256 manifest")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint {folder}: {MANIFEST_FILE} is missing or unreadable ({exc}); a checkpoint "
            "is only loaded with the digests of its files (written by grpo-flow when it saved "
            "it): refused"
        ) from None
    present = _files(folder)
    for name in present:
        if name not in listed:
            raise CheckpointError(f"checkpoint {folder}: file {name} is not in its {MANIFEST_FILE}: refused")
    for name, digest in sorted(listed.items()):
        if name not in present:
            raise CheckpointError(f"checkpoint {folder}: file {name} listed in its {MANIFEST_FILE} is missing: refused")
        if file_sha256(folder / name) != digest:
            raise CheckpointError(
                f"checkpoint {folder}: file {name} does not match its SHA-256 digest in "
                f"{MANIFEST_FILE} (changed since it was saved): refused"
            )


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: the classes of ``torch.distributed.checkpoint.metadata``, its file reader's
    ``_StorageInfo``, ``pathlib`` paths (the checkpoint id), ``torch.Size``, torch dtype constants and
    ``torch.serialization._get_layout`` (a layout by name); any other global raises ``UnpicklingError``."""

    _EXACT = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102 - pickle.Unpickler
        import torch

        if (module, name) in self._EXACT:
            return super().find_class(module, name)
        if module == "torch.distributed.checkpoint.metadata" and "." not in name:
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"DCP metadata names {module}.{name}, which a checkpoint's metadata never holds: refused"
        )


def read_dcp_metadata(data: bytes) -> Any:
    """The DCP ``Metadata`` of a ``.metadata`` file's bytes, via :class:`MetadataUnpickler`.

    Raises:
        CheckpointError: the pickle names anything else (code).
    """
    try:
        return MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, AttributeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"DCP metadata refused: {exc}") from None


def safe_reader(path: Path) -> Any:
    """A ``torch.distributed.checkpoint.FileSystemReader`` of the DCP folder ``path`` whose metadata goes through
    :func:`read_dcp_metadata`; pass it as ``dcp.load(..., storage_reader=safe_reader(path))``.

    The metadata is read once here, so a refusal raises :class:`CheckpointError` itself (DCP would wrap it).

    Raises:
        CheckpointError: the metadata names code, or cannot be read.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = read_dcp_metadata(f.read())
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    try:
        read_dcp_metadata((Path(path) / ".metadata").read_bytes())
    except OSError as exc:
        raise CheckpointError(f"DCP metadata {Path(path) / '.metadata'} cannot be read: {exc}") from None
    return SafeFileSystemReader(str(path))
