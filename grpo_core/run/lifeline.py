"""Processes never outlive their run: a child ends itself within a second of its owner dying.

Every process grpo-flow starts runs in its own session (so a stop reaches its whole group), which
also cuts it loose from its parent: when the flow-run process is SIGKILLed (Prefect kills 30 s after
SIGTERM, an OOM kill, ``kill -9``), nothing tells the children. So the launcher names itself in the
child's environment (:func:`owner_env`, variable ``GRPO_OWNER``: pid and start time, so a reused pid
is not mistaken for the owner; on Linux the start time is in clock ticks since boot, so a step of the
wall clock changes nothing), and each grpo-flow entry point (rollout process, embedded server, trainer
rank) calls :func:`watch` first thing: a daemon thread polls the owner, and the process's
original parent where asked (a trainer rank watches torchrun, which torch 2.11 starts each rank
apart from: its own session), and SIGKILLs this process's group (or this process alone when it
leads none) once one of them is gone. Programs that are not grpo-flow's (vLLM, torchrun itself)
get :func:`die_with_parent` as ``preexec_fn``: Linux's ``PR_SET_PDEATHSIG``, which fires when the
launching *thread* ends, so they must be launched from a thread that lives as long as they should; one launched
from a short-lived thread (Prefect's temporary API server) runs as ``python -m grpo_core.run.lifeline MODULE ...``
(:func:`run_owned_module`: the module in-process under :func:`watch`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from grpo_core.run.children import signal_group

OWNER_ENV = "GRPO_OWNER"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_ORIGINAL_PARENT = os.getppid()  # read when the entry point imports this module: the parent that started us
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # resolved before any fork
_PROC_STAT = Path(f"/proc/{os.getpid()}/stat").is_file()  # Linux: start times in ticks since boot

logger = logging.getLogger(__name__)


def _start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22, ``proc(5)``), None when no such
    live process. Boot-relative: a step of the wall clock (NTP, a VM resumed) leaves it unchanged."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:  # no such process (or /proc unreadable: treated as gone)
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # after the command name, which may hold spaces and ')'
    if fields[0] in (b"Z", b"X"):  # field 3, the state: dead, not yet reaped by its parent
        return None
    return int(fields[19])  # field 22, starttime


def _start_time(pid: int) -> float | None:
    """Start time of ``pid``, None when no such live process: clock ticks since boot on Linux
    (:func:`_start_ticks`); elsewhere seconds since the epoch (psutil), which a wall-clock step moves."""
    if _PROC_STAT:
        return _start_ticks(pid)
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:  # dead, not yet reaped by its parent
            return None
        return process.create_time()
    except psutil.NoSuchProcess:
        return None


def owner_env(pid: int | None = None) -> dict[str, str]:
    """The environment entry that makes ``pid`` (default: this process) the owner of a child it launches."""
    pid = os.getpid() if pid is None else pid
    return {OWNER_ENV: f"{pid}:{_start_time(pid)!r}"}


def _boot_id() -> str:
    """This boot of this host: the kernel's random boot id on Linux, else the boot time (psutil)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import psutil

        return f"{psutil.boot_time():.0f}"


def _machine_id() -> str:
    """This machine (``/etc/machine-id``; '' where there is none): two hosts may share a host name."""
    try:
        return Path("/etc/machine-id").read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``; '' where there is none): containers on one
    host (host networking) share its name and boot id, not their pids."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def process_tag(pid: int | None = None) -> str:
    """Who ``pid`` (default: this process) is, for another process to tell later whether it still lives
    (:func:`process_gone`): ``host|machine id|boot id|pid namespace|pid|start time`` (clock ticks since boot on
    Linux, so neither a reused pid nor a step of the wall clock confuses it)."""
    import socket

    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}|{_machine_id()}|{_boot_id()}|{_pid_namespace()}|{pid}|{_start_time(pid)!r}"


