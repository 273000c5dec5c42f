"""Three keys, each accepted only where its role needs it (issue 26, item 14): inference, control, trainer membership.

The keys are computed here from their definition (HMAC-SHA256 of a role label under the run's token; the inference
key under the control key), not by the code under test; the routes are read from the apps themselves (the embedded
server's and the router's ``app.routes``), so a route added later is covered.
"""

from __future__ import annotations

import hashlib
import hmac
import sys
from pathlib import Path

import httpx
import pytest
from ports import refusing_ports
from serving_helpers import OPEN_ROUTES, TINY, app_routes, run

from grpo_core.security import auth
from grpo_core.serving.protocol import (
    COMPLETIONS_PATH,
    CONTROL_PATHS,
    GENERATION_PATHS,
    MODELS_PATH,
    NONCE_PATH,
    STALE_PATH,
)

TOKEN = "the-runs-token-0123456789abcdef"


def _hmac(key: str, role: str) -> str:
    return hmac.new(key.encode(), b"grpo-flow key v1 " + role.encode(), hashlib.sha256).hexdigest()


CONTROL = _hmac(TOKEN, "control")
MEMBER = _hmac(TOKEN, "member")
INFERENCE = _hmac(CONTROL, "inference")
KEYS = {"token": TOKEN, "control": CONTROL, "inference": INFERENCE, "member": MEMBER, "wrong": "not-a-key-of-this-run"}
#: What an evaluation client may do with the inference key (the issue's list), besides the generation routes.
INFERENCE_ROUTES = {*GENERATION_PATHS, MODELS_PATH, "/tokenize", "/detokenize"}
GUARD_ROUTES = [("GET", NONCE_PATH), ("POST", STALE_PATH)]


def test_the_keys_are_hmacs_of_their_role_and_none_is_another():
    assert auth.derive_key(TOKEN, auth.ROLE_CONTROL) == CONTROL and auth.derive_key(TOKEN, "member") == MEMBER
    assert auth.role_env(TOKEN, "inference", "control", "member") == {
        "GRPO_INFERENCE_KEY": INFERENCE,
        "GRPO_CONTROL_KEY": CONTROL,
        "GRPO_MEMBER_KEY": MEMBER,
    }
    assert len(set(KEYS.values())) == len(KEYS)
    # a process holds a role's key from its own variable, else derives it from what it holds
    assert auth.role_key("inference", {"GRPO_CONTROL_KEY": CONTROL}) == INFERENCE
    assert auth.role_key("member", {"GRPO_CONTROL_KEY": CONTROL}) is None  # control yields no membership
    assert auth.role_key("control", {"GRPO_INFERENCE_KEY": INFERENCE}) is None
    assert auth.role_key("member", {"GRPO_RUN_TOKEN": TOKEN}) == MEMBER
    with pytest.raises(ValueError, match="unknown key role 'admin'"):
        auth.role_key("admin", {})


def _embedded_app(token: str):
    from grpo_core.serving.embedded.app import ServerState, create_app

    state = ServerState(
        engine=None,
        tokenizer=None,
        weights=None,
        model_name=TINY,
        model_path="",
        max_logprobs=0,
        max_loras=0,
        guard={"token": token, "max_pause_s": 0},
    )
    return create_app(state)


async def _statuses(app, routes: list[tuple[str, str]], keys: dict[str, str]) -> dict[tuple[str, str, str], int]:
    """Status of each route asked in-process with each key; the app's own errors (no engine here) answer 500."""
    status = {}
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://listener", timeout=30) as http:
        for name, key in keys.items():
            for method, path in routes:
                answer = await http.request(method, path, headers={"Authorization": f"Bearer {key}"}, json={})
                status[(name, method, path)] = answer.status_code
                if answer.status_code == 403 and method != "HEAD":
                    assert "GRPO_CONTROL_KEY" in answer.text, answer.text  # names the role the route needs
    return status


def _check_roles(status: dict[tuple[str, str, str], int], routes: list[tuple[str, str]]) -> None:
    for method, path in routes:
        if (method, path) in OPEN_ROUTES:
            continue
        got = {name: status[(name, method, path)] for name in KEYS}
        assert got["wrong"] == 401 and got["member"] == 401, (method, path, got)
        assert got["control"] not in (401, 403) and got["token"] not in (401, 403), (method, path, got)
        if path in INFERENCE_ROUTES:
            assert got["inference"] not in (401, 403), (method, path, got)
        else:
            assert got["inference"] == 403, (method, path, got)


