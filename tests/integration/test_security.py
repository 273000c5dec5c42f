"""Listeners a run starts serve only that run: bearer token, launch nonce, adapter folder, pause limit, taken ports.

Real processes throughout: one tiny embedded server (module fixture, pause limit 2 s), the fake generation server
(tests/support/fake_generation.py) standing in for "another run's server", and real sockets holding ports.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from fake_generation import ANY_ROUTE
from serving_helpers import (
    BAD_AUTH,
    OPEN_ROUTES,
    TINY,
    adapter_dir,
    answers_without_token,
    app_routes,
    embedded_server,
    run,
    weights_dir,
)

from grpo_core.config import ModelConfig, RunConfig
from grpo_core.errors import PortInUseError, ServerRequestError, ServerStartError
from grpo_core.run.children import free_port
from grpo_core.security.auth import bearer_headers, run_token
from grpo_core.serving.client import GenerationClient
from grpo_core.serving.launch import LaunchSpec, ServerHandle, provision, wait_healthy
from grpo_core.serving.protocol import HEALTH_PATH, IDENTITY_PATH, NONCE_PATH, PAUSE_PATH, STALE_PATH

# A body for each route that would change state if a request got through the guard.
BODIES = {
    "/v1/completions": {"model": TINY, "prompt": [5, 6], "max_tokens": 2},
    "/init_weight_transfer_engine": {},
    "/start_weight_update": {},
    "/update_weights": {"update_info": {"path": "/nonexistent"}},
    "/v1/load_lora_adapter": {"lora_name": "x", "lora_path": "/nonexistent"},
    "/v1/unload_lora_adapter": {"lora_name": "x"},
}
#: What the embedded server must guard at least (the set-up check of the routes read from its app).
KNOWN = {
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("POST", "/update_weights"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/load_lora_adapter"),
    ("GET", "/metrics"),
    ("GET", "/server_info"),
    ("GET", "/docs"),
}


def _embedded_app(token: str = "in-process-token-0123"):
    """The embedded server's FastAPI app over no engine: its routes and its guard, nothing behind them."""
    from grpo_core.serving.embedded.app import ServerState, create_app

    state = ServerState(
        engine=None,
        tokenizer=None,
        weights=None,
        model_name=TINY,
        model_path="",
        max_logprobs=0,
        max_loras=0,
        guard={"token": token},
    )
    return create_app(state)


# The routes the guard answers itself (on vLLM too), ahead of the app's.
GUARD_ROUTES = [("GET", NONCE_PATH), ("POST", STALE_PATH)]
# Every route of the embedded server but /health, read from its app (a route added later is covered).
PROTECTED = [(m, p, BODIES.get(p)) for m, p in app_routes(_embedded_app()) + GUARD_ROUTES if (m, p) not in OPEN_ROUTES]


def test_every_route_of_the_embedded_app_but_health_is_closed_without_the_token():
    """In-process, on the app the server process builds: every route and method read from ``app.routes``, and the
    guard's own routes, answer 401 to a request without the token, a wrong one or another scheme; only ``/health``
    answers."""
    app = _embedded_app()
    routes = app_routes(app)
    assert set(routes) >= KNOWN, KNOWN - set(routes)
    routes += GUARD_ROUTES
    status = run(answers_without_token(app, routes))
    assert len(status) == len(routes) * len(BAD_AUTH)
    opened = {key: code for key, code in status.items() if (key[0], key[1]) not in OPEN_ROUTES and code != 401}
    assert opened == {}, f"answered without the run's token: {opened}"
    assert {code for key, code in status.items() if (key[0], key[1]) in OPEN_ROUTES} == {200}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with embedded_server(tmp_path_factory.mktemp("guarded"), max_pause_s=2.0) as handle:
        yield handle


def _authed(url: str, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, url + path, headers=bearer_headers(run_token()), timeout=60, **kw)


