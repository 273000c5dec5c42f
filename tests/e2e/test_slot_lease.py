"""The GPU slots' lease against a real Prefect server that restarts (issue 26, item 11).

A run holds its slots of the global concurrency limit ``gpu`` under a lease (``flows.slot_lease``). Prefect's own
``concurrency()`` (used before) stopped renewing after three failed tries and let the run go on training on slots
the server had freed. Here a flow run holds the slot with a 60 s lease (the least Prefect takes) while it "trains"
(a loop of waits, as the flow waits for the trainer); the server is stopped and started again on the same port and
database. The restarted server has forgotten the lease (410 at the next renewal), and the run must stop inside its
``with`` block with :class:`SlotLeaseLost`, the curable error the flow's retry resumes from. On the previous code
the run trained on to its end (the probe's 600 s block) with no error. The restarted server still counts the slot as
taken (seen: ``active_slots`` 1): the guide says how to free it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys, time
from pathlib import Path
from prefect import flow
import flows.slot_lease as slot_lease
from flows.grpo_train import gpu_slots
from grpo_core.config import RunConfig

slot_lease.SLOT_LEASE_S = float(sys.argv[2])
out = Path(sys.argv[1])

@flow
def hold():
    report = {"entered": False, "trained_s": 0.0, "error": None}
    start = time.monotonic()
    try:
        with gpu_slots(RunConfig()):
            report["entered"] = True
            out.with_suffix(".holding").touch()
            # the trainer's run: a blocking wait, step after step; 600 s outlasts the restart (up to 15 + 240 s)
            # and the next renewal on a loaded box, so a run that stops does so inside the block
            while time.monotonic() - start < 600:
                time.sleep(1.0)
                report["trained_s"] = time.monotonic() - start
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        from grpo_core.run.retry import retry_can_cure
        report["curable"] = retry_can_cure(exc)
    out.write_text(json.dumps(report))

hold()
"""


def _wait_health(stack, deadline_s: float = 240.0) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            if httpx.get(f"{stack.api_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the Prefect server did not come back"
        time.sleep(0.5)


@pytest.mark.slow
def test_a_run_whose_slot_lease_is_lost_when_the_server_restarts_stops(tmp_path):
    from flows.serve import PrefectStack
    from grpo_core.run.children import stop_child

    stack = PrefectStack(port=0, home=tmp_path / "prefect", server_pool=None, gpu_slots=1).start()
    probe = None
    try:
        for worker in list(stack.workers.values()):  # only the server is needed
            stop_child(worker, timeout_s=15)
            stack.processes.remove(worker)
        out = tmp_path / "probe.json"
        env = {**stack.env(), "PYTHONPATH": str(ROOT)}
        probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, str(out), "60"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 180
        while not out.with_suffix(".holding").exists():
            assert probe.poll() is None, probe.stdout.read().decode()[-3000:] if probe.stdout else ""
            assert time.monotonic() < deadline, "the probe never held the slot"
            time.sleep(0.2)
        with stack.client() as client:  # set-up check: the slot is really held
            assert client.read_global_concurrency_limit_by_name("gpu").active_slots == 1

        server = stack.processes[0]
        stop_child(server, timeout_s=15)
        stack.processes.remove(server)
        stack._spawn(["server", "start", "--host", "127.0.0.1", "--port", str(stack.port)], "server.log")
        _wait_health(stack)

        probe.wait(timeout=240)
        log = probe.stdout.read().decode() if probe.stdout else ""
        report = json.loads(out.read_text())
        assert report["entered"], log[-3000:]
        assert report["error"] and report["error"].startswith("SlotLeaseLost"), (report, log[-3000:])
        assert report["curable"], report  # the flow's retry resumes the run
        assert report["trained_s"] < 600, report  # it stopped inside the block, not after its work
    finally:
        if probe is not None and probe.poll() is None:
            stop_child(probe, timeout_s=10)
        stack.stop()
