"""Replicas started by the ``grpo-servers`` deployment on a second work pool (issue 13 step 3).

A real Prefect server with two process work pools, each with its own worker (the session's stack,
``flow_helpers.stack``, shared with test_flow_e2e): ``grpo-process`` runs the ``grpo-train`` flow run,
``grpo-gpu`` (``server.work_pool``) runs the ``grpo-servers`` flow run that
``server.deployment`` names, which starts the 2 embedded replicas. The test checks where the replicas ran
(descendants of the servers' worker, owned by the process Prefect records as that flow run's
infrastructure, listening on the ports the flow run published), that the train run completed, and that after
it no replica is left and the servers' run is final.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from flow_helpers import ROOT, SERVERS_POOL, Api, tiny_overrides, with_changes

from grpo_core.config import RunConfig

EMBEDDED = "grpo_core.serving.embedded"


def test_deployment_name_and_urls_are_checked_at_load():
    with pytest.raises(ValueError, match="server.deployment"):
        RunConfig.model_validate({"server": {"deployment": "no-slash"}})
    with pytest.raises(ValueError, match="server.deployment .* server.urls"):
        RunConfig.model_validate({"server": {"deployment": "grpo-servers/gpu", "urls": ["http://gpu-1:8000"]}})


def _embedded_under(pid: int) -> list:
    import psutil
    from trainer_helpers import process_tree

    out = []
    for p in process_tree(pid):
        try:
            if EMBEDDED in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _listening(process) -> set[int]:
    import psutil

    try:
        return {c.laddr.port for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    except psutil.NoSuchProcess:
        return set()


def _servers_runs(api: Api, train_run_id: str) -> list[dict]:
    response = api.http.post(
        "/flow_runs/filter", json={"flow_runs": {"tags": {"all_": [f"grpo-train-run:{train_run_id}"]}}}
    )
    response.raise_for_status()
    return response.json()


@pytest.mark.slow  # flow runs on the shared Prefect stack
@pytest.mark.timeout(1200)
def test_replicas_run_in_the_servers_flow_run_on_the_second_pool(stack, api):
    import psutil

    deployment = api.http.get("/deployments/name/grpo-servers/gpu").json()
    assert deployment["work_pool_name"] == SERVERS_POOL
    gpu_worker, train_worker = stack.workers[SERVERS_POOL], stack.workers[stack.pool]
    params = with_changes(
        api.deployment("demo")["parameters"],
        train={"max_steps": 2, "save_steps": 2},
        server={"deployment": "grpo-servers/gpu", "num_replicas": 2},
    )
    response = api.run_deployment("demo", params)
    assert response.status_code in (200, 201), response.text
    train_id = response.json()["id"]
    replicas, deadline = [], time.monotonic() + 240
    while len(replicas) < 2 and time.monotonic() < deadline:  # the replicas serve while the run trains
        replicas = _embedded_under(gpu_worker.pid)
        assert not _embedded_under(train_worker.pid), "a replica runs under the train flow's worker"
        if api.flow_run(train_id)["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            break
        time.sleep(0.3)
    servers = _servers_runs(api, train_id)
    assert len(replicas) == 2, (
        f"found {len(replicas)} replica processes under the servers' worker; train run "
        f"{api.flow_run(train_id)['state']}\n{api.logs(train_id)[-3000:]}\nservers' runs "
        + "\n".join(f"{r['state']}\n{api.logs(r['id'])[-2000:]}" for r in servers)
    )
    assert len(servers) == 1, servers
    server_run = api.flow_run(servers[0]["id"])
    infra_pid = int(str(server_run["infrastructure_pid"]).rsplit(":", 1)[-1])
    infra = psutil.Process(infra_pid)  # the servers' flow-run process, as its worker recorded it
    ports = set()
    for p in replicas:
        owner = p.environ()["GRPO_OWNER"].split(":")[0]  # grpo_core.run.lifeline: the process that launched it
        assert int(owner) == infra_pid, (owner, infra_pid)
        assert infra_pid in {a.pid for a in p.parents()}
        assert gpu_worker.pid in {a.pid for a in p.parents()}
    published, deadline = [], time.monotonic() + 120
    while not published and time.monotonic() < deadline:  # published once both answer /health
        published = api.http.post(
            "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [server_run["id"]]}}}
        ).json()
        time.sleep(0.3)
    urls = [row["url"] for row in json.loads(published[0]["data"])]
    for p in replicas:  # each listens on a published port (the ports are bound before the URLs are published)
        ports |= {c.laddr.port for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    assert {int(u.rsplit(":", 1)[1]) for u in urls} == ports, (urls, ports)

    run = api.wait(train_id, timeout_s=400)
    assert run["state_type"] == "COMPLETED", run["state"]["message"] + "\n" + api.logs(train_id)[-3000:]
    for p in replicas:  # gone when the train run ends (reaped: its launcher is gone too)
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE, p
    assert not _embedded_under(gpu_worker.pid)
    try:
        infra.wait(timeout=60)  # the servers' flow-run process exits once its run is final
    except psutil.NoSuchProcess:
        pass
    assert api.flow_run(server_run["id"])["state_type"] in ("CANCELLED", "COMPLETED")
    variables = api.http.post("/variables/filter", json={}).json()
    assert not [v for v in variables if v["name"].startswith("grpo-lifeline-")], "a lifeline variable is left"
    blocks = api.http.post("/block_documents/filter", json={}).json()
    assert not [b for b in blocks if (b.get("name") or "").startswith("grpo-run-credentials-")]


@pytest.mark.slow  # the shared Prefect stack: started for the slow tier only
def test_a_bad_deployment_name_fails_fast_naming_the_field(stack, api):
    """What the train flow's ``provision_servers`` calls: refused at once, before any flow run or secret exists."""
    import logging

    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.grpo_servers import ServerRun
    from grpo_core.errors import ConfigError

    cfg = RunConfig.model_validate({"server": {"deployment": "grpo-servers/nope"}})
    train_id = "00000000-0000-0000-0000-000000000013"
    run = ServerRun(cfg, train_id, "a-token", {}, logging.getLogger("test"))
    with (
        temporary_settings({PREFECT_API_URL: stack.api_url, PREFECT_API_AUTH_STRING: stack.auth_string}),
        pytest.raises(ConfigError, match=r"server.deployment='grpo-servers/nope': no such deployment"),
    ):
        run.start()
    assert _servers_runs(api, train_id) == []
    blocks = api.http.post("/block_documents/filter", json={}).json()
    assert not [b for b in blocks if (b.get("name") or "") == run.credentials]


