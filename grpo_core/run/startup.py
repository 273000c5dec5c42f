"""A run's start-up, overlapped: the trainer loads and compiles while the servers start (issue 25, item 6).

The flow starts the trainer right after the run is prepared, before the generation servers are healthy; the
trainer builds its model and compiles the top length bucket, then waits for the run's inputs — the servers' URLs and
the rollout process's Arrow Flight location — which the flow writes to ``<run_dir>/trainer_inputs.json``
(:data:`~grpo_core.run.layout.TRAINER_INPUTS`, :func:`write_inputs`) once the servers are healthy and the rollout
serves. A server that never becomes healthy fails the flow as before (``provision_servers``), and the flow stops
the waiting trainer with every other process.

Each attempt's start-up is recorded in ``<run_dir>/startup.jsonl`` (:data:`~grpo_core.run.layout.STARTUP`): one
line per event, ``{"event", "by", "t"}`` (``t``: seconds since the epoch, ``time.time()``), written by the process
it names (``flow``: ``command_start``, ``servers_healthy``, ``rollout_serves``; ``trainer``: ``trainer_start``,
``policy_built``, ``compiled``, ``inputs_ready``, ``first_step``). The trainer's ``perf/time_to_first_step_s``
(the summary's "time to first step") is ``first_step`` − ``command_start``: from the ``grpo train`` command's start
(``GRPO_COMMAND_START``, set by the command) or, for a flow run started otherwise, the attempt's start.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from grpo_core.run import layout
from grpo_core.run.durable import atomic_write_text

#: Seconds since the epoch at which the ``grpo train`` command started (set by ``flows/cli.py``, inherited by the
#: flow); a flow run started otherwise (a deployment) counts from its attempt's start.
COMMAND_START_ENV = "GRPO_COMMAND_START"


def command_start() -> float:
    """When the command started: ``$GRPO_COMMAND_START`` when set and a number, else now (``time.time()``)."""
    try:
        return float(os.environ[COMMAND_START_ENV])
    except (KeyError, ValueError):
        return time.time()


def begin(run_dir: str | Path, start: float) -> None:
    """Start this attempt's ``startup.jsonl`` afresh with its ``command_start`` event (the flow, after prepare)."""
    path = Path(run_dir) / layout.STARTUP
    atomic_write_text(path, json.dumps({"event": "command_start", "by": "flow", "t": start}) + "\n")


def mark(run_dir: str | Path, event: str, by: str, t: float | None = None) -> float:
    """Append ``event`` (done by process ``by``, at ``t`` or now) to the run's ``startup.jsonl``; returns ``t``."""
    t = time.time() if t is None else t
    with (Path(run_dir) / layout.STARTUP).open("a") as f:
        f.write(json.dumps({"event": event, "by": by, "t": t}) + "\n")
    return t


def events(run_dir: str | Path) -> dict[str, float]:
    """The recorded events of this attempt: name → time of its first record (a torn last line is skipped)."""
    path = Path(run_dir) / layout.STARTUP
    found: dict[str, float] = {}
    if not path.is_file():
        return found
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        found.setdefault(record["event"], float(record["t"]))
    return found


def write_inputs(path: Path, server_urls: list[str], rollout_location: str) -> None:
    """Hand the trainer its inputs (atomically: it never reads half a file)."""
    atomic_write_text(path, json.dumps({"server_urls": server_urls, "rollout_location": rollout_location}))


def wait_inputs(path: Path, timeout_s: float, poll_s: float = 0.2) -> tuple[list[str], str] | None:
    """Wait up to ``timeout_s`` for the inputs :func:`write_inputs` writes.

    Returns:
        ``(server URLs, rollout location)``, or None when the file did not come in time.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if path.is_file():
            data = json.loads(path.read_text())
            return list(data["server_urls"]), str(data["rollout_location"])
        if time.monotonic() >= deadline:
            return None
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))


def inputs_timeout_s(startup_timeout_s: float, start_retries: int, location_timeout_s: float) -> float:
    """How long a trainer started before the servers waits for its inputs: every attempt of the servers' start-up
    (``server.startup_timeout_s`` × (``server.start_retries`` + 1)), then the rollout's start (``location_timeout_s``),
    and a minute's margin. The flow stops the trainer earlier when a server fails to start; this bound only ends a
    trainer left waiting by a flow that no longer writes."""
    return startup_timeout_s * (start_retries + 1) + location_timeout_s + 60.0