@pytest.mark.parametrize("given", ["control", "token"])
def test_each_key_opens_only_its_routes_on_the_embedded_server(given):
    """The guard given the control key (as the launcher gives it) or the run's token: the inference key gets 403 on
    every route but generation, the model list and tokenizing; the control key and the run's token pass everywhere;
    the membership key and a wrong one get 401."""
    app = _embedded_app(KEYS[given])
    routes = app_routes(app) + GUARD_ROUTES
    paths = {p for _, p in routes}
    assert set(CONTROL_PATHS) <= paths and {COMPLETIONS_PATH, MODELS_PATH, "/metrics"} <= paths  # set-up
    status = run(_statuses(app, routes, KEYS))
    _check_roles(status, routes)
    assert {status[("inference", "POST", p)] for p in CONTROL_PATHS} == {403}


@pytest.fixture
def ports():
    """One port that refuses connections for the test (tests/support/ports.py)."""
    with refusing_ports(1) as held:
        yield held


def test_each_key_opens_only_its_routes_on_the_router(monkeypatch, ports):
    """The router started with the control key in its environment (as ``start_router`` starts it): the same split;
    its replicas are down, so a request it lets through answers 502/503 from the replicas, never 401/403."""
    from grpo_core.serving.replicas import ReplicaSet
    from grpo_core.serving.router.app import create_router_app

    # a port the test holds, bound but not listening: refused, and no other worker's server can take it meanwhile
    (port,) = ports
    dead = f"http://127.0.0.1:{port}"
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.setenv(auth.CONTROL_KEY_ENV, CONTROL)

    async def go():
        replicas = ReplicaSet([dead], max_retries=0, control_retry_s=0.05, control_timeout_s=0.2)
        try:
            app = create_router_app(replicas)
            routes = app_routes(app)
            assert set(CONTROL_PATHS) <= {p for _, p in routes} and set(GENERATION_PATHS) <= {p for _, p in routes}
            return routes, await _statuses(app, routes, KEYS)
        finally:
            await replicas.aclose()

    routes, status = run(go())
    _check_roles(status, routes)


def test_the_flight_server_takes_the_membership_key_only(monkeypatch):
    """The rollout's Flight server started with the membership key in its environment (as the rollout process is):
    the membership key and the run's token pass; the control and inference keys are refused like a wrong one."""
    import pyarrow.flight as flight

    from grpo_core.rollout.pace import TokenAllowance
    from grpo_core.rollout.queue import SampleQueue
    from grpo_core.rollout.window import MetricWindow
    from grpo_core.transport.flight_server import RolloutFlightServer

    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.setenv(auth.MEMBER_KEY_ENV, MEMBER)
    server = RolloutFlightServer(
        "grpc://127.0.0.1:0", SampleQueue(TokenAllowance(1, 100), with_topk=False), MetricWindow(), lambda: 0, list
    )
    client = flight.connect(f"grpc://127.0.0.1:{server.port}")
    try:
        for name, key in KEYS.items():
            options = flight.FlightCallOptions(timeout=10, headers=[(b"authorization", f"Bearer {key}".encode())])
            if name in ("member", "token"):
                assert {a.type for a in client.list_actions(options)} >= {"report", "ack", "shutdown"}
            else:
                with pytest.raises(flight.FlightUnauthenticatedError, match="GRPO_MEMBER_KEY"):
                    list(client.list_actions(options))
    finally:
        client.close()
        server.shutdown()


