"""End to end: a real Prefect server and process workers on loopback, the real MLflow SQLite store.

The stack is the session's (``flow_helpers.stack``, shared with test_server_deployment: the server takes ~30 s to
start). The deployments are registered from ``configs/tiny.yaml`` (a random tiny Qwen3 on the embedded server, a
few steps) with a reward that varies on a random model (``flow_helpers:varied_reward``, importable through PYTHONPATH).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
from flow_helpers import CRON, ROOT, Api, assert_mlflow_steps_once, mlflow_run, with_changes
from trainer_helpers import assert_each_step_and_prompt_once, kill_all, process_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # flow runs on the shared Prefect stack


def test_nightly_deployment_has_its_schedule(api):
    deployment = api.deployment("nightly-retrain")
    crons = [s["schedule"].get("cron") for s in deployment["schedules"]]
    assert crons == [CRON]
    assert deployment["work_pool_name"] == "grpo-process"
    assert deployment["parameters"]["config"]["model"]["name"] == "tiny-qwen3"


def test_bad_parameter_is_refused_naming_the_field(api):
    params = with_changes(api.deployment("demo")["parameters"], rollout={"num_generations": 1})
    response = api.run_deployment("demo", params)
    assert response.status_code in (409, 422), response.text
    assert "num_generations" in response.text


def test_missing_dataset_column_fails_fast_without_a_server(api, stack_tmp):
    rows = stack_tmp / "no_prompt.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(4)))
    params = with_changes(api.deployment("demo")["parameters"], rollout={"dataset": f"json:{rows}"})
    start = time.monotonic()
    run = api.wait(api.run_deployment("demo", params, retries=0).json()["id"], timeout_s=240)
    assert run["state_type"] == "FAILED"
    assert "'prompt' column" in run["state"]["message"] + api.logs(run["id"])
    run_dir = Path(params["config"]["train"]["output_dir"]) / run["id"]
    assert not (run_dir / "servers").exists(), "a server was started for an invalid config"
    assert time.monotonic() - start < 200


def test_a_parameter_naming_code_outside_the_allow_list_runs_nothing(api, stack_tmp):
    """The issue's example: a flow run whose dataset is ``subprocess:getoutput`` with a shell command fails in
    ``prepare`` naming GRPO_ALLOWED_MODULES; the command never ran and no server started."""
    marker = stack_tmp / "shell-command-ran"
    params = with_changes(
        api.deployment("demo")["parameters"],
        rollout={"dataset": "subprocess:getoutput", "dataset_kwargs": {"cmd": f"touch {marker}"}},
    )
    run = api.wait(api.run_deployment("demo", params, retries=0).json()["id"], timeout_s=240)
    assert run["state_type"] == "FAILED"
    text = run["state"]["message"] + api.logs(run["id"])
    assert "GRPO_ALLOWED_MODULES" in text and "rollout.dataset='subprocess:getoutput'" in text
    assert not marker.exists()
    assert not (Path(params["config"]["train"]["output_dir"]) / run["id"]).exists(), "prepare went past the check"


@pytest.fixture(scope="module")
def two_runs(api, stack_tmp):
    """Two runs of grpo-train/demo started at once (as the nightly schedule and a UI run would), registering
    their models and logging completion tables; 3 steps, a checkpoint after step 2. (Module-scoped: the tests of
    a tracked run, of the GPU limit, of the task spans, of the artifacts and of the registry all read them.)"""
    params = with_changes(
        api.deployment("demo")["parameters"],
        train={"max_steps": 3, "save_steps": 2},
        tracking={
            "registered_model_name": "grpo-tiny",
            "log_completions": True,
            "num_completions_to_print": 3,
            "system_metrics_interval_s": 2,
        },
    )
    ids = [api.run_deployment("demo", params).json()["id"] for _ in range(2)]
    runs = [api.wait(i, timeout_s=900) for i in ids]
    for run in runs:
        assert run["state_type"] == "COMPLETED", run["state"]["message"] + "\n" + api.logs(run["id"])[-3000:]
    return runs


def test_deployment_run_completes_and_is_tracked(two_runs, api, stack_tmp):
    run = two_runs[0]
    mc, run_id = mlflow_run(stack_tmp / "mlflow", run["id"])
    mlrun = mc.get_run(run_id)
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.params["train.max_steps"] == "3"
    assert mlrun.data.tags["grpo.deployment"] == "demo"
    steps = [m.step for m in mc.get_metric_history(run_id, "loss")]
    assert steps == [1, 2, 3]
    assert "reward" in mlrun.data.metrics
    top = {a.path for a in mc.list_artifacts(run_id)}
    assert {"checkpoints", "resume", "config"} <= top
    checkpoint = {a.path.rsplit("/", 1)[-1] for a in mc.list_artifacts(run_id, "checkpoints/step-0000002")}
    assert {"dcp", "rollout_state.json"} <= checkpoint
    assert [a.path for a in mc.list_artifacts(run_id, "resume")] == ["resume/rollout_state.json"]
    logs = api.logs(run["id"])
    assert "[trainer]" in logs and "[rollout]" in logs and "[server 0]" in logs


def _wait_for_step(metrics: Path, step: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.exists():
            steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]
            if steps and steps[-1] >= step:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{metrics} never reached step {step}")


def test_killed_trainer_resumes_on_retry_without_duplicates(api, stack_tmp):
    # max_staleness above the run's length: no sample is dropped as stale, so every prompt gets trained.
    params = with_changes(
        api.deployment("demo")["parameters"], train={"max_steps": 6, "save_steps": 2}, rollout={"max_staleness": 10}
    )
    flow_run_id = api.run_deployment("demo", params).json()["id"]
    run_dir = Path(params["config"]["train"]["output_dir"]) / flow_run_id
    _wait_for_step(run_dir / "metrics.jsonl", 3)
    procs = process_tree(int((run_dir / "trainer.pid").read_text()))  # torchrun and its rank (own session)
    assert len(procs) >= 2, [p.cmdline() for p in procs]
    kill_all(procs)  # hard; asserts every one of them died
    killed_at = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    run = api.wait(flow_run_id)
    assert run["state_type"] == "COMPLETED", run["state"]["message"] + "\n" + api.logs(flow_run_id)[-3000:]
    assert run["run_count"] == 2, "the flow run should have been retried once"
    assert killed_at < 6
    resumed = re.findall(r"resuming from checkpoint \S*step-(\d+)", api.logs(flow_run_id))
    assert resumed and 0 < int(resumed[-1]) <= killed_at, resumed  # a mid-run checkpoint, not the final one
    assert_each_step_and_prompt_once(run_dir, 6)
    mc, run_id = mlflow_run(stack_tmp / "mlflow", flow_run_id)
    assert_mlflow_steps_once(mc, run_id, run_dir / "metrics.jsonl", 6)
    assert mc.get_run(run_id).info.status == "FINISHED"


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Debian's chromium is not installed (make test installs it)")
    return path


def _submit_run_form(page, api, deployment_id: str, before: set[str], timeout_s: float = 180.0) -> str:
    """Press Run in the parameter form (prefilled from the deployment) once it shows, until the run exists.

    The form can take a while to render on a loaded machine, and some UI versions start the
    run straight from Quick run; either way a new flow run of the deployment appears. A click that
    started nothing within 20 s (seen once in CI: the form took the click before it was ready) is
    made again, reopening the form if it closed.
    """
    deadline, clicked = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        new = set(api.flow_run_ids(deployment_id)) - before
        if new:
            return sorted(new, key=lambda i: api.flow_run(i)["created"])[0]
        if clicked is None or time.monotonic() - clicked > 20:
            button = page.get_by_role("dialog").get_by_role("button", name="Run", exact=True)
            if button.count() and button.first.is_visible():
                button.first.click()
                clicked = time.monotonic()
            elif clicked is not None:  # the form closed and nothing started: open it again
                page.get_by_role("button", name="Run", exact=True).first.click(timeout=60_000)
                page.get_by_text("Quick run").first.click(timeout=60_000)
                clicked = None
        page.wait_for_timeout(500)
    raise TimeoutError(f"the Run form of deployment {deployment_id} never started a flow run")


def test_browser_starts_the_demo_deployment_and_sees_it_complete(api, stack):
    from playwright.sync_api import expect, sync_playwright

    deployment = api.deployment("demo")
    before = set(api.flow_run_ids(deployment["id"]))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.add_init_script(stack.ui_login_script())  # the UI's API calls carry the stack's auth string
        page.goto(f"{stack.ui_url}/deployments/deployment/{deployment['id']}")
        page.get_by_role("button", name="Run", exact=True).first.click(timeout=60_000)
        page.get_by_text("Quick run").first.click(timeout=60_000)
        flow_run_id = _submit_run_form(page, api, deployment["id"], before)
        run = api.wait(flow_run_id)
        page.goto(f"{stack.ui_url}/runs/flow-run/{flow_run_id}")
        expect(page.get_by_text(run["name"]).first).to_be_visible(timeout=60_000)
        expect(page.get_by_text("Completed", exact=True).first).to_be_visible(timeout=60_000)
        browser.close()
    assert run["state_type"] == "COMPLETED", run["state"]["message"]
    for other in set(api.flow_run_ids(deployment["id"])) - before - {flow_run_id}:  # a repeated click's run
        api.wait(other)


def test_rollout_task_fails_when_the_rollout_process_fails(api):
    # A reward of +inf makes the rollout process exit with an error on its first group: the rollout task's
    # state follows the process (Failed, with the process's error), and so does the flow run.
    params = with_changes(
        api.deployment("demo")["parameters"], rollout={"reward_functions": ["flow_helpers:infinite_reward"]}
    )
    run = api.wait(api.run_deployment("demo", params, retries=0).json()["id"], timeout_s=600)
    assert run["state_type"] == "FAILED", run["state"]["message"]
    assert run["run_count"] == 1, "one attempt (no flow retry asked): the task states are that attempt's"
    rollout = _task_runs(api, run["id"])["rollout"]
    assert rollout["state_type"] == "FAILED", rollout["state"]
    # Before: Cancelled, because the failed process lingers until the flow stops it after the trainer's failure.
    assert "rollout process failed" in rollout["state"]["message"] and "inf" in rollout["state"]["message"]


def test_work_pool_and_gpu_limit_are_created_through_the_client(api, stack):
    pool = api.http.get("/work_pools/grpo-process").json()
    assert pool["type"] == "process"
    limit = api.http.get("/v2/concurrency_limits/gpu").json()
    assert limit["limit"] == 1 and limit["active"]  # no GPU here: one slot
    stack.ensure_pool()  # idempotent: the second call keeps the pool
    assert api.http.get("/work_pools/grpo-process").json()["id"] == pool["id"]


def _task_runs(api: Api, flow_run_id: str) -> dict[str, dict]:
    response = api.http.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run_id]}}})
    response.raise_for_status()
    return {t["name"].rsplit("-", 1)[0]: t for t in response.json()}


def _parse_time(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def test_gpu_limit_serialises_two_simultaneous_runs(api, two_runs):
    spans = []
    for run in two_runs:
        tasks = _task_runs(api, run["id"])
        spans.append((_parse_time(tasks["provision_servers"]["start_time"]), _parse_time(tasks["train"]["end_time"])))
    (first_start, first_end), (second_start, second_end) = sorted(spans)
    assert second_start >= first_end, f"the runs held GPUs at the same time: {spans}"
    logs = "\n".join(api.logs(run["id"]) for run in two_runs)
    assert "waiting for 1 slot(s) of the global concurrency limit 'gpu'" in logs


_SLOT_PROBE = """
import json, logging, sys, threading, time
from prefect import flow
from prefect.concurrency.sync import concurrency
from flows.grpo_train import gpu_slots
from grpo_core.config import RunConfig

