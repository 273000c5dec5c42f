"""The one home of process lifetimes: start a child in its own session, stop it and all it started, pick a free
port, read the tail of its log.

Every process grpo-flow starts (the generation replicas, the router, the rollout process, torchrun, the Prefect
stack, the MLflow UI) is started by :func:`start_child` in a session of its own, so a stop reaches its whole process
group and a Ctrl-C of the terminal reaches only the command the user ran. :func:`stop_child` collects its targets
*before* signalling (prime-rl ``utils/process.py`` does the same): the child's live descendants — including those
that left its group, as a torchrun rank does (torch 2.11 starts each rank in its own session) — and every member of
its group, signalled even when the leader already exited. SIGTERM to all of them, SIGKILL to what still lives after
``timeout_s``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def start_child(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: int | IO[Any] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    **popen_kwargs: Any,
) -> subprocess.Popen:
    """Start ``argv`` in a session (and process group) of its own, standard input closed.

    Args:
        argv: the command line.
        env: its environment (default: this process's).
        stdout: where its output goes (a file opened for writing, ``subprocess.PIPE``, or None to share ours);
            standard error follows standard output unless ``popen_kwargs`` says otherwise.
        preexec_fn: run in the child between fork and exec (``grpo_core.run.lifeline.die_with_parent`` for programs
            that are not grpo-flow's).
        **popen_kwargs: passed to :class:`subprocess.Popen` (``text``, ``bufsize``, ``cwd``, ``stderr``...).

    Returns:
        The child; stop it with :func:`stop_child`.
    """
    popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
    if stdout is not None:
        popen_kwargs.setdefault("stderr", subprocess.STDOUT)
    return subprocess.Popen(
        list(argv),
        env=None if env is None else dict(env),
        stdout=stdout,
        preexec_fn=preexec_fn,
        start_new_session=True,
        **popen_kwargs,
    )


def stop_child(process: subprocess.Popen, timeout_s: float = 20.0, name: str = "") -> int | None:
    """Stop ``process`` (started by :func:`start_child`), its process group and every process descended from it.

    The targets are collected first (psutil): the live descendants, those that left the group too, and the members
    of the group, which are signalled even when the leader already exited. SIGTERM to each, SIGKILL to whatever
    still lives after ``timeout_s`` seconds; returns once all are gone.

    Args:
        process: the child.
        timeout_s: seconds each signal is given before the next (SIGTERM, then SIGKILL).
        name: what the child is, for the warning logged when it ignored SIGTERM ("" logs nothing).

    Returns:
        Its exit code (negative: the signal that ended it), None if it could not be reaped.
    """
    import psutil

    if process.poll() is not None and psutil.pid_exists(process.pid):
        return process.returncode  # the leader was reaped and its pid reused: that process and its group are not ours
    targets = _group_members(process.pid)
    try:
        leader = psutil.Process(process.pid)
        targets |= {leader, *leader.children(recursive=True)}
    except psutil.NoSuchProcess:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if sig == signal.SIGKILL and name:
            logger.warning("%s ignored SIGTERM for %.0f s; sending SIGKILL", name, timeout_s)
        signal_group(process.pid, sig)
        for proc in targets:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        if process.poll() is None:  # reap our own child so it is not waited for as a zombie
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        _, alive = psutil.wait_procs(list(targets), timeout=timeout_s)
        targets = set(alive)
        if not targets:
            break
    return process.poll()


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when no such group (or not ours to signal)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _group_members(pgid: int) -> set:
    """The live processes of process group ``pgid`` (psutil), its leader gone or not."""
    import psutil

    members = set()
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members.add(proc)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return members


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` right now (the kernel's pick for port 0; IPv6 when ``host`` has a colon).

    Another process may take it before the caller binds it: prefer handing a listening socket over
    (``grpo_core.serving.embedded.server.bind_socket``) where the listener is ours.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(path: Path, num_lines: int = 40) -> str:
    """The last ``num_lines`` lines of a child's log file ('' when it does not exist or cannot be read)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""