@pytest.mark.slow  # flow runs on the shared Prefect stack
@pytest.mark.timeout(1200)
def test_a_retry_cancels_the_first_attempts_servers_and_a_silent_train_flow_frees_them(stack, api, stack_tmp):
    """Two attempts of one train flow run: the second's start cancels the first's servers' run (its replica
    stops); a replica of the second that is killed is started again on its port; then the second attempt dies
    without cancelling anything (its lifeline thread stops, as when its process is killed) and its servers stop by
    themselves after ``server.lifeline_timeout_s``."""
    import logging

    import psutil
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.grpo_servers import ServerRun
    from grpo_core.config import load_config

    @flow(name="stand-in-train")
    def stand_in() -> None:  # only its flow run is used: it stays Scheduled, never final
        pass

    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            *tiny_overrides(stack_tmp),
            f"server.work_pool={SERVERS_POOL}",
            "server.deployment=grpo-servers/gpu",
            "server.lifeline_timeout_s=6",  # beats every 1.5 s: room for a slow API round trip on a loaded box
            "server.startup_timeout_s=120",
        ],
    )
    gpu_worker, log = stack.workers[SERVERS_POOL], logging.getLogger("test")
    with temporary_settings({PREFECT_API_URL: stack.api_url, PREFECT_API_AUTH_STRING: stack.auth_string}):
        with get_client(sync_client=True) as client:
            train_id = str(client.create_flow_run(stand_in).id)
        first = ServerRun(cfg, train_id, "token-1", {}, log)
        first.start()
        first_replicas = _embedded_under(gpu_worker.pid)
        assert len(first_replicas) == 1
        second = ServerRun(cfg, train_id, "token-2", {}, log)  # the retry: cancels the first attempt's run
        second.start()
        assert api.wait(first.flow_run_id, timeout_s=60)["state_type"] == "CANCELLED"
        psutil.wait_procs(first_replicas, timeout=30)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in first_replicas)
        second_replicas = _embedded_under(gpu_worker.pid)
        assert len(second_replicas) == 1 and second_replicas[0].pid != first_replicas[0].pid
        port = _listening(second_replicas[0])
        assert port == {int(second.url.rsplit(":", 1)[1])}
        second_replicas[0].kill()  # a replica dies: the servers' run starts it again on its port (URL unchanged)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            again = [p for p in _embedded_under(gpu_worker.pid) if p.pid != second_replicas[0].pid]
            if again and _listening(again[0]) == port:
                break
            time.sleep(0.3)
        assert again and _listening(again[0]) == port, "the killed replica was not started again on its port"
        # It came back with the base weights: a request for a later policy version is refused, not sampled from
        # them, and the replica stays fenced (503) until the trainer's next weight sync lowers the fence.
        deadline = time.monotonic() + 90
        while _health(second.url) != 200:  # it listens before its model is loaded: a request may time out
            assert time.monotonic() < deadline, "the restarted replica never answered /health"
            time.sleep(0.2)
        asked = httpx.post(
            second.url + "/v1/completions",
            timeout=30,
            json={"prompt": [1], "max_tokens": 1},
            headers={"Authorization": "Bearer token-2", "X-GRPO-Policy-Version": "3"},
        )
        assert asked.status_code == 503 and "PolicyVersionBehind" in asked.text and "base weights" in asked.text
        assert _health(second.url) == 503
        second_replicas = again
        first._beating.set()
        second._beating.set()  # the train flow's process is gone: no beat, no cancellation
        run = api.wait(second.flow_run_id, timeout_s=90)
    assert run["state_type"] == "COMPLETED", run["state"]
    deadline = time.monotonic() + 30  # the run's last log lines reach the API after its final state
    while "stopped beating its lifeline" not in api.logs(second.flow_run_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "stopped beating its lifeline" in api.logs(second.flow_run_id)
    psutil.wait_procs(second_replicas, timeout=30)
    assert not _embedded_under(gpu_worker.pid)


def _health(url: str) -> int | None:
    """The status ``GET /health`` answers, None when it does not answer within 5 s (a server still starting)."""
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.TransportError:
        return None


class _Lifeline:
    """Just enough of Prefect's sync client for ``_keep``: the train flow run beats until ``done``, then completes."""

    def __init__(self) -> None:
        self.beats, self.done = 0, False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def read_flow_run(self, flow_run_id: str):
        from types import SimpleNamespace

        from prefect.states import Completed, Running

        return SimpleNamespace(state=Completed() if flow_run_id == "train" and self.done else Running())

    def read_variable_by_name(self, name: str):
        from types import SimpleNamespace

        self.beats += 1
        return SimpleNamespace(value=self.beats)


@pytest.mark.parametrize("start_retries", [1, 2])
def test_a_replica_that_fails_to_start_again_is_retried_while_restarts_last(start_retries, tmp_path, monkeypatch):
    """A dead replica whose restart fails (say a slow load missed ``server.startup_timeout_s``) is tried again on the
    next pass while ``server.start_retries`` lasts; only when every replica is dead with its restarts spent does the
    servers' flow run fail."""
    import subprocess
    import sys
    from types import SimpleNamespace

    import flows.grpo_servers as servers
    import grpo_core.serving.launch as launch_mod
    from grpo_core.errors import ServerStartError

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lifeline, calls, live, warned = _Lifeline(), [], [], []
    log = SimpleNamespace(warning=lambda msg, *args: warned.append(msg % args), info=lambda *a: None)

    def relaunch(handle, token):
        calls.append(handle.url)
        process = subprocess.Popen([sys.executable, "-c", "pass" if len(calls) == 1 else "import time; time.sleep(60)"])
        live.append(process)
        return SimpleNamespace(process=process, url=handle.url)

    def wait_healthy(handle, timeout_s, token, fenced_ok=False):
        if handle.process is live[0]:  # the first start's process exits during its load
            handle.process.wait()
            raise ServerStartError("replica 0 exited with code 0 during its load")
        lifeline.done = True  # the second one serves; the train flow run ends once the replica is back
        return handle.url

    monkeypatch.setattr(launch_mod, "relaunch", relaunch)
    monkeypatch.setattr(launch_mod, "wait_healthy", wait_healthy)
    monkeypatch.setattr("prefect.client.orchestration.get_client", lambda sync_client: lifeline)
    cfg = RunConfig.model_validate(
        {"server": {"start_retries": start_retries, "lifeline_timeout_s": 2, "log_dir": str(tmp_path)}}
    )
    procs = SimpleNamespace(servers=[SimpleNamespace(process=dead, url="http://127.0.0.1:9")], token="t")
    try:
        if start_retries == 1:
            with pytest.raises(ServerStartError, match=r"server.start_retries \(1\) restarts each are spent"):
                servers._keep(cfg, procs, "own", "train", "lifeline", log)
        else:
            assert servers._keep(cfg, procs, "own", "train", "lifeline", log) == "train flow run train is Completed"
            assert procs.servers[0].process is live[1] and live[1].poll() is None
    finally:
        for process in live:
            process.kill()
    assert calls == ["http://127.0.0.1:9"] * start_retries
    assert any(w.startswith(f"replica 0 did not start again (1 of {start_retries})") for w in warned), warned


def test_the_lifeline_is_still_checked_while_a_replica_starts_again(tmp_path, monkeypatch):
    """A relaunched replica may load for minutes (up to ``server.startup_timeout_s``). Meanwhile the servers' flow
    keeps checking its lifeline: a train flow run that stops beating frees the GPUs after
    ``server.lifeline_timeout_s``, with the start still going (it ended only with the teardown); the start waited
    on the flow's own thread before, blind to the lifeline until the load ended."""
    import subprocess
    import sys
    import threading
    from types import SimpleNamespace

    import flows.grpo_servers as servers
    import grpo_core.serving.launch as launch_mod
    from grpo_core.errors import ServerStartError

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lifeline, loading, loaded = _Lifeline(), threading.Event(), threading.Event()
    beats = lifeline.read_variable_by_name
    lifeline.read_variable_by_name = lambda name: SimpleNamespace(value=0) if loading.is_set() else beats(name)
    slow = []

    def relaunch(handle, token):
        slow.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        return SimpleNamespace(process=slow[-1], url=handle.url)

    def wait_healthy(handle, timeout_s, token, fenced_ok=False):  # a load that ends only when its process does
        loading.set()  # ... and the train flow run stops beating its lifeline from now on
        try:
            handle.process.wait(timeout=timeout_s)
            raise ServerStartError("replica 0 exited with code -9")
        finally:
            loaded.set()

    monkeypatch.setattr(launch_mod, "relaunch", relaunch)
    monkeypatch.setattr(launch_mod, "wait_healthy", wait_healthy)
    monkeypatch.setattr("prefect.client.orchestration.get_client", lambda sync_client: lifeline)
    cfg = RunConfig.model_validate(
        {"server": {"start_retries": 1, "lifeline_timeout_s": 2, "startup_timeout_s": 600, "log_dir": str(tmp_path)}}
    )
    procs = SimpleNamespace(servers=[SimpleNamespace(process=dead, url="http://127.0.0.1:9")], token="t")
    log = SimpleNamespace(warning=lambda *a: None, info=lambda *a: None)
    try:
        reason = servers._keep(cfg, procs, "own", "train", "lifeline", log)
        assert loading.is_set() and not loaded.is_set(), "the replica's start had to be going when the run stopped"
        assert reason == "train flow run train stopped beating its lifeline for 2 s (server.lifeline_timeout_s)"
        assert procs.servers[0].process is slow[0], "the starting replica must be in the teardown's hands"
    finally:
        for process in slow:
            process.kill()  # the teardown
    assert loaded.wait(10), "the wait for the replica did not end with its process"
