"""``grpo ui --mlflow`` behind a password (issue 26, item 5): without it every route but ``/health`` answers 401,
with it MLflow answers; MLflow itself listens on no TCP port (a Unix socket in a 0700 folder), and SIGTERM leaves
no process behind. The real CLI, a real MLflow server and a run in its store."""

from __future__ import annotations

import base64
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from grpo_core import tracking
from grpo_core.config import RunConfig
from grpo_core.run.children import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _store(tmp: Path) -> tuple[Path, str]:
    """A run config file and an MLflow run id in its store."""
    config = tmp / "run.yaml"
    config.write_text(yaml.safe_dump({"tracking": {"dir": str(tmp / "mlflow"), "experiment_name": "ui-auth"}}))
    cfg = RunConfig(tracking={"dir": tmp / "mlflow", "experiment_name": "ui-auth", "log_system_metrics": False})
    run_id, _ = tracking.start_run(cfg, "flow-ui-auth", run_name="ui-auth-run")
    tracking.end_run(cfg.tracking, run_id)
    return config, run_id


@pytest.fixture
def ui(tmp_path):
    """``grpo ui --mlflow`` started in ``tmp_path`` (its password file lands under it); yields
    ``(url, process, password file, run id)`` once ``/health`` answers."""
    config, run_id = _store(tmp_path)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "GRPO_UI_PASSWORD"}
    log = (tmp_path / "ui.log").open("wb")
    grpo = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "ui", "--mlflow", "--config", str(config), "--mlflow-port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            assert grpo.poll() is None, (tmp_path / "ui.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the MLflow UI never answered /health"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url, grpo, tmp_path / "runs" / "mlflow-ui" / f"ui-{port}.password", run_id
    finally:
        family = [psutil.Process(grpo.pid), *psutil.Process(grpo.pid).children(recursive=True)]
        grpo.send_signal(signal.SIGTERM)
        try:
            grpo.wait(timeout=60)
        finally:
            log.close()
        _, alive = psutil.wait_procs(family, timeout=15)
        for process in alive:
            process.kill()
        assert not alive, f"left running after SIGTERM: {[(p.pid, p.name()) for p in alive]}"


def test_the_mlflow_ui_answers_only_with_its_password(ui):
    url, grpo, password_file, run_id = ui
    get_run = ("GET", f"/ajax-api/2.0/mlflow/runs/get?run_id={run_id}", None)
    set_tag = ("POST", "/ajax-api/2.0/mlflow/runs/set-tag", {"run_id": run_id, "key": "owned", "value": "yes"})
    routes = [("GET", "/", None), get_run, set_tag, ("GET", "/get-artifact?path=x&run_uuid=" + run_id, None)]
    wrong = [
        {},
        {"Authorization": "Basic " + base64.b64encode(b"grpo:not-the-password").decode()},
        {"Authorization": "Bearer not-the-password"},
    ]
    if password_file.exists():  # (the previous code wrote none: its UI answered everything without a password)
        other = base64.b64encode(f"other:{password_file.read_text().strip()}".encode()).decode()
        wrong.append({"Authorization": f"Basic {other}"})
    for headers in wrong:
        for method, path, body in routes:
            answer = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert answer.status_code == 401, (method, path, headers, answer.status_code)
            assert answer.headers["www-authenticate"].startswith("Basic ")
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(password_file.parent.stat().st_mode) == 0o700
    password = password_file.read_text().strip()
    assert len(password) >= 40  # 256 random bits, URL-safe base64
    basic = httpx.BasicAuth("grpo", password)
    assert httpx.get(url + "/", auth=basic, timeout=30).status_code == 200
    got = httpx.get(url + get_run[1], auth=basic, timeout=30)
    assert got.status_code == 200 and got.json()["run"]["info"]["run_id"] == run_id
    bearer = {"Authorization": f"Bearer {password}"}
    assert httpx.post(url + set_tag[1], json=set_tag[2], headers=bearer, timeout=30).status_code == 200
    tags = httpx.get(url + get_run[1], auth=basic, timeout=30).json()["run"]["data"]["tags"]
    assert {"key": "owned", "value": "yes"} in tags  # the write went through to the store, with the password only

    # MLflow itself listens on no TCP port: the proxy's is the family's only TCP listener
    family = [psutil.Process(grpo.pid), *psutil.Process(grpo.pid).children(recursive=True)]
    listening = {
        (c.laddr.ip, c.laddr.port)
        for p in family
        for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }
    assert listening == {("127.0.0.1", int(url.rsplit(":", 1)[1]))}, listening
    sockets = [Path(c.laddr) for p in family for c in p.net_connections(kind="unix") if c.laddr]
    assert sockets and all(stat.S_IMODE(s.parent.stat().st_mode) == 0o700 for s in sockets), sockets
