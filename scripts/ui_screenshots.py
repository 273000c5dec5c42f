"""Take the docs' screenshots of the Prefect and MLflow UIs with headless Chromium (playwright).

``python scripts/ui_screenshots.py --out docs/`` starts a Prefect server and process worker on
loopback (a temporary home), registers the deployments from ``configs/tiny.yaml`` (completion
tables and the model registry on), starts two runs of ``grpo-train/demo`` at once (the second waits
for the ``gpu`` concurrency slot), waits for both, serves the MLflow UI with ``grpo ui --mlflow``, and
writes small PNGs: ``prefect-concurrency`` (taken while one run holds the slot), ``prefect-run-graph``,
``prefect-artifacts``, ``prefect-artifact-summary``, ``prefect-artifact-reward-curve``, ``mlflow-metrics``,
``mlflow-system-metrics``, ``mlflow-completions``, ``mlflow-registry``. Each is taken once its page shows
the text it is about and no loading indicator is left. Everything it started is stopped at the end
(``--reuse`` takes the pictures again from an earlier invocation's folder). Needs Debian's ``chromium``;
about five minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
VIEWPORT = {"width": 1280, "height": 760}


def _run_deployment(api: httpx.Client, name: str) -> str:
    deployment = api.get(f"/deployments/name/grpo-train/{name}").json()
    response = api.post(
        f"/deployments/{deployment['id']}/create_flow_run", json={"parameters": deployment["parameters"]}
    )
    response.raise_for_status()
    return response.json()["id"]


def _wait(api: httpx.Client, flow_run_id: str, timeout_s: float = 1200.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = api.get(f"/flow_runs/{flow_run_id}").json()
        if run["state_type"] in TERMINAL:
            return run
        time.sleep(2.0)
    raise TimeoutError(f"flow run {flow_run_id} did not finish")


def _shoot(
    page,
    url: str | None,
    out: Path,
    wait_text: str | None = None,
    settle_ms: int = 4000,
    wait_selector: str | None = None,
) -> None:
    """Open ``url`` (None: stay), wait until ``wait_text`` and ``wait_selector`` are visible and no loading
    indicator is left, then write the PNG."""
    if url is not None:
        page.goto(url, timeout=120_000)
    if wait_text:
        page.get_by_text(wait_text).filter(visible=True).first.wait_for(timeout=120_000)
    if wait_selector:
        page.locator(wait_selector).filter(visible=True).first.wait_for(timeout=120_000)
    _wait_loaded(page)
    page.wait_for_timeout(settle_ms)
    page.screenshot(path=str(out))
    _shrink(out)
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")


LOADING = "[class*='skeleton' i], [class*='spinner' i], [class*='loading' i], [aria-busy='true'], [role='progressbar']"


def _wait_loaded(page, timeout_s: float = 120.0) -> None:
    """Wait until no loading placeholder (skeleton, spinner, busy element) is visible."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if page.locator(LOADING).filter(visible=True).count() == 0:
            return
        page.wait_for_timeout(500)
    raise TimeoutError(f"{page.url} still shows a loading indicator after {timeout_s} s")


def _shrink(png: Path) -> None:
    """Quantise to 128 colours: UI screenshots stay readable at a fraction of the size."""
    from PIL import Image

    with Image.open(png) as img:
        img.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(png, optimize=True)


def prefect_shots(page, api: httpx.Client, ui: str, flow_run_id: str, out: Path) -> None:
    """Run graph and Artifacts tab of a finished run; its summary table and reward curve artifacts."""
    _shoot(page, f"{ui}/runs/flow-run/{flow_run_id}", out / "prefect-run-graph.png", "rollout", 8000)
    tab = page.get_by_text("Artifacts", exact=True).filter(visible=True).first
    tab.click(timeout=120_000)
    # The tab's content sits below the run graph and its cards render once in view: bring the tab bar to the top.
    page.wait_for_timeout(2000)
    tab.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.set_viewport_size({"width": VIEWPORT["width"], "height": 1120})  # the four cards below the graph
    _shoot(page, None, out / "prefect-artifacts.png", "grpo-progress")
    page.set_viewport_size(VIEWPORT)
    artifacts = api.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}).json()
    ids = {a["key"]: a["id"] for a in artifacts}
    _shoot(
        page, f"{ui}/artifacts/artifact/{ids['grpo-summary']}", out / "prefect-artifact-summary.png", "optimizer steps"
    )
    _shoot(
        page,
        f"{ui}/artifacts/artifact/{ids['grpo-reward-curve']}",
        out / "prefect-artifact-reward-curve.png",
        "Reward per optimizer step",
        wait_selector="img[alt='reward curve']",
    )


# MLflow 3's UI opens in its GenAI view with an assistant panel on first load; a training run is read in its
# "Model training" view (the toggle at the top left, kept in the browser's local storage).
MLFLOW_UI_STORAGE = {
    "mlflow.workflowType_v1": '"machine_learning"',
    "mlflow.assistant.panelOpen_v1": "false",
    "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
}