def _state(server) -> tuple:
    """What an attacker could change: pause state, served models."""
    paused = _authed(server.url, "GET", "/is_paused").json()["is_paused"]
    models = [m["id"] for m in _authed(server.url, "GET", "/v1/models").json()["data"]]
    return paused, models


@pytest.mark.parametrize("headers", BAD_AUTH)
def test_every_route_but_health_refuses_requests_without_the_run_token(server, headers):
    before = _state(server)
    assert {(m, p) for m, p, _ in PROTECTED} >= KNOWN
    for method, path, body in PROTECTED:
        answer = httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)
        assert answer.status_code == 401, (method, path, answer.status_code, answer.text)
        if method != "HEAD":  # a HEAD answer has no body
            assert answer.json()["error"]["code"] == 401 and run_token() not in answer.text
    assert _state(server) == before == (False, [TINY])
    health = httpx.get(server.url + "/health", headers=headers)
    assert health.status_code == 200 and health.content == b""  # liveness only


def test_the_run_token_opens_every_route_and_the_nonce_is_this_launchs(server):
    assert _authed(server.url, "GET", NONCE_PATH).json() == {"nonce": server.spec.nonce} and server.spec.nonce
    assert run_token() not in " ".join(server.spec.argv) + json.dumps(server.spec.env)  # env of the child only
    assert run_token() not in server.spec.log_path.read_text(errors="replace")

    async def go():
        async with GenerationClient(server.url, timeout_s=60) as c:  # the run's token from the environment
            return await c.complete([5, 6, 7], model=TINY, max_tokens=3), await c.server_info()

    (completion,), info = run(go())
    assert len(completion.token_ids) == 3 and info["backend"] == "embedded"


def _adapter(folder: Path, copy_of: Path | None = None) -> Path:
    """A real PEFT LoRA adapter of the tiny model in ``folder`` (a copy of ``copy_of`` when given)."""
    if copy_of is not None:
        shutil.copytree(copy_of, folder)
        return folder
    from peft import LoraConfig, get_peft_model

    from grpo_core.models import load_model

    torch.manual_seed(0)
    peft = get_peft_model(load_model(ModelConfig(name=TINY))[0], LoraConfig(r=8, target_modules=["q_proj"]))
    peft.save_pretrained(folder)
    return folder


def test_adapters_and_weights_load_only_from_the_runs_folders(server, tmp_path):
    outside = _adapter(tmp_path / "elsewhere")
    link = adapter_dir(server) / "link-out"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside, target_is_directory=True)  # inside by name, outside once resolved
    (weights_dir(server)).mkdir(parents=True, exist_ok=True)

    async def go():
        async with GenerationClient(server.url, timeout_s=60, max_retries=0) as c:
            errors = []
            for name, path in (
                ("out", str(outside)),
                ("dots", str(adapter_dir(server) / ".." / ".." / "x")),
                ("link", str(link)),
            ):
                with pytest.raises(ServerRequestError) as info:
                    await c.load_lora_adapter(name, path)
                errors.append(info.value)
            with pytest.raises(ServerRequestError) as weights:
                await c.update_weights({"path": str(tmp_path)})
            inside = _adapter(adapter_dir(server) / "ours", copy_of=outside)
            await c.load_lora_adapter("ours", str(inside))
            models = [m["id"] for m in await c.models()]
            await c.unload_lora_adapter("ours")
            return errors, weights.value, models

    errors, weights, models = run(go())
    assert all(e.status == 403 and "outside" in str(e) for e in errors) and weights.status == 403
    assert models == [TINY, "ours"]