def test_the_flows_children_hold_only_their_roles_keys(monkeypatch, tmp_path):
    """The rollout and trainer processes (``run_child_env``) get the control and membership keys and neither the
    run's token nor the inference key, though the flow's own environment holds the token; a generation server
    (``launch``) gets its control key only (not ``VLLM_API_KEY`` either): read from the real child's
    ``/proc/<pid>/environ``."""
    from grpo_core.run.prepare import run_child_env
    from grpo_core.run.processes import REGISTRY, RunProcesses
    from grpo_core.serving.launch import LaunchSpec, launch

    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    monkeypatch.setenv(auth.INFERENCE_KEY_ENV, "left-over-in-the-shell")
    run_dir = str(tmp_path)
    REGISTRY[run_dir] = RunProcesses(token=TOKEN)
    try:
        env = run_child_env(run_dir)
    finally:
        REGISTRY.pop(run_dir, None)
    held = {name: env.get(name) for name in (*auth.ROLE_KEY_ENV.values(), auth.TOKEN_ENV)}
    assert held == {
        "GRPO_INFERENCE_KEY": None,
        "GRPO_CONTROL_KEY": CONTROL,
        "GRPO_MEMBER_KEY": MEMBER,
        "GRPO_RUN_TOKEN": None,
    }
    assert TOKEN not in env.values()

    monkeypatch.setenv("VLLM_API_KEY", "a-users-key")
    spec = LaunchSpec(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        {},
        "embedded",
        0,
        "127.0.0.1",
        0,
        tmp_path / "sleeper.log",
        None,
        nonce="n",
    )
    handle = launch(spec, CONTROL)
    try:
        raw = Path(f"/proc/{handle.process.pid}/environ").read_bytes()
    finally:
        handle.stop()
    child = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    assert child.get("GRPO_CONTROL_KEY") == CONTROL  # set-up: the environment read is the launched child's
    assert not {"GRPO_RUN_TOKEN", "GRPO_MEMBER_KEY", "GRPO_INFERENCE_KEY", "VLLM_API_KEY"} & set(child)
    assert TOKEN not in child.values() and MEMBER not in child.values()


def test_the_rollout_process_gets_the_control_and_membership_keys_only(monkeypatch, tmp_path):
    """``start_rollout_process`` layers the flow's ``env`` over its own environment: the run's token there does not
    leak into the child (captured at the start call)."""
    from grpo_core.rollout import process

    started = {}

    def capture(cmd, env, stdout):
        started["env"] = env
        raise RuntimeError("captured")

    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    monkeypatch.setattr(process, "start_child", capture)
    with pytest.raises(RuntimeError, match="captured"):
        process.start_rollout_process(tmp_path / "config.json", ["http://127.0.0.1:1"], tmp_path, env={"X": "1"})
    env = started["env"]
    assert env["X"] == "1" and env["GRPO_CONTROL_KEY"] == CONTROL and env["GRPO_MEMBER_KEY"] == MEMBER
    assert auth.TOKEN_ENV not in env and auth.INFERENCE_KEY_ENV not in env


def test_the_key_command_prints_each_roles_key_of_the_token_in_the_environment():
    """``python -m grpo_core.security.auth ROLE...`` (the multi-host recipe's way to hand each host its keys)."""
    import os
    import subprocess

    env = {**os.environ, auth.TOKEN_ENV: TOKEN}
    done = subprocess.run(
        [sys.executable, "-m", "grpo_core.security.auth", "member", "inference"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"export GRPO_MEMBER_KEY={MEMBER}", f"export GRPO_INFERENCE_KEY={INFERENCE}"]
    env.pop(auth.TOKEN_ENV)
    refused = subprocess.run([sys.executable, "-m", "grpo_core.security.auth", "member"], env=env, capture_output=True)
    assert refused.returncode == 2 and refused.stdout == b""


@pytest.mark.parametrize(
    "argv, token, rc, says",
    [
        (["--help"], None, 0, ""),
        (["admin"], "t" * 32, 2, "unknown role 'admin'"),
        ([], "t" * 32, 2, "no ROLE given"),
        (["control"], None, 2, "GRPO_RUN_TOKEN is not set"),
        (["control"], "   ", 2, "empty or blank"),
        (["control"], "abc", 2, "3 characters (fewer than 16)"),
    ],
)
def test_the_key_command_refuses_what_would_print_a_useless_key(monkeypatch, capsys, argv, token, rc, says):
    """A blank or short token (which `grpo validate` refuses for several trainer hosts) printed keys; an unknown role
    got the usage line without naming it; --help exited 2."""
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    if token is not None:
        monkeypatch.setenv(auth.TOKEN_ENV, token)
    assert auth.main(argv) == rc
    out, err = capsys.readouterr()
    assert (out if rc == 0 else err).startswith("usage:") and says in err and "export GRPO" not in out
