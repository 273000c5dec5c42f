"""Where LoRA adapter versions go so that every server host can read them (``train.adapter_store``).

Without a store, adapters stay in ``<train.output_dir>/.vllm_lora`` (servers on the trainer's host). With
one — a shared folder (NFS, a mounted bucket) or an fsspec URL (``s3://bucket/run``, ``gs://…``,
``file:///…``) — each finished version is copied there under a ``.partial`` name, moved to its final
name, and the trainer waits until the store lists every file at its full size (object stores and network
file systems may show a write late) before any server is asked to load it. Servers are given
``train.adapter_store_served_as`` + the version's name when set (where the servers mount the store, e.g.
``/mnt/adapters``), else the store's own path or URL. The load fan-out retries every
``server.control_retry_s`` until every replica has loaded it (``ReplicaSet.fan_out``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from grpo_core.errors import ServingError

logger = logging.getLogger(__name__)


class AdapterStore:
    """Publishes finished adapter folders to ``train.adapter_store`` (see module docs).

    Args:
        url: a folder path or fsspec URL; None = no store (servers read the local folder).
        served_as: how the servers reach the store (a mount point); None = ``url`` itself.
        timeout_s: seconds to wait for the store to list a published version complete.
        poll_s: seconds between listings while waiting.
    """

    def __init__(
        self, url: str | None, served_as: str | None = None, timeout_s: float = 60.0, poll_s: float = 0.5
    ) -> None:
        self.url, self.served_as, self.timeout_s, self.poll_s = url, served_as, timeout_s, poll_s
        self.fs, self.root = None, ""
        if url is not None:
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(url)
            self.fs.makedirs(self.root, exist_ok=True)

    def _remote(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def served_path(self, local: Path, name: str) -> str:
        """What a server is asked to load for version folder ``name`` (``local`` without a store)."""
        if self.url is None:
            return str(local)
        base = self.served_as if self.served_as is not None else self.url
        return f"{base.rstrip('/')}/{name}"

    def publish(self, local: Path, name: str) -> str:
        """Copy the finished folder ``local`` to the store as ``name`` and wait until it is complete there.

        Returns:
            The path or URL the servers load (:meth:`served_path`).

        Raises:
            ServingError: the store did not list every file at its size within ``timeout_s``.
        """
        if self.fs is None:
            return str(local)
        sizes = {f.name: f.stat().st_size for f in sorted(local.iterdir()) if f.is_file()}
        partial, final = self._remote(name + ".partial"), self._remote(name)
        for path in (partial, final):
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        self.fs.makedirs(partial, exist_ok=True)
        for file in sizes:
            self.fs.put_file(str(local / file), f"{partial}/{file}")
        self.fs.mv(partial, final, recursive=True)
        self._wait_complete(final, sizes)
        return self.served_path(local, name)

    def _wait_complete(self, folder: str, sizes: dict[str, int]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            self.fs.invalidate_cache(folder)
            try:
                listed = {Path(e["name"]).name: e.get("size") for e in self.fs.ls(folder, detail=True)}
            except FileNotFoundError:
                listed = {}
            missing = {f: s for f, s in sizes.items() if listed.get(f) != s}
            if not missing:
                return
            if time.monotonic() > deadline:
                raise ServingError(
                    f"train.adapter_store: {folder} still lacks {sorted(missing)} (or shows them "
                    f"short) {self.timeout_s:.0f} s after the upload; check the store"
                )
            time.sleep(self.poll_s)

    def remove(self, name: str) -> None:
        """Delete version ``name`` from the store (no-op without a store or when already gone)."""
        if self.fs is not None and self.fs.exists(self._remote(name)):
            self.fs.rm(self._remote(name), recursive=True)