def process_gone(tag: str) -> bool | None:
    """Whether the process a :func:`process_tag` names has ended.

    Returns:
        True when its machine has rebooted since, or its pid (in this PID namespace) is gone or now another
        process; False while it lives, or when its ``/proc`` entry cannot be read (another user's process under
        ``hidepid``: alive as far as we can tell); None when it cannot be told from here: another host or machine,
        another PID namespace (a container), a malformed tag. Only True may lead a caller to end what it owned.
    """
    import socket

    try:
        host, machine, boot, namespace, pid, start = tag.split("|")
        pid_n, start_n = int(pid), None if start == "None" else float(start)
    except ValueError:
        return None
    if host != socket.gethostname() or machine != _machine_id():
        return None
    if boot != _boot_id():
        return True  # this very machine rebooted: nothing of before lives
    if namespace != _pid_namespace() or start_n is None:
        return None
    try:
        Path(f"/proc/{pid_n}/stat").read_bytes()
    except PermissionError:
        return False
    except OSError:
        pass  # no such process: _alive says gone
    return not _alive(pid_n, start_n)


def _owner() -> tuple[int, float] | None:
    """``(pid, start time)`` from ``GRPO_OWNER``, None when unset or malformed."""
    value = os.environ.get(OWNER_ENV, "")
    try:
        pid, start = value.split(":", 1)
        return int(pid), float(start)
    except ValueError:
        return None


def _alive(pid: int, start: float | None = None) -> bool:
    """Whether ``pid`` lives and, given ``start`` (:func:`_start_time` when it was named), is that same process: the
    same start tick on Linux, the same second elsewhere (a reused pid starts later)."""
    now = _start_time(pid)
    return now is not None and (start is None or abs(now - start) < (0.5 if _PROC_STAT else 1.0))


def orphaned(parent: bool = True) -> str | None:
    """Why this process has lost its owner (``GRPO_OWNER`` gone) or, with ``parent``, the parent that
    started it (gone, or this process re-parented since); None while both live."""
    owner = _owner()
    if owner is not None and not _alive(*owner):
        return f"its owner (pid {owner[0]}) is gone"
    if parent and (os.getppid() != _ORIGINAL_PARENT or not _alive(_ORIGINAL_PARENT)):
        return f"its parent (pid {_ORIGINAL_PARENT}) is gone"
    return None


def watch(parent: bool = False, interval_s: float = 0.5) -> threading.Thread | None:
    """SIGKILL this process's group (this process alone when it leads none) within ``interval_s`` of its owner
    (``GRPO_OWNER``) dying, and, with ``parent``, of the parent that started it dying.

    Returns:
        The daemon watch thread, or None when there is nothing to watch (no ``GRPO_OWNER`` and not ``parent``:
        a process started by hand from a shell lives on its own).
    """
    if _owner() is None and not parent:
        return None

    def loop() -> None:
        while True:
            why = orphaned(parent)
            if why is not None:
                try:  # the owner often held the other end of stderr: a broken pipe must not stop the kill
                    print(f"grpo-flow: pid {os.getpid()} exits: {why}", file=sys.stderr, flush=True)  # noqa: T201
                except (OSError, ValueError):
                    pass
                if os.getpgrp() == os.getpid():
                    signal_group(os.getpid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait(interval_s)

    thread = threading.Thread(target=loop, name="grpo-lifeline", daemon=True)
    thread.start()
    return thread


def die_with_parent() -> None:
    """``preexec_fn`` for a child that is not grpo-flow's: SIGKILL it when the launching thread ends (Linux
    ``prctl(PR_SET_PDEATHSIG)``; elsewhere nothing). Runs in the child between fork and exec."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def interruptible() -> None:
    """``preexec_fn`` for a child meant to be stopped with SIGINT as Ctrl-C stops it: SIGINT's default action. A
    script's background job (a CI runner's ``make test``) inherits SIGINT ignored, and Python keeps an inherited
    ignore, so the child would never see the interrupt. Runs in the child between fork and exec."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_owned_module(argv: list[str]) -> None:
    """Run ``python -m MODULE ARGS...`` (``argv = [MODULE, *ARGS]``) in this process under :func:`watch`: for a
    program that is not grpo-flow's, launched from a thread that does not outlive it (where
    :func:`die_with_parent` cannot serve), e.g. Prefect's temporary API server (``flows.local_api``).

    Raises:
        SystemExit: no module named (a usage message, exit code 1), or whatever the module's own ``__main__``
            raises.
    """
    import runpy

    if not argv:
        raise SystemExit("usage: python -m grpo_core.run.lifeline MODULE [ARGS...]")
    watch()
    sys.argv = list(argv)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    run_owned_module(sys.argv[1:])
