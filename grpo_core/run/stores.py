"""The local stores' folders and SQLite files (the MLflow store, Prefect's home and database): private, writable,
openable, checked before a run writes them.

A store's folder (checkpoints, configs, every forwarded log line) is its owner's only, whatever the umask
(:func:`make_private_dir`); :func:`ensure_dir` and :func:`check_sqlite` refuse a folder or database that cannot be
used, naming the setting, the path and the cause.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

from grpo_core.errors import ConfigError

#: Mode of a store's folder (the MLflow store, Prefect's home) and of its database file: its owner's only.
PRIVATE_DIR_MODE, PRIVATE_FILE_MODE = 0o700, 0o600


def make_private_dir(path: Path) -> Path:
    """Create ``path`` and the parents it lacks as mode 0700, and make an existing ``path`` of this user 0700: a
    store's folder (checkpoints, configs, every forwarded log line) is its owner's only, whatever the umask.

    Raises:
        OSError: the folder cannot be created or its mode set.
    """
    path = Path(path)
    missing = []
    target = path
    while not target.exists():
        missing.append(target)
        target = target.parent
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    for folder in missing:
        folder.chmod(PRIVATE_DIR_MODE)  # mkdir's mode applies to the leaf only, and through the umask
    if not missing and path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
        path.chmod(PRIVATE_DIR_MODE)
    return path


def ensure_dir(path: Path, what: str, create: bool = True, private: bool = False) -> Path:
    """Create ``path`` with its parents and check that files can be written in it.

    Args:
        path: the folder.
        what: what the folder is for and which setting names it, e.g. ``"tracking.dir (the MLflow store)"``.
        create: False (``grpo validate``): create nothing; a folder that does not exist yet passes when its
            nearest existing parent is a writable folder (the run could create it).
        private: a store's own folder: created 0700 (with the parents it lacks), an existing one of this user
            made 0700 (:func:`make_private_dir`).

    Returns:
        ``path``, resolved.

    Raises:
        ConfigError: the folder cannot be created or written (names ``what``, the path and the cause).
    """
    path = Path(path).expanduser().resolve()
    target = path
    if create:
        try:
            make_private_dir(path) if private else path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"{what}: cannot create the folder {path}: {exc.strerror or exc}; "
                "point the setting at a writable folder"
            ) from None
    else:
        try:
            while not target.exists():
                target = target.parent
        except OSError as exc:  # a parent this user cannot search
            raise ConfigError(
                f"{what}: cannot check the folder {path}: {exc.strerror or exc}; point the setting at a writable folder"
            ) from None
        if not target.is_dir():
            raise ConfigError(
                f"{what}: cannot create the folder {path}: {target} is a file; point the setting at a writable folder"
            )
    if not os.access(target, os.W_OK | os.X_OK):
        where = "" if target == path else f" (it would be made in {target})"
        raise ConfigError(f"{what}: the folder {target} is not writable{where}; point the setting at a writable folder")
    return path


def open_sqlite(path: Path, read_only: bool = False) -> contextlib.closing:
    """A connection to the SQLite file ``path`` (closed on leaving the ``with``); ``read_only``: opened through its
    ``file:`` URI with ``mode=ro`` (``Path.as_uri`` escapes a '?' or '#' of the path), which creates nothing.

    Raises:
        sqlite3.Error: it cannot be opened.
    """
    target = Path(path).expanduser().resolve().as_uri() + "?mode=ro" if read_only else str(path)
    return contextlib.closing(sqlite3.connect(target, timeout=10, uri=read_only))


def check_sqlite(path: Path, what: str, create: bool = True, private: bool = False) -> None:
    """Create ``path``'s folder and open (or create) the SQLite database there once; the database file is made
    0600 (SQLite gives its journal and WAL files the database's mode).

    Args:
        path: the database file.
        what: the setting that names it (for errors).
        create: False (``grpo validate``): create nothing; an existing database is opened read-only, a missing one
            passes when :func:`ensure_dir` ``(create=False)`` passes for its folder.
        private: the folder is the store's own: 0700 (:func:`ensure_dir`).

    Raises:
        ConfigError: the folder or the database cannot be opened (names ``what``, the path and the cause).
    """
    path = Path(path).expanduser()
    ensure_dir(path.parent, what, create, private)
    if not create and not path.exists():
        return
    try:
        with open_sqlite(path, read_only=not create) as db:
            db.execute("PRAGMA schema_version").fetchone()
    except sqlite3.Error as exc:
        raise ConfigError(f"{what}: cannot open the SQLite database {path.resolve()}: {exc}") from None
    if create and path.stat().st_uid == os.getuid():
        path.chmod(PRIVATE_FILE_MODE)


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLAlchemy SQLite URL (``sqlite:///x.db``, ``sqlite+aiosqlite:////abs.db``); None otherwise."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.split("+")[0] != "sqlite" or not rest.startswith("/"):
        return None
    file = rest[1:].split("?")[0]
    return Path(file) if file and file != ":memory:" else None