def test_a_pause_ends_after_the_limit_and_says_so(server):
    assert _authed(server.url, "POST", "/pause", params={"mode": "keep"}).status_code == 200
    assert _state(server)[0] is True
    deadline = time.monotonic() + 120
    while _state(server)[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _state(server)[0] is False
    assert "without a resume: resuming it" in server.spec.log_path.read_text(errors="replace")


@pytest.fixture
def foreign(fake_generation):
    """Another run's server: the fake generation server answering 200 ``{"status": "ok"}`` on every path and
    recording what it was sent."""
    fake_generation.script(ANY_ROUTE, status=200, body={"status": "ok"})
    return fake_generation


def test_a_fixed_port_taken_by_another_server_is_a_clear_error_and_nothing_is_sent(foreign, tmp_path):
    port = foreign.port
    config = RunConfig(
        model={"name": TINY}, server={"backend": "embedded", "port": port, "log_dir": tmp_path, "startup_timeout_s": 60}
    )
    with pytest.raises(PortInUseError, match=rf"127.0.0.1:{port} is already in use.*server.port"):
        provision(config)
    assert foreign.requests == []  # not even probed: no weights, no pause, nothing
    assert not (tmp_path / "embedded-replica0.log").exists()  # no server was started


def _taken_after_a_free_port() -> tuple[socket.socket, int]:
    """A listening socket on port p + 1 where p is free now: ``(socket, p)``."""
    for _ in range(50):
        free = free_port()
        taken = socket.socket()
        try:
            taken.bind(("127.0.0.1", free + 1))
        except OSError:
            taken.close()
            continue
        taken.listen()
        return taken, free
    raise RuntimeError("no free pair of ports")


def test_a_taken_port_of_a_later_replica_or_of_the_router_names_its_setting_and_starts_nothing(tmp_path):
    """Replica i listens on server.port + i; the router on server.router_port (it said 'router replica 1 exited'
    and '--port' before, after launching)."""
    from grpo_core.serving.router.server import start_router

    taken, port = _taken_after_a_free_port()
    with taken:
        config = RunConfig(
            model={"name": TINY},
            server={
                "backend": "embedded",
                "port": port,
                "num_replicas": 2,
                "log_dir": tmp_path,
                "startup_timeout_s": 60,
            },
        )
        with pytest.raises(PortInUseError) as info:
            provision(config)
        assert str(info.value).startswith(f"127.0.0.1:{port + 1} is already in use")
        assert str(info.value).endswith(
            "set server.port (replica 1 listens on server.port + 1) to a free port (0 = pick one)"
        ), str(info.value)
        router = config.server.model_copy(update={"router_port": port + 1, "port": 0})
        with pytest.raises(PortInUseError) as info:
            start_router(router, ["http://127.0.0.1:9"], token="t")
        assert str(info.value).startswith(f"127.0.0.1:{port + 1} is already in use")
        assert str(info.value).endswith("set server.router_port to a free port (0 = pick one)"), str(info.value)
    assert list(tmp_path.iterdir()) == [], "no replica or router was launched (no log file)"


def _sleeper(port: int, tmp_path: Path, nonce: str = "ours") -> ServerHandle:
    """A live process of 'ours' that never listens, as a replica still loading while another server holds its port."""
    spec = LaunchSpec(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        {},
        "vllm",
        0,
        "127.0.0.1",
        port,
        tmp_path / "sleeper.log",
        nonce=nonce,
    )
    process = subprocess.Popen(spec.argv, start_new_session=True)
    return ServerHandle(spec, process)


@pytest.mark.parametrize("who", ["no guard", "another run", "another launch"])
def test_a_server_answering_on_our_port_is_never_adopted(who, foreign, server, tmp_path):
    port = foreign.port if who == "no guard" else int(server.url.rsplit(":", 1)[1])
    token = "another-run-token" if who == "another run" else run_token()
    handle = _sleeper(port, tmp_path)
    reason = {
        "no guard": "does not prove that it holds this run's token",
        "another run": "does not prove that it holds this run's token",
        "another launch": "does not report this launch's nonce",
    }[who]
    with pytest.raises(PortInUseError) as info:
        wait_healthy(handle, 60, token)
    received = [f"{r.method} {r.route} {r.query} {r.body} {r.headers}" for r in foreign.requests]
    if who == "no guard":  # it was asked (so the check ran), and never sent the token
        assert received and not any(token in r or "authorization" in r.lower() for r in received), received
        asked = [
            r for r in foreign.requests if r.method == "GET" and r.route == IDENTITY_PATH and "challenge" in r.query
        ]
        assert asked, received
    assert f"did not start (it {reason})" in str(info.value), str(info.value)
    assert handle.process.poll() is not None  # our replica was stopped
    assert not any(r.method == "POST" for r in foreign.requests), received  # nothing pushed


def test_the_identity_answer_proves_the_token_without_revealing_it(server):
    """The embedded server answers a fresh challenge without a token: HMAC-SHA256 under a key derived from the
    token (recomputed here with hashlib/hmac from the documented construction), bound to the challenge and the
    launch's nonce; a malformed challenge is refused."""
    import hashlib
    import hmac
    import secrets

    # the key the server holds: the run's control key, HMAC-SHA256(token, "grpo-flow key v1 control") (the server
    # never holds the run's token itself: test_key_roles)
    token = hmac.new(run_token().encode(), b"grpo-flow key v1 control", hashlib.sha256).hexdigest()
    challenges = [secrets.token_hex(16) for _ in range(2)]
    answers = [httpx.get(server.url + "/grpo/identity", params={"challenge": c}) for c in challenges]
    assert [a.status_code for a in answers] == [200, 200]
    key = hmac.new(token.encode(), b"grpo-flow identity v1", hashlib.sha256).digest()
    for challenge, answer in zip(challenges, answers, strict=True):
        expected = hmac.new(key, challenge.encode() + b"\x00" + server.spec.nonce.encode(), hashlib.sha256)
        assert answer.json() == {"nonce": server.spec.nonce, "proof": expected.hexdigest()}
        assert token not in answer.text
    assert answers[0].json()["proof"] != answers[1].json()["proof"]  # bound to the challenge
    for bad in ("", "xyz", "ab" * 8, "AB" * 16, "ab" * 65):
        assert httpx.get(server.url + "/grpo/identity", params={"challenge": bad}).status_code == 400, bad


def test_a_replica_fenced_before_its_launcher_saw_it_healthy_is_adopted_at_once(server, tmp_path):
    """A restarted replica can be fenced (a request for a later policy version reached it through the router) before
    its launcher's first ``/health`` poll; the launcher must adopt it then, not wait ``startup_timeout_s`` for a 200
    that only the next weight sync brings (a servers' flow run stuck in that wait missed its lifeline)."""
    port = int(server.url.rsplit(":", 1)[1])
    ours, theirs = _sleeper(port, tmp_path, nonce=server.spec.nonce), _sleeper(port, tmp_path, nonce="not ours")
    checked = _sleeper(port, tmp_path, nonce=server.spec.nonce)
    fence = _authed(server.url, "POST", "/grpo/stale", json={"stale": True, "reason": "a test fenced it"})
    assert fence.status_code == 200, fence.text
    try:
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "a test fenced it" in health.text  # the fence is really up
        # the fence stays up all along: waiting for a 200 would end in ServerStartError after 20 s (the servers' flow
        # waits so for a relaunched replica, with fenced_ok: nothing it runs next needs the replica to generate)
        assert wait_healthy(ours, 20, run_token(), fenced_ok=True) == server.url
        with pytest.raises(PortInUseError, match="does not report this launch's nonce"):
            wait_healthy(theirs, 60, run_token(), fenced_ok=True)  # a fenced server of another launch: never ours
        # a start that probes the replica with a generation request next (provision) waits for the fence to drop
        with pytest.raises(ServerStartError, match="not healthy after 3 s"):
            wait_healthy(checked, 3, run_token())
    finally:
        _authed(server.url, "POST", "/grpo/stale", json={"stale": False})
        for handle in (ours, theirs, checked):
            handle.stop()
    assert httpx.get(server.url + "/health").status_code == 200


def test_prefect_stack_on_a_taken_port_starts_nothing(tmp_path):
    from flows.serve import PrefectStack

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortInUseError, match=rf"127.0.0.1:{port} is already in use.*grpo deploy --port"):
            PrefectStack(port=port, home=tmp_path / "prefect").start()
    assert not (tmp_path / "prefect" / "server.log").exists()