events, said_waiting = [], threading.Event()
class Record(logging.Handler):
    def emit(self, record):
        events.append((time.time(), record.getMessage()))
        if record.getMessage().startswith("waiting for"):
            said_waiting.set()
logging.getLogger("prefect.flow_runs").addHandler(Record())

@flow
def take(tag: str, hold_s: float = 1.5):
    events.append((time.time(), "asking " + tag))
    with gpu_slots(RunConfig()):
        events.append((time.time(), "inside " + tag))
        time.sleep(hold_s)
    events.append((time.time(), "left " + tag))

def phase(fn):
    events.clear()
    fn()
    # "slot(s) of the global": a flow run's random name ("Beginning flow run 'slothful-...'") says "slot" too
    ours = ("asking", "inside", "left", "released")
    return [(t, m) for t, m in events if "slot(s) of the global" in m or m.startswith(ours)]

def held():
    holding = threading.Event()
    def holder():  # holds the slot until the run has said it waits (at most 120 s)
        with concurrency("gpu", occupy=1, strict=True):
            holding.set()
            said_waiting.wait(120)
        events.append((time.time(), "released"))
    t = threading.Thread(target=holder); t.start(); holding.wait(120); take("a"); t.join()

if sys.argv[1] == "alone":
    print(json.dumps({"free": phase(lambda: take("a")), "held": phase(held)}))
