"""One writer per run folder: an exclusive lock (``filelock``, ``flock(2)`` on POSIX) on ``<run folder>/run.lock``.

The trainer holds it for its whole life (checkpoints, ``metrics.jsonl``, ``trained_prompts.jsonl``), so a retry
that starts while an orphaned trainer of the killed attempt still runs fails naming that process instead of
interleaving two writers. The kernel drops the lock when its holder dies, SIGKILL included; the holder's pid,
host and role are kept beside it in ``run.lock.owner`` (removed on release) for the error message.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from filelock import FileLock, Timeout

from grpo_core.errors import RunLockedError
from grpo_core.run.durable import atomic_write_text
from grpo_core.run.layout import RUN_LOCK as LOCK_FILE
from grpo_core.run.layout import RUN_LOCK_OWNER as OWNER_FILE


class RunLock:
    """The run folder's lock; a context manager.

    Args:
        run_dir: the run folder (``train.output_dir`` of the trainer).
        role: who takes it (``trainer``, ``prepare``), recorded for the holder's message.
        timeout_s: seconds to wait for a holder to go away (``train.run_lock_timeout_s``).
    """

    def __init__(self, run_dir: Path, role: str, timeout_s: float = 0.0):
        self.run_dir, self.role, self.timeout_s = Path(run_dir), role, timeout_s
        self._lock = FileLock(str(self.run_dir / LOCK_FILE), thread_local=False)

    def holder(self) -> dict:
        """What the holder recorded (``{"pid", "host", "role", "since"}``), {} when unknown."""
        try:
            return json.loads((self.run_dir / OWNER_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def acquire(self) -> RunLock:
        """Take the lock (waiting up to ``timeout_s``).

        Raises:
            RunLockedError: another process still holds it after ``timeout_s``; the message names its pid.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=self.timeout_s)
        except Timeout:
            h = self.holder()
            who = (
                f"pid {h.get('pid')} on {h.get('host')} ({h.get('role')}, since {h.get('since')})"
                if h
                else "a process that recorded no pid"
            )
            raise RunLockedError(
                f"run folder {self.run_dir} is in use by {who}; waited {self.timeout_s:.0f} s "
                "(train.run_lock_timeout_s). Another attempt of this run is still writing it: stop that process, "
                "or wait for it to exit"
            ) from None
        atomic_write_text(
            self.run_dir / OWNER_FILE,
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "role": self.role,
                    "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                }
            ),
        )
        return self

    def release(self) -> None:
        """Give the lock back (the owner record goes first)."""
        if self._lock.is_locked:
            (self.run_dir / OWNER_FILE).unlink(missing_ok=True)
            self._lock.release()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