def test_a_prefect_server_that_needs_no_auth_string_is_not_ours_and_is_never_sent_it(foreign, tmp_path):
    from flows.local_api import PrefectApiError, verify_own_server

    ours = _sleeper(0, tmp_path).process  # alive, but another server answers on the port
    try:
        with pytest.raises(PrefectApiError) as info:
            verify_own_server(f"{foreign.url}/api", "grpo:secret", ours, "test")
    finally:
        ours.kill()
        ours.wait()
    basic = "Z3JwbzpzZWNyZXQ="  # base64 of grpo:secret
    sent = [f"{r.method} {r.route} {r.query} {r.body} {r.headers}" for r in foreign.requests]
    assert not any("secret" in r or basic in r or "authorization" in r.lower() for r in sent), sent
    assert "is not served by the Prefect server test started" in str(info.value), str(info.value)
    assert "belong to another process" in str(info.value)


# A Prefect-like API started as a grandchild (``prefect server start`` runs uvicorn as its child): 401 without the
# auth string, 200 with it; prints its port.
_BASIC_SERVER = """
import base64, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
want = "Basic " + base64.b64encode(b"grpo:secret").decode()
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.headers.get("authorization") == want else 401)
        self.end_headers()
    def log_message(self, *a):
        pass
httpd = HTTPServer(("127.0.0.1", 0), H)
print(httpd.server_address[1], flush=True)
httpd.serve_forever()
"""


