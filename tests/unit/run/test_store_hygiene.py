"""The stores a run writes: private modes (issue 26, item 4), runs left RUNNING by a killed owner, and checkpoint
URIs of paths that need percent-encoding (item 13)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_core import tracking
from grpo_core.config import RunConfig
from grpo_core.tracking.checks import check_tracking

ROOT = Path(__file__).resolve().parents[3]


def _cfg(store: Path, **tracking_fields) -> RunConfig:
    return RunConfig(
        tracking={"dir": store, "experiment_name": "t", **tracking_fields},
        rollout={"dataset": "reasoning_gym:basic_arithmetic", "dataset_size": 4},
    )


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask():
    """The usual umask 022, under which a folder is made 0755 and a file 0644 unless the code says otherwise."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_mlflow_store_and_prefect_home_are_their_owners_only(tmp_path, open_umask):
    from flows.local_api import prepare_home

    # the flow's preflight creates the embedded MLflow store (and the parent folder it lacks)
    store = tmp_path / "runs" / "mlflow"
    check_tracking(_cfg(store))
    assert (store / "mlflow.db").is_file() and (store / "artifacts").is_dir()  # it really made them
    for folder in (tmp_path / "runs", store, store / "artifacts"):
        assert _mode(folder) == 0o700, folder
    assert _mode(store / "mlflow.db") == 0o600
    # the tracking client alone (no preflight) on a fresh store; and an old store made world-readable is tightened
    for fresh in (tmp_path / "other" / "mlflow", tmp_path / "old"):
        if fresh.name == "old":
            fresh.mkdir(mode=0o755)
            assert _mode(fresh) == 0o755
        tracking.start_run(_cfg(fresh), "flow-1")
        assert (fresh / "mlflow.db").is_file()
        assert _mode(fresh) == 0o700 and _mode(fresh / "mlflow.db") == 0o600
    # Prefect's home as grpo's CLI prepares it before its server starts
    home = prepare_home(tmp_path / "state" / "prefect", env={})
    assert (home / "prefect.db").is_file()
    assert _mode(tmp_path / "state") == _mode(home) == 0o700 and _mode(home / "prefect.db") == 0o600


_OWNER = """
import sys
from grpo_core import tracking
from grpo_core.config import RunConfig

cfg = RunConfig(tracking={"dir": sys.argv[1], "experiment_name": "t"},
                rollout={"dataset": "reasoning_gym:basic_arithmetic", "dataset_size": 4})
run_id, _ = tracking.start_run(cfg, sys.argv[2])
print(run_id, flush=True)
sys.stdin.read()  # until the test kills it (or closes stdin)
"""


def _owner(store: Path, flow_run_id: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(store), flow_run_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_run_left_running_by_a_sigkilled_owner_ends_as_killed_on_the_next_start(tmp_path):
    """Two processes open runs and stay; one is SIGKILLed. The next run opened in the store ends the killed one's
    run as KILLED and leaves the live one's RUNNING; resuming the killed run makes it RUNNING again, owned by the
    process that resumed it."""
    store = tmp_path / "mlflow"
    killed, killed_run = _owner(store, "flow-killed")
    alive, alive_run = _owner(store, "flow-alive")
    try:
        mc = tracking.client(_cfg(store).tracking)
        assert killed_run and alive_run
        assert mc.get_run(killed_run).info.status == mc.get_run(alive_run).info.status == "RUNNING"
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(timeout=60) == -signal.SIGKILL  # really killed, no exit handler ran
        assert mc.get_run(killed_run).info.status == "RUNNING"  # what a SIGKILL leaves behind

        new_run, _ = tracking.start_run(_cfg(store), "flow-new")
        assert mc.get_run(killed_run).info.status == "KILLED" and mc.get_run(killed_run).info.end_time
        assert mc.get_run(alive_run).info.status == "RUNNING"  # its owner lives
        assert mc.get_run(new_run).info.status == "RUNNING"  # this process owns it

        resumed, continued = tracking.start_run(_cfg(store), "flow-killed")
        assert continued and resumed == killed_run and mc.get_run(killed_run).info.status == "RUNNING"
        assert mc.get_run(killed_run).data.tags[tracking.OWNER_TAG].split("|")[4] == str(os.getpid())
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait(timeout=60)
            if proc.stdin is not None:
                proc.stdin.close()
            if proc.stdout is not None:
                proc.stdout.close()


def test_a_checkpoint_uri_of_a_folder_with_a_space_and_percent_round_trips(tmp_path):
    """A checkpoint too large for the artifact store is logged as the ``file:`` URI of its folder; a folder whose
    name holds a space and ``%20`` is percent-encoded there and must be decoded on download."""
    cfg = _cfg(tmp_path / "mlflow", checkpoint_artifact_max_mib=0.5)
    run_id, _ = tracking.start_run(cfg, "flow-uri")
    folder = tmp_path / "my runs" / "100%20done" / "checkpoints" / "step-0000003"
    (folder / "dcp").mkdir(parents=True)
    (folder / "dcp" / "data").write_bytes(b"x" * 2**20)
    (folder / "rollout_state.json").write_text(json.dumps({"step": 3, "policy_version": 3}))
    tracking.log_checkpoint(cfg.tracking, run_id, folder)
    mc = tracking.client(cfg.tracking)
    logged = Path(mc.download_artifacts(run_id, f"checkpoints/step-0000003/{tracking.CHECKPOINT_URI_FILE}"))
    assert "%2520" in logged.read_text() and "%20" in logged.read_text()  # set-up: the URI really is encoded
    got = tracking.download_latest_checkpoint(cfg.tracking, run_id, tmp_path / "b")
    assert got == tmp_path / "b" / "checkpoints" / "step-0000003"
    assert (got / "dcp" / "data").read_bytes() == b"x" * 2**20


def test_an_owner_that_cannot_be_judged_from_here_is_never_taken_for_gone():
    """Only a process this machine can see may be declared gone: another host or machine with the same host name,
    another PID namespace (a container with host networking), a malformed tag are unknown (None), never True; a
    reboot of this very machine is True."""
    import socket

    from grpo_core.run import lifeline

    me = lifeline.process_tag()
    host, machine, boot, namespace, pid, start = me.split("|")
    assert lifeline.process_gone(me) is False
    assert lifeline.process_gone("|".join([host, "another-machine", boot, namespace, pid, start])) is None
    assert (
        lifeline.process_gone("|".join(["not-" + socket.gethostname(), machine, boot, namespace, pid, start])) is None
    )
    other_namespace = str(int(namespace) + 1) if namespace else "another-namespace"
    assert lifeline.process_gone("|".join([host, machine, boot, other_namespace, pid, start])) is None
    assert lifeline.process_gone("|".join([host, machine, "another-boot", namespace, pid, start])) is True
    assert lifeline.process_gone("host|boot|1|2") is None  # the four-field tag of no release