else:  # one of two processes asking at the same moment (argv: tag, a folder where both say they are ready)
    import pathlib
    ready = pathlib.Path(sys.argv[2])
    (ready / sys.argv[1]).touch()
    deadline = time.time() + 240
    while len(list(ready.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.02)
    print(json.dumps(phase(lambda: take(sys.argv[1], hold_s=8))))
"""


def test_a_run_says_it_waits_for_the_gpu_limit_exactly_when_the_server_refuses_its_slots(stack, tmp_path):
    """The stack's ``gpu`` limit has 1 slot. A run that finds it free holds it without a waiting line; a run that
    finds it held says it waits (before the holder lets go) and enters only after; of two runs (processes) asking at
    the same moment, the one refused says so (the line came from a read of the limit made before asking: both read
    it free, and the second then waited silently -- CI of 859ddf8)."""
    import subprocess
    import sys

    def probe(*args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", _SLOT_PROBE, *args],
            env=stack.env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def result(process: subprocess.Popen):
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    waiting = "waiting for 1 slot(s) of the global concurrency limit 'gpu' (1 of 1 in use)"
    holding = "holding 1 slot(s) of the global concurrency limit 'gpu'"
    phases = result(probe("alone"))
    assert [m for _, m in phases["free"]] == ["asking a", holding, "inside a", "left a"], phases["free"]
    when = {m: t for t, m in phases["held"]}
    assert [m for _, m in phases["held"]] == ["asking a", waiting, "released", holding, "inside a", "left a"], phases[
        "held"
    ]
    assert when[waiting] < when["released"] <= when[holding]

    ready = tmp_path / "ready"  # each probe, its imports done, waits there for the other
    ready.mkdir()
    runs = [result(process) for process in [probe("a", str(ready)), probe("b", str(ready))]]
    first, second = sorted(
        (({m.split()[0]: t for t, m in events}, [m for _, m in events]) for events in runs),
        key=lambda run: run[0]["inside"],
    )
    assert second[0]["asking"] < first[0]["left"], f"the runs did not ask at the same time: {first}, {second}"
    assert second[0]["inside"] >= first[0]["left"], f"both runs held the slot at once: {first}, {second}"
    assert [m.split()[0] for m in first[1]] == ["asking", "holding", "inside", "left"], first
    assert second[1][1:3] == [waiting, holding], second


def test_rollout_task_runs_beside_train_for_the_whole_run(api, two_runs):
    run = two_runs[0]
    tasks = _task_runs(api, run["id"])
    rollout, train = tasks["rollout"], tasks["train"]
    assert rollout["state_type"] == "COMPLETED" and train["state_type"] == "COMPLETED"
    # The train task starts first: the trainer loads and compiles while the servers start (issue 25, item 6); the
    # rollout task starts once they are healthy, and its process lives until the trainer, done training, shuts it
    # down just before exiting.
    assert _parse_time(train["start_time"]) <= _parse_time(rollout["start_time"])
    metrics = Path(run["parameters"]["config"]["train"]["output_dir"]) / run["id"] / "metrics.jsonl"
    assert _parse_time(rollout["end_time"]) >= metrics.stat().st_mtime, "the rollout task ended before training did"
    assert _parse_time(rollout["end_time"]) <= _parse_time(train["end_time"]) + 5


def test_flow_run_publishes_artifacts(api, two_runs, stack_tmp):
    run = two_runs[1]
    response = api.http.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    response.raise_for_status()
    by_key = {a["key"]: a for a in response.json()}
    assert {"grpo-mlflow-run", "grpo-progress", "grpo-summary", "grpo-reward-curve"} <= set(by_key)
    _, mlflow_run_id = mlflow_run(stack_tmp / "mlflow", run["id"])
    assert by_key["grpo-mlflow-run"]["type"] == "markdown" and mlflow_run_id in by_key["grpo-mlflow-run"]["data"]
    assert by_key["grpo-progress"]["type"] == "progress" and by_key["grpo-progress"]["data"] == 100.0
    summary = {row["quantity"]: row["value"] for row in json.loads(by_key["grpo-summary"]["data"])}
    assert summary["optimizer steps"] == "3" and summary["MLflow run id"] == mlflow_run_id
    assert "data:image/png;base64," in by_key["grpo-reward-curve"]["data"]


def test_runs_register_model_versions_and_log_tables_and_system_metrics(two_runs, stack_tmp):
    from transformers import AutoModelForCausalLM

    mc, first = mlflow_run(stack_tmp / "mlflow", two_runs[0]["id"])
    _, second = mlflow_run(stack_tmp / "mlflow", two_runs[1]["id"])
    versions = {v.run_id: int(v.version) for v in mc.search_model_versions("name='grpo-tiny'")}
    assert set(versions) == {first, second}
    newest = max(versions, key=versions.get)
    assert mc.get_model_version_by_alias("grpo-tiny", "candidate").run_id == newest
    tables = [a.path for a in mc.list_artifacts(second, "completions")]
    assert tables and all(t.endswith(".json") for t in tables)
    table = mc.load_table(mc.get_run(second).info.experiment_id, tables[0], run_ids=[second])
    assert {"step", "prompt", "completion", "reward", "advantage"} <= set(table.columns)
    # one table holds COMPLETION_TABLE_STEPS (10) steps: each logged window adds at most num_completions_to_print (3)
    # rows of its step, and how many of the 3 steps' windows had completions to show depends on the rollout's timing
    per_step = table.groupby("step").size()
    assert len(table) >= 1 and set(per_step.index) <= {1, 2, 3} and (per_step <= 3).all(), per_step
    assert "system/cpu_utilization_percentage" in mc.get_run(second).data.metrics
    import mlflow

    path = mlflow.artifacts.download_artifacts("models:/grpo-tiny@candidate", dst_path=str(stack_tmp / "candidate"))
    assert AutoModelForCausalLM.from_pretrained(path).config.model_type == "qwen3"
    assert (Path(path) / "README.md").read_text().count("grpo") >= 1


def test_provision_retries_only_server_start_failures(stack, stack_tmp, monkeypatch):
    import socket

    from prefect import flow
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.grpo_train import RESOLVED_CONFIG, _stop, provision_servers
    from grpo_core.config import load_config
    from grpo_core.errors import PortInUseError
    from grpo_core.serving import launch

    def run_dir_for(name: str, overrides: list[str]) -> str:
        cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides)
        root = stack_tmp / name
        root.mkdir()
        cfg.train.output_dir, cfg.server.log_dir = root, root / "servers"
        (root / RESOLVED_CONFIG).write_text(cfg.model_dump_json())
        return str(root)

    @flow(name="provision-only")
    def provision_only(run_dir: str) -> list[str]:
        return provision_servers.with_options(retries=1, retry_delay_seconds=1)(run_dir)

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    busy = run_dir_for("busy-port", [f"server.port={port}"])
    real_check, refusals = launch.check_port_free, []

    def check_then_free(host: str, port_: int, field_name: str = "server.port") -> None:
        try:
            real_check(host, port_, field_name)
        except PortInUseError as exc:  # the first attempt finds the port taken: free it for the retry
            refusals.append(str(exc))
            holder.close()
            raise

    monkeypatch.setattr(launch, "check_port_free", check_then_free)
    with temporary_settings({PREFECT_API_URL: stack.api_url, PREFECT_API_AUTH_STRING: stack.auth_string}):
        try:
            urls = provision_only(busy)
        finally:
            _stop(busy)
        bad = run_dir_for("no-vllm", ["server.backend=vllm"])
        state = provision_only(bad, return_state=True)
    assert len(refusals) == 1 and "server.port" in refusals[0]
    assert urls == [f"http://127.0.0.1:{port}"]
    assert state.is_failed() and "vllm is not installed" in str(state.result(raise_on_failure=False))
    api, deadline = Api(stack.api_url, stack.auth_headers()), time.monotonic() + 120
    while True:  # task-run states reach the API as events, a moment after the flow returned
        counts = {}
        for run in api.http.post("/flow_runs/filter", json={"flows": {"name": {"any_": ["provision-only"]}}}).json():
            for task_run in api.http.post(
                "/task_runs/filter", json={"flow_runs": {"id": {"any_": [run["id"]]}}}
            ).json():
                if task_run["state_type"] in ("COMPLETED", "FAILED"):
                    counts[run["parameters"]["run_dir"]] = task_run["run_count"]
        if counts == {busy: 2, bad: 1} or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert counts == {busy: 2, bad: 1}, counts  # retried after the start failure only


def test_the_prefect_stack_requires_its_auth_string(stack):
    """Issue 11: the local Prefect server (grpo deploy) answers only its clients; a request without the auth
    string gets 401 and creates nothing."""
    import httpx

    assert (
        stack.processes[0].poll() is None and len(stack.processes) == 3
    )  # the server and the workers of both pools run
    version = f"{stack.api_url}/admin/version"
    before = httpx.post(f"{stack.api_url}/work_pools/filter", headers=stack.auth_headers()).json()
    refused = [
        httpx.get(version),
        httpx.get(version, headers={"Authorization": "Basic Z3JwbzpndWVzcw=="}),
        httpx.post(f"{stack.api_url}/work_pools/", json={"name": "intruder", "type": "process"}),
    ]
    assert [r.status_code for r in refused] == [401, 401, 401]
    after = httpx.post(f"{stack.api_url}/work_pools/filter", headers=stack.auth_headers()).json()
    assert [p["name"] for p in after] == [p["name"] for p in before] and "intruder" not in str(after)
    assert httpx.get(version, headers=stack.auth_headers()).status_code == 200
    assert httpx.get(f"{stack.api_url}/health").status_code == 200
    assert stack.auth_file.stat().st_mode & 0o777 == 0o600
    assert stack.auth_file.read_text().strip() == stack.auth_string
    logs = "".join((stack.home / name).read_text(errors="replace") for name in ("server.log", "worker.log"))
    assert stack.auth_string.split(":", 1)[1] not in logs
