"""``grpo ui --mlflow`` as the README starts it: the MLflow UI serves a run's metrics page (seen in a headless
browser given the UI's password), and SIGTERM to ``grpo`` leaves no process behind (server, uvicorn worker,
job-runner consumers)."""

from __future__ import annotations

import os
import shutil
import signal
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
from grpo_core.tracking.metrics import JsonlSink

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Debian's chromium is not installed (make test installs it)")
    return path


def _tracked_run(tmp: Path) -> tuple[Path, str, str]:
    """A run config file and an MLflow run with a ``reward`` curve in its SQLite store."""
    config = tmp / "run.yaml"
    config.write_text(yaml.safe_dump({"tracking": {"dir": str(tmp / "mlflow"), "experiment_name": "ui-test"}}))
    cfg = RunConfig(tracking={"dir": tmp / "mlflow", "experiment_name": "ui-test", "log_system_metrics": False})
    run_id, _ = tracking.start_run(cfg, "flow-ui", run_name="ui-test-run")
    sink = tracking.MlflowSink(cfg.tracking, run_id, inner=JsonlSink(tmp / "metrics.jsonl"))
    for step in range(1, 6):
        sink.log(step, {"reward": 0.1 * step, "loss": 1.0 / step})
    sink.close()
    tracking.end_run(cfg.tracking, run_id)
    experiment = tracking.client(cfg.tracking).get_run(run_id).info.experiment_id
    return config, experiment, run_id


def _wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"grpo ui exited with {process.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the MLflow UI at {url} never answered /health")


def test_mlflow_ui_serves_the_run_metrics_and_stops_with_nothing_left(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    chromium = _chromium()
    config, experiment, run_id = _tracked_run(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "ui.log").open("wb")
    grpo = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "ui", "--mlflow", "--config", str(config), "--mlflow-port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "GRPO_UI_PASSWORD": "ui-test-password"},
    )
    try:
        _wait_healthy(url, grpo)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
            page = browser.new_page(  # the UI is behind its password (basic auth, user grpo)
                viewport={"width": 1400, "height": 900},
                http_credentials={"username": "grpo", "password": "ui-test-password"},
            )
            page.goto(f"{url}/#/experiments/{experiment}/runs/{run_id}/model-metrics", timeout=120_000)
            expect(page.get_by_text("reward", exact=True).first).to_be_visible(timeout=120_000)
            expect(page.get_by_text("ui-test-run").first).to_be_visible(timeout=60_000)
            browser.close()
        family = [psutil.Process(grpo.pid), *psutil.Process(grpo.pid).children(recursive=True)]
        assert len(family) >= 3, "expected grpo, the mlflow server and its workers"
    finally:
        grpo.send_signal(signal.SIGTERM)
        try:
            grpo.wait(timeout=60)
        finally:
            log.close()
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, f"left running after SIGTERM: {[(p.pid, p.name()) for p in alive]}"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)
