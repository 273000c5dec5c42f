"""Files a crash cannot leave half written: atomic replacement, appended JSON lines with a torn-tail repair, fsync.

Every file a resumed run reads at start is either replaced atomically (:func:`atomic_write_text`: a sibling
temporary file, fsync, ``os.replace``, fsync of the folder) or an append-only JSON-lines log
(:class:`JsonlAppender`, :func:`read_jsonl`). A process killed while appending leaves at most one torn last
line; readers skip it with a warning, and the next writer cuts it off before appending, so a torn line
never ends up in the middle of a file (PaddleFormers PR #4744 is the failure this prevents: one torn line
and every later resume raised ``JSONDecodeError``).

Durability follows the POSIX rule that a rename is durable only once the folder holding it is fsynced
(``fsync(2)``: "calling fsync() does not necessarily ensure that the entry in the directory containing
the file has also reached disk").
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    """fsync a folder, so the entries created, renamed or removed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (files first, then folders bottom-up, then ``root``)."""
    root = Path(root)
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) so a reader sees the old content or the new, never a part.

    Writes ``.<name>.<pid>.tmp`` beside it, fsyncs it, renames it over ``path`` and fsyncs the folder.
    ``mode`` (e.g. ``0o600``) is set on the file before any byte is written; None keeps the umask's default.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
    if mode is not None:
        os.fchmod(fd, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def _cut_torn_tail(path: Path) -> None:
    """Truncate ``path`` after its last newline (a torn last line left by a killed writer), with a warning."""
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        data = path.read_bytes()
        keep = data.rfind(b"\n") + 1
        logger.warning(
            "%s ends with a torn line (%d bytes, a writer was killed while appending); it is cut off", path, size - keep
        )
        f.truncate(keep)
        os.fsync(f.fileno())


class JsonlAppender:
    """Appends one JSON object per line to a file, each line flushed and fsynced.

    Opening it cuts a torn last line off the file first (see the module docs), so appended records
    always start on a line of their own.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            _cut_torn_tail(self.path)
        self._f = self.path.open("a", encoding="utf-8")
        fsync_dir(self.path.parent)

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one line and make it durable."""
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        """Close the file."""
        self._f.close()


def read_jsonl(path: str | Path) -> list[dict]:
    """All records of a JSON-lines file; a torn last line (killed writer) is skipped with a warning.

    Returns:
        The records in file order ([] when the file does not exist).

    Raises:
        ValueError: a line other than the last is not JSON (the file was damaged otherwise); the message
            names the file and line.
    """
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    torn_last = lines[-1] != ""  # a complete file ends with "\n"
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as exc:
            if number == len(lines) or (number == len(lines) - 1 and not torn_last):
                logger.warning("%s: the last line is torn (a writer was killed while appending); it is skipped", path)
                continue
            raise ValueError(
                f"{path}:{number} is not a JSON line ({exc}); the file was damaged, not just cut "
                "short: repair or remove that line"
            ) from None
    return out


def rewrite_jsonl(path: str | Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Replace a JSON-lines file with ``records``, atomically (:func:`atomic_write_text`)."""
    atomic_write_text(Path(path), "".join(json.dumps(r) + "\n" for r in records))


__all__ = ["JsonlAppender", "atomic_write_text", "fsync_dir", "fsync_tree", "read_jsonl", "rewrite_jsonl"]