def mlflow_shots(page, ui: str, experiment: str, run_id: str, model: str, table: str, out: Path) -> None:
    """Metrics (reward, loss, entropy), system metrics, a completion table, the registered model's versions."""
    page.add_init_script("".join(f"localStorage.setItem({k!r}, {v!r});" for k, v in MLFLOW_UI_STORAGE.items()))
    base = f"{ui}/#/experiments/{experiment}/runs/{run_id}"
    page.goto(f"{base}/model-metrics", timeout=120_000)
    # The chart search takes a regular expression: the run's headline curves, side by side.
    page.get_by_placeholder("Search metric charts").fill("^(reward|loss|entropy)$", timeout=120_000)
    _shoot(page, None, out / "mlflow-metrics.png", "reward", 6000, wait_selector=".js-plotly-plot")
    _shoot(
        page,
        f"{base}/system-metrics",
        out / "mlflow-system-metrics.png",
        "cpu_utilization",
        6000,
        wait_selector=".js-plotly-plot",
    )
    _shoot(page, f"{base}/artifacts/{table}", out / "mlflow-completions.png", "advantage")
    _shoot(page, f"{ui}/#/models/{model}", out / "mlflow-registry.png", "candidate")


def main() -> int:
    """Entry point; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    p.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    p.add_argument("--reuse", type=Path, help="folder of an earlier invocation: screenshot its runs, start none")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    from flows.serve import PrefectStack
    from grpo_core import tracking
    from grpo_core.config import TrackingConfig
    from grpo_core.run.children import free_port, start_child, stop_child

    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.reuse or Path(tempfile.mkdtemp(prefix="grpo-shots-"))
    print(f"runs, stores and Prefect home in {tmp} (--reuse {tmp} screenshots them again)")
    model = "grpo-tiny"
    overrides = [
        f"train.output_dir={tmp / 'runs'}",
        f"tracking.dir={tmp / 'mlflow'}",
        "tracking.log_completions=true",
        f"tracking.registered_model_name={model}",
        "tracking.system_metrics_interval_s=2",
        "rollout.dataset_size=256",
    ]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with (
        PrefectStack(port=0, home=tmp / "prefect", extra_env=env) as stack,
        sync_playwright() as pw,
        httpx.Client(base_url=stack.api_url, timeout=30, headers=stack.auth_headers()) as api,
    ):
        browser = pw.chromium.launch(executable_path=args.chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport=VIEWPORT)
        page.add_init_script(stack.ui_login_script())  # the UI's API calls carry the stack's auth string
        if args.reuse:
            done = api.post("/flow_runs/filter", json={"sort": "START_TIME_ASC"}).json()
            first, second = [r["id"] for r in done if r["state_type"] == "COMPLETED"][-2:]
        else:
            stack.register(ROOT / "configs" / "tiny.yaml", overrides=overrides)
            first, second = _run_deployment(api, "demo"), _run_deployment(api, "demo")
            _wait_slot_held(api)  # one run holds the gpu slot, the other waits for it
            _shoot(page, f"{stack.ui_url}/concurrency-limits?tab=Global", args.out / "prefect-concurrency.png", "gpu")
        runs = [_wait(api, first), _wait(api, second)]
        assert all(r["state_type"] == "COMPLETED" for r in runs), [r["state"]["message"] for r in runs]
        prefect_shots(page, api, stack.ui_url, second, args.out)
        tc = TrackingConfig(dir=tmp / "mlflow", experiment_name="grpo-tiny")
        run_id = tracking.find_run(tc, second)
        mc = tracking.client(tc)
        experiment = mc.get_run(run_id).info.experiment_id
        table = next(a.path for a in mc.list_artifacts(run_id, "completions") if a.path.endswith(".json"))
        port = free_port()
        ui = start_child(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "ui",
                "--mlflow",
                "--mlflow-port",
                str(port),
                "--config",
                str(_tracking_config(tmp)),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            _wait_http(f"http://127.0.0.1:{port}/health")
            mlflow_shots(page, f"http://127.0.0.1:{port}", experiment, run_id, model, table, args.out)
        finally:
            ui.send_signal(signal.SIGTERM)
            ui.wait(timeout=60)
            stop_child(ui, timeout_s=15)
        browser.close()
    return 0


def _wait_slot_held(api: httpx.Client, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and api.get("/v2/concurrency_limits/gpu").json()["active_slots"] < 1:
        time.sleep(2.0)


def _tracking_config(tmp: Path) -> Path:
    path = tmp / "ui.yaml"
    path.write_text(f"tracking:\n  dir: {tmp / 'mlflow'}\n  experiment_name: grpo-tiny\n")
    return path


def _wait_http(url: str, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(url)


if __name__ == "__main__":
    raise SystemExit(main())
