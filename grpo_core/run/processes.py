"""The processes of one run (servers, rollout, trainer) and their logs in the run's log (the Prefect run log).

Tasks receive references (the run folder), not process objects: the processes a run starts are
kept here, in :data:`REGISTRY` keyed by the run folder, so the flow's ``finally`` can stop every
one of them whatever task failed.
"""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_core.run.children import start_child, stop_child
from grpo_core.run.durable import atomic_write_text
from grpo_core.security.auth import new_token, run_token

# uvicorn access-log lines of the generation server: one per request, too many for the run log.
_NOISE = ('HTTP/1.1"', "httpx: HTTP Request", "Loading weights:")


def _skip(line: str) -> bool:
    return any(marker in line for marker in _NOISE)


class LogForwarder(threading.Thread):
    """Follows a log file from its current end and writes new lines to a logger (a Prefect run logger).

    Args:
        path: the log file (may not exist yet).
        log: logger (or ``LoggerAdapter``) receiving each line at INFO.
        prefix: prepended to each line, e.g. ``"[rollout] "``.
    """

    def __init__(self, path: Path, log: Any, prefix: str):
        super().__init__(name=f"log-forward-{Path(path).name}", daemon=True)
        self.path, self.log, self.prefix = Path(path), log, prefix
        self.stopped = threading.Event()

    def run(self) -> None:  # noqa: D102 - Thread.run
        offset, partial = 0, ""
        while True:
            final = self.stopped.is_set()
            try:
                with self.path.open("r", errors="replace") as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
            except OSError:
                chunk = ""
            lines = (partial + chunk).split("\n")
            partial = lines.pop()
            for line in lines:
                if line.strip() and not _skip(line):
                    self.log.info("%s%s", self.prefix, line)
            if final:
                return
            self.stopped.wait(0.5)

    def stop(self) -> None:
        """Forward what is left and end the thread."""
        self.stopped.set()
        self.join(timeout=5)


@dataclass
class RunProcesses:
    """What one flow run started; :meth:`stop_all` ends it all (in reverse start order)."""

    servers: list[Any] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)
    forwarders: list[LogForwarder] = field(default_factory=list)
    stopping: bool = False
    """Set by :meth:`stop_all`: a process that exits from now on was stopped by the flow."""
    failure: str | None = None
    """Set by :meth:`fail`: the child whose death ended the attempt, and how it ended."""
    failure_log: Path | None = None
    """Set by :meth:`fail`: that child's log file, when it has one."""
    token: str = field(default_factory=lambda: run_token() or new_token(), repr=False)
    """The run's bearer token (``grpo_core.security.auth``): every listener of the run requires it; children get it in
    their environment only (``GRPO_RUN_TOKEN``). Fresh for each run (a retried flow run too), unless the flow's
    own environment sets ``GRPO_RUN_TOKEN`` (an operator or a benchmark that must reach the servers)."""

    def follow(self, path: Path, log: Any, prefix: str) -> None:
        """Forward a log file to ``log`` until :meth:`stop_all` (once per file: a retried task may ask again)."""
        if any(f.path == Path(path) and f.is_alive() for f in self.forwarders):
            return
        forwarder = LogForwarder(path, log, prefix)
        forwarder.start()
        self.forwarders.append(forwarder)

    def fail(self, reason: str, log: Path | None = None) -> None:
        """A child died on its own: record ``reason`` (and its ``log``) and stop the trainer and rollout processes
        now (the trainer would otherwise notice a dead rollout process only after
        ``rollout.rollout_worker_timeout_s``, a dead server only after ``server.control_timeout_s``)."""
        if self.stopping or self.failure is not None:
            return
        self.failure, self.failure_log = reason, log
        for process in list(self.processes):
            stop_child(process)

    def stop_all(self) -> None:
        """Stop the trainer and rollout processes, then the servers, then the log forwarders."""
        from grpo_core.serving.launch import teardown

        self.stopping = True
        for process in reversed(self.processes):
            stop_child(process)
        teardown(self.servers)
        for forwarder in self.forwarders:
            forwarder.stop()
        self.servers, self.processes, self.forwarders = [], [], []


REGISTRY: dict[str, RunProcesses] = collections.defaultdict(RunProcesses)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a child of this process: ours, unbuffered and offline, naming this process its owner
    (``grpo_core.run.lifeline``: grpo-flow's entry points end when it does)."""
    from grpo_core.run import lifeline

    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **lifeline.owner_env(),
        **(extra or {}),
    }


def stream(
    cmd: list[str],
    log: Any,
    prefix: str,
    env: dict[str, str],
    pid_file: Path | None = None,
    register: RunProcesses | None = None,
    tail_lines: int = 60,
) -> tuple[int, str]:
    """Run ``cmd`` in its own session, forwarding each output line to ``log``; ``cmd`` is killed when the
    calling thread ends (``lifeline.die_with_parent``: torchrun is not grpo-flow's and cannot watch its owner).

    Returns:
        ``(exit code, the last tail_lines lines)``.
    """
    from grpo_core.run import lifeline

    process = start_child(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        preexec_fn=lifeline.die_with_parent,
        text=True,
        errors="replace",
        bufsize=1,
    )
    if register is not None:
        register.processes.append(process)
        if register.stopping:  # the flow stopped the run while this started (stop_all set it before stopping any)
            stop_child(process)
    if pid_file is not None:
        atomic_write_text(pid_file, str(process.pid))
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    assert process.stdout is not None
    for line in process.stdout:
        line = line.rstrip("\n")
        tail.append(line)
        if line.strip() and not _skip(line):
            log.info("%s%s", prefix, line)
    code = process.wait()
    if register is not None and process in register.processes:
        register.processes.remove(process)
    return code, "\n".join(tail)


def wait_child(process: subprocess.Popen, register: RunProcesses, name: str, log: Path | None = None) -> int:
    """Wait for a child of the run; one that exits non-zero while the flow is not stopping fails the attempt at
    once (:meth:`RunProcesses.fail`, naming ``log``: the other processes are stopped). Returns its exit code."""
    code = process.wait()
    if code != 0 and not register.stopping:
        register.fail(f"the {name} process {process.pid} exited with code {code}", log)
    if process in register.processes:
        register.processes.remove(process)
    return code


def watch_servers(register: RunProcesses) -> None:
    """Fail the attempt as soon as a generation server replica or the router the flow started exits on its own
    (:func:`wait_child` on a daemon thread each), or the ``grpo-servers`` flow run serving it ends (its handle's own
    ``watch``); the flow's own stop (``register.stopping``) is not a failure."""
    for handle in register.servers:
        if not hasattr(handle, "process"):  # replicas of another flow run: no process of ours to wait for
            handle.watch(register)
            continue
        spec = handle.spec
        name = "router" if spec.backend == "router" else f"generation server {spec.backend} replica {spec.replica}"
        threading.Thread(
            target=wait_child,
            args=(handle.process, register, name, spec.log_path),
            name=f"watch-{handle.process.pid}",
            daemon=True,
        ).start()


def setup_logging() -> None:
    """grpo_core's INFO records reach the run log (with PREFECT_LOGGING_EXTRA_LOGGERS); httpx's request lines do not."""
    logging.getLogger("grpo_core").setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)