def test_a_prefect_server_we_started_is_recognised_by_its_socket():
    from flows.local_api import verify_own_server

    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_BASIC_SERVER!r}])"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        port = int(parent.stdout.readline())  # the grandchild listens: set-up happened
        assert httpx.get(f"http://127.0.0.1:{port}/api/admin/version").status_code == 401
        verify_own_server(f"http://127.0.0.1:{port}/api", "grpo:secret", parent, "test")  # no error: ours
    finally:
        import os
        import signal

        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


PROBE = """
import os, psutil, torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
if dist.get_rank() == 0:
    agent = psutil.Process(os.getppid())
    procs = [agent, *agent.children(recursive=True)]
    listening = {c.laddr.ip for p in procs for c in p.net_connections() if c.status == psutil.CONN_LISTEN}
    print("RESULT", total.item(), sorted(listening), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_the_trainer_launcher_listens_on_loopback_only(tmp_path):
    """torchrun --standalone binds its stores on every interface; grpo_core.train.launch on 127.0.0.1 only."""
    (tmp_path / "probe.py").write_text(PROBE)
    done = subprocess.run(
        [sys.executable, "-m", "grpo_core.train.launch", "--nproc-per-node", "2", str(tmp_path / "probe.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    assert line == "RESULT 3.0 ['127.0.0.1']"  # the ranks met (1 + 2), and nothing listens beyond loopback


def test_the_guard_loads_into_a_vllm_style_app_from_the_environment(monkeypatch):
    """vLLM adds a --middleware class with app.add_middleware(cls) and no arguments: the environment carries all."""
    import importlib

    from grpo_core.serving.launch import GUARD_MIDDLEWARE
    from grpo_core.serving.simulated.app import create_app
    from grpo_core.serving.simulated.cost import CostModel
    from grpo_core.serving.simulated.engine import EngineSettings, SimEngine

    monkeypatch.setenv("GRPO_RUN_TOKEN", "tok-123")
    monkeypatch.setenv("GRPO_RUN_NONCE", "n-1")
    engine = SimEngine(CostModel(), EngineSettings())
    app = create_app(engine)  # the engine simulator's app: vLLM's routes, no guard of its own
    module, name = GUARD_MIDDLEWARE.rsplit(".", 1)
    app.add_middleware(getattr(importlib.import_module(module), name))  # as vllm's build_app does
    ours = {"Authorization": "Bearer tok-123"}

    async def go():
        task = engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vllm") as http:
                refused, health = await http.post(PAUSE_PATH), await http.get(HEALTH_PATH)
                assert refused.status_code == 401 and health.status_code == 200
                assert engine.pause_mode is None and not engine.paused, "the refused pause reached the engine"
                assert (await http.get(NONCE_PATH, headers=ours)).json() == {"nonce": "n-1"}
                assert (await http.post(PAUSE_PATH, headers=ours)).status_code == 200 and engine.paused
        finally:
            task.cancel()

    run(go())


class _Rollout:
    """A real rollout Flight server over a queue holding one group; records shutdown calls."""

    def __init__(self, token: str = "flight-token", port: int = 0) -> None:
        from grpo_core.packing import Sample
        from grpo_core.rollout.pace import TokenAllowance
        from grpo_core.rollout.queue import SampleQueue
        from grpo_core.rollout.window import MetricWindow
        from grpo_core.transport.flight_server import RolloutFlightServer

        self.queue = SampleQueue(TokenAllowance(1, 100), with_topk=False)
        samples = [
            Sample.build([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.7], sample_id=i, advantage=1.0 - 2 * i) for i in range(2)
        ]
        self.queue.put_group(0, samples, tokens=6)
        self.shutdowns: list[bool] = []
        self.server = RolloutFlightServer(
            f"grpc://127.0.0.1:{port}",
            self.queue,
            MetricWindow(),
            lambda: 0,
            lambda: self.shutdowns.append(True),
            token=token,
        )
        self.location = f"grpc://127.0.0.1:{self.server.port}"


def test_the_rollout_flight_server_refuses_calls_without_the_run_token():
    import pyarrow.flight as flight

    from grpo_core.transport.flight_client import FlightSource

    rollout = _Rollout()
    try:
        client = flight.connect(rollout.location)
        for headers in ([], [(b"authorization", b"Bearer wrong")]):
            options = flight.FlightCallOptions(timeout=10, headers=headers)
            calls = [
                lambda o=options: client.do_get(flight.Ticket(b'{"min_samples": 1, "wait_s": 0}'), o).read_all(),
                lambda o=options: list(client.do_action(flight.Action("shutdown", b"{}"), o)),
                lambda o=options: list(
                    client.do_action(
                        flight.Action("report", json.dumps({"policy_version": 5, "tokens_consumed": 999}).encode()), o
                    )
                ),
                lambda o=options: list(client.list_actions(o)),
            ]
            for call in calls:
                with pytest.raises(flight.FlightUnauthenticatedError):
                    call()
        client.close()
        # Nothing changed: the group is still queued, no shutdown, no report.
        assert rollout.shutdowns == [] and rollout.queue.allowance.policy_version == 0
        assert rollout.queue.allowance.trainer_step == 0
        with pytest.raises(Exception, match="refused this process's token"):
            FlightSource(rollout.location, max_staleness=1, timeout_s=10, token="wrong").pull(0, timeout_s=0)
        source = FlightSource(rollout.location, max_staleness=1, timeout_s=10, token="flight-token")
        batch = source.pull(0, min_samples=2, timeout_s=10)
        source.report(1, 6)
        source.close()
        assert batch.samples.num_rows == 2 and batch.samples["advantage"].to_pylist() == [1.0, -1.0]
        assert rollout.queue.allowance.policy_version == 1 and rollout.shutdowns == [True]
    finally:
        rollout.server.shutdown()


def test_a_taken_flight_port_is_a_clear_error():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        with pytest.raises(PortInUseError, match="rollout.flight_port"):
            _Rollout(port=holder.getsockname()[1])
