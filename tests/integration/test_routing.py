"""Replicas behind prefix-affinity routing (issue 13, step 2): the policy alone, then three embedded replicas.

Expected counts are worked out by hand from the rules (DESIGN.md §10): a group's first request is unmatched and
goes to the least loaded replica (round robin among ties), the others hit it while it holds at most
``route_imbalance`` requests in flight beyond the least loaded replica, and spill beyond that. Which replica
really served what is read from each server's own ``vllm:generation_tokens`` counter (``ignore_eos`` fixes
the tokens per request), not from the router's bookkeeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from ports import refusing_ports
from serving_helpers import TINY, run
from serving_helpers import generated_tokens as generated
from waiting import async_wait_until

from grpo_core.config import ModelConfig, RunConfig
from grpo_core.errors import ServerRequestError
from grpo_core.security.auth import bearer_headers, ensure_run_token, run_token
from grpo_core.serving.client import GenerationClient
from grpo_core.serving.launch import ServerHandle, embedded_command, launch, teardown, wait_healthy
from grpo_core.serving.replicas import HIT, SPILL, UNMATCHED, ControlFanOutError, ReplicaSet, RoutingPolicy
from grpo_core.tracking.metrics import MetricWindow

PROMPT = [11, 12, 13, 14, 15, 16]
T = 4  # tokens per request (ignore_eos)


# ----- the policy alone ----------------------------------------------------------------------------


def test_groups_stick_to_one_replica_and_new_groups_go_round_robin():
    policy = RoutingPolicy(3, route_imbalance=8)
    outcomes, homes = [], []
    for group in range(6):  # one group at a time, its G=8 requests in flight together
        picks = [policy.choose((group, "base")) for _ in range(8)]
        for replica, _ in picks:
            policy.inflight[replica] += 1
        outcomes += [kind for _, kind in picks]
        homes.append({replica for replica, _ in picks})
        for replica, _ in picks:
            policy.inflight[replica] -= 1
    assert homes == [{0}, {1}, {2}, {0}, {1}, {2}]
    assert outcomes.count(UNMATCHED) == 6 and outcomes.count(HIT) == 42 and SPILL not in outcomes  # 7/8 hit


def test_versions_never_share_a_key():
    policy = RoutingPolicy(2)
    assert policy.choose((5, "policy-v1")) == (0, UNMATCHED)
    assert policy.choose((5, "policy-v2"))[1] == UNMATCHED
    assert policy.choose((5, "policy-v1")) == (0, HIT)


def test_spill_starts_beyond_the_imbalance_and_ties_rotate():
    policy = RoutingPolicy(3, route_imbalance=2)
    assert policy.choose("a") == (0, UNMATCHED)
    policy.inflight[:] = [2, 0, 0]
    assert policy.choose("a") == (0, HIT)  # 2 beyond the least loaded: still home
    policy.inflight[:] = [3, 0, 0]
    assert policy.choose("a") == (1, SPILL)  # 3 beyond: least loaded, round robin from after the last pick
    assert policy.choose("a") == (2, SPILL)
    assert policy.choose("a") == (1, SPILL)
    assert policy.homes["a"] == 0, "a spill keeps the key's home"


def test_a_down_replica_is_routed_around_counted_and_rejoins():
    policy = RoutingPolicy(2)
    assert policy.choose("a") == (0, UNMATCHED)
    assert policy.mark_down(0) and not policy.mark_down(0)
    assert policy.counts.replica_down == 1
    assert [policy.choose(k)[0] for k in ("a", "b", "c")] == [1, 1, 1]
    assert policy.homes["a"] == 1, "re-homed while its replica was down"
    policy.mark_up(0)
    assert policy.choose("d") == (0, UNMATCHED)


def test_with_every_replica_down_each_retry_tries_the_next_replica():
    """No replica healthy: a request must go somewhere, and its retries go round every replica (one of them may be
    back before its probe says so) instead of knocking on the key's home each time; the home is kept."""
    policy = RoutingPolicy(3)
    assert policy.choose("a") == (0, UNMATCHED)
    for replica in range(3):
        policy.mark_down(replica)
    assert [policy.choose("a")[0] for _ in range(6)] == [1, 2, 0, 1, 2, 0]
    assert policy.homes["a"] == 0
    policy.mark_up(0)
    assert policy.choose("a") == (0, HIT)


@pytest.mark.parametrize(
    "status, text, reads_storage, final",
    [
        (None, "connection refused", False, False),  # no answer: the replica may be restarting
        (503, "fenced", False, False),
        (500, "internal", True, False),
        (429, "too many requests", False, False),
        (408, "request timeout", True, False),  # HTTP: come back later
        (400, "mode must be one of keep, wait, abort", False, True),  # /pause?mode=bogus: the same on every retry
        (404, "Not Found", False, True),  # a route the server does not have (vLLM without dev mode)
        (401, "Unauthorized", True, True),
        (403, "outside the adapter folder", True, True),
        (422, "invalid", True, True),
        (400, "adapter folder doesn't contain tensors", True, False),  # shared storage lags: retried
        (404, "No adapter found for s3://b/policy-v3", True, False),
        (404, "Not Found", True, True),  # vLLM started without runtime LoRA updating: the route is missing
        (400, "The lora adapter 'policy-v3' has already been loaded.", True, True),
        (409, "conflict", True, True),
    ],
)
def test_which_control_refusals_are_retried(status, text, reads_storage, final):
    from grpo_core.serving.replicas import refusal_is_final

    assert refusal_is_final(status, text, reads_storage) is final


# ----- three embedded replicas ---------------------------------------------------------------------


def _config(log_dir, lora_rank: int, store_url: str) -> RunConfig:
    return RunConfig(
        model=ModelConfig(name=TINY),
        server={
            "backend": "embedded",
            "port": 0,
            "embedded_num_threads": 1,
            "max_model_len": 256,
            "max_num_seqs": 64,
            "log_dir": log_dir,
            "startup_timeout_s": 180,
            "num_replicas": 3,
        },
        rollout={"max_completion_length": 64, "num_sampler_logprobs": 4},
        train={"adapter_store": store_url, "lora": {"enabled": True, "r": lora_rank}},
    )


@pytest.fixture(scope="module")
def store_url(tmp_path_factory) -> str:
    """``train.adapter_store`` of the replicas: an fsspec URL (their guard loads adapters from below it only)."""
    return f"file://{tmp_path_factory.mktemp('bucket')}"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, store_url):
    """Three embedded replicas; the third accepts LoRA ranks up to 8 only (it refuses a rank-16 adapter)."""
    log_dir = tmp_path_factory.mktemp("replicas")
    specs = [
        embedded_command(_config(log_dir, 16, store_url), 0),
        embedded_command(_config(log_dir, 16, store_url), 1),
        embedded_command(_config(log_dir, 8, store_url), 2),
    ]
    token = ensure_run_token()  # the replicas check it; the clients send it (GRPO_RUN_TOKEN)
    handles = [launch(spec, token) for spec in specs]
    try:
        for handle in handles:
            wait_healthy(handle, 180, token)
        yield handles
    finally:
        teardown(handles)


async def _group(rs: ReplicaSet, key, n: int, tokens: int = T) -> list:
    outs = await asyncio.gather(
        *(
            rs.complete(PROMPT, affinity_key=key, model=TINY, max_tokens=tokens, seed=i, ignore_eos=True)
            for i in range(n)
        )
    )
    return [o[0] for o in outs]


def test_affinity_sends_each_group_to_one_replica(replicas):
    urls = [h.url for h in replicas]
    window = MetricWindow()

    async def go():
        async with ReplicaSet(urls, sink=window) as rs:
            for group in range(6):
                before = [generated(u) for u in urls]
                outs = await _group(rs, group, 8)
                assert all(len(o.token_ids) == T for o in outs)
                delta = [generated(u) - b for u, b in zip(urls, before)]
                served.append([i for i, d in enumerate(delta) if d])
                amounts.append(sorted(delta))

    served, amounts = [], []
    run(go())
    assert served == [[0], [1], [2], [0], [1], [2]]
    assert amounts == [[0, 0, 8 * T]] * 6
    metrics = window.flush()
    assert metrics["router/affinity_hit_frac"] == pytest.approx(7 / 8)
    assert metrics["router/unmatched_frac"] == pytest.approx(1 / 8) and metrics["router/spill_frac"] == 0


def test_skewed_load_spills_to_the_least_loaded(replicas):
    """12 requests of one key at once, imbalance 8: request 1 is unmatched (replica 0), 2-9 hit, 10 and 11 spill
    (replicas 1 and 2: replica 0 then holds 9 beyond the least loaded), 12 hits again (8 beyond)."""
    urls = [h.url for h in replicas]
    window = MetricWindow()
    before = [generated(u) for u in urls]

    async def go():
        async with ReplicaSet(urls, route_imbalance=8, sink=window) as rs:
            return await _group(rs, "hot", 12)

    outs = run(go())
    assert all(len(o.token_ids) == T for o in outs)
    assert [generated(u) - b for u, b in zip(urls, before)] == [10 * T, T, T]
    metrics = window.flush()
    assert metrics["router/spill_frac"] == pytest.approx(2 / 12)
    assert metrics["router/affinity_hit_frac"] == pytest.approx(9 / 12)


def _published(store_url: str, tmp_path, name: str, rank: int) -> str:
    """A random rank-``rank`` adapter published to the store as ``name``; returns the URL servers load."""
    from grpo_core.train.weight_sync.adapter_store import AdapterStore

    local = _adapter(tmp_path / "local" / name, rank)
    return AdapterStore(store_url, timeout_s=30).publish(Path(local), name)


def _adapter(path, rank: int) -> str:
    import torch
    from peft import LoraConfig, get_peft_model

    from grpo_core.models import load_model

    torch.manual_seed(rank)
    base = load_model(ModelConfig(name=TINY))[0]
    get_peft_model(
        base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ).save_pretrained(path)
    return str(path)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def listed(url: str) -> list[str]:
    return [
        card["id"]
        for card in httpx.get(url + "/v1/models", headers=bearer_headers(run_token()), timeout=10).json()["data"]
    ]


def test_adapter_load_is_all_or_nothing(replicas, store_url, tmp_path):
    urls = [h.url for h in replicas]
    wide, narrow = _published(store_url, tmp_path, "wide-r16", 16), _published(store_url, tmp_path, "narrow-r8", 8)

    async def go():
        async with ReplicaSet(urls, control_retry_s=0.2, control_timeout_s=1.0) as rs:
            with pytest.raises(ControlFanOutError) as refused:
                await rs.fan_out(
                    "load policy-v2",
                    lambda c: c.load_lora_adapter("policy-v2", wide),
                    undo=lambda c: c.unload_lora_adapter("policy-v2"),
                )
            after_refusal = [listed(u) for u in urls]
            await rs.fan_out(
                "load policy-v1",
                lambda c: c.load_lora_adapter("policy-v1", narrow),
                undo=lambda c: c.unload_lora_adapter("policy-v1"),
            )
            loaded = [listed(u) for u in urls]
            await rs.fan_out("unload policy-v1", lambda c: c.unload_lora_adapter("policy-v1"))
            return refused.value, after_refusal, loaded

    refused, after_refusal, loaded = run(go())
    assert list(refused.failed) == [urls[2]] and sorted(refused.rolled_back) == sorted(urls[:2])
    assert after_refusal == [[TINY]] * 3, "rollback leaves no replica on the new version"
    assert loaded == [[TINY, "policy-v1"]] * 3


def test_adapter_load_retries_until_the_store_shows_it(replicas, store_url, tmp_path):
    """Shared storage lags: a load asked before the store shows the adapter keeps retrying on every replica
    (server.control_retry_s), and succeeds everywhere once the trainer's publish lands; each replica fetched
    it from the fsspec URL and samples through it (greedy tokens alike everywhere, unlike the base model's)."""
    from grpo_core.train.weight_sync.adapter_store import AdapterStore

    urls = [h.url for h in replicas]
    local = Path(_adapter(tmp_path / "local" / "policy-v5", 8))
    store = AdapterStore(store_url, timeout_s=30)
    url = store.served_path(local, "policy-v5")

    async def go():
        async with ReplicaSet(urls, control_retry_s=0.2, control_timeout_s=120) as rs:
            load = asyncio.create_task(
                rs.fan_out(
                    "load policy-v5",
                    lambda c: c.load_lora_adapter("policy-v5", url),
                    undo=lambda c: c.unload_lora_adapter("policy-v5"),
                    reads_storage=True,
                )
            )
            await asyncio.sleep(1.5)
            waiting = not load.done()
            await asyncio.to_thread(store.publish, local, "policy-v5")
            await load
            names = [listed(u) for u in urls]
            greedy = dict(max_tokens=8, temperature=0, ignore_eos=True)
            adapted = [(await c.complete(PROMPT, model="policy-v5", **greedy))[0] for c in rs.clients]
            base = (await rs.clients[0].complete(PROMPT, model=TINY, **greedy))[0]
            await rs.fan_out("unload policy-v5", lambda c: c.unload_lora_adapter("policy-v5"))
            return waiting, names, adapted, base

    waiting, names, adapted, base = run(go())
    assert waiting, "the load must not succeed before the store shows the adapter"
    assert names == [[TINY, "policy-v5"]] * 3
    assert len({tuple(o.token_ids) for o in adapted}) == 1
    assert adapted[0].logprobs != base.logprobs
    assert [listed(u) for u in urls] == [[TINY]] * 3


def test_a_refusal_no_retry_changes_fails_the_fan_out_at_once(replicas, caplog):
    """A 403 (a path outside every replica's allowed folder) was retried for the whole server.control_timeout_s
    (60 s) before the same error; it now fails on the first answer, with no retry logged."""
    urls = [h.url for h in replicas]

    async def go():
        async with ReplicaSet(urls, control_retry_s=0.2, control_timeout_s=600) as rs:
            with pytest.raises(ControlFanOutError) as refused:
                await rs.fan_out(
                    "load outside",
                    lambda c: c.load_lora_adapter("outside", "/etc"),
                    undo=lambda c: c.unload_lora_adapter("outside"),
                )
            return refused.value

    with caplog.at_level("WARNING", logger="grpo_core.serving.replicas"):
        refused = run(go())
    assert sorted(refused.failed) == sorted(urls) and not refused.rolled_back
    assert all("answered 403" in e and "not retried: a 403 does not change" in e for e in refused.failed.values())
    assert "retrying" not in caplog.text
    assert [listed(u) for u in urls] == [[TINY]] * 3


def _restart(handle: ServerHandle) -> ServerHandle:
    port = int(handle.url.rsplit(":", 1)[1])
    argv = list(handle.spec.argv)
    argv[argv.index("--port") + 1] = str(port)
    new = launch(dataclasses.replace(handle.spec, argv=argv, port=port), run_token())
    wait_healthy(new, 180, run_token())
    return new


def test_replica_killed_mid_run_is_routed_around_and_rejoins(replicas):
    urls = [h.url for h in replicas]
    window = MetricWindow()
    victim = replicas[1]

    async def go():
        async with ReplicaSet(urls, sink=window, max_retries=3, backoff_s=0.1) as rs:
            tasks = [asyncio.create_task(_group(rs, ("kill", g), 4, tokens=48)) for g in range(3)]

            async def victim_decoding() -> bool:
                return generated(urls[1]) != victim_start or all(t.done() for t in tasks)

            await async_wait_until(victim_decoding, "replica 1 to decode a request of the groups", 120)
            os.killpg(victim.process.pid, signal.SIGKILL)
            victim.process.wait(30)
            tasks.append(asyncio.create_task(_group(rs, ("kill", 1), 4, tokens=48)))  # homed on the dead replica
            outs = [o for group in await asyncio.gather(*tasks) for o in group]
            down_while_dead = list(rs.policy.healthy)
            replicas[1] = _restart(victim)

            async def rejoined() -> bool:
                return rs.policy.healthy[1]

            await async_wait_until(rejoined, "the restarted replica 1 to be marked healthy again", 120, 0.2)
            before = generated(urls[1])
            for g in range(3):
                await _group(rs, ("after", g), 4)
            return outs, down_while_dead, generated(urls[1]) - before

    victim_start = generated(urls[1])
    outs, down_while_dead, after = run(go())
    with pytest.raises(ProcessLookupError):
        os.kill(victim.process.pid, 0)
    assert victim.process.returncode == -signal.SIGKILL
    assert len(outs) == 16 and all(len(o.token_ids) == 48 for o in outs), "every request finished elsewhere"
    assert down_while_dead == [True, False, True]
    assert window.flush()["router/replica_down_count"] == 1
    assert replicas[1].url == urls[1] and after == 4 * T, "the restarted replica serves a new group again"


def test_router_cli_help_is_instant():
    out = subprocess.run(
        [os.sys.executable, "-m", "grpo_core.serving.router", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--url" in out.stdout


def _router(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [os.sys.executable, "-m", "grpo_core.serving.router", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["--url", "ftp://gpu-1"], "--url: 'ftp://gpu-1' is not an http(s) base URL; write e.g. 'http://gpu-1:8000'"),
        (
            ["--url", "http://gpu-1:8000", "--url", "http://GPU-1:8000/"],
            "--url lists one server twice ('http://gpu-1:8000' and 'http://GPU-1:8000/'): give each replica once",
        ),
        (["--url", "http://gpu-1:8000/v1"], "--url: 'http://gpu-1:8000/v1' ends in /v1"),
        (
            ["--url", "http://gpu-1:8000", "--route-imbalance", "-1", "--control-timeout-s", "0"],
            "--route-imbalance: Input should be greater than or equal to 0; "
            "--control-timeout-s: Input should be greater than 0",
        ),
    ],
)
def test_router_cli_refuses_bad_arguments_in_one_line_naming_the_flag(args, says):
    out = _router([*args, "--port", "0"], {**os.environ, "GRPO_RUN_TOKEN": "t"})
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and last.startswith(f"python -m grpo_core.serving.router: error: {says}"), out.stderr
    assert "Traceback" not in out.stderr and "pydantic" not in out.stderr


def test_router_cli_on_a_taken_port_without_a_token_or_in_front_of_itself_says_so_in_one_line():
    import socket

    env = {k: v for k, v in os.environ.items() if k not in ("GRPO_RUN_TOKEN", "GRPO_SERVER_API_KEY")}
    bare = _router(["--url", "http://127.0.0.1:9", "--port", "0"], env)
    assert bare.returncode == 1 and bare.stderr.strip().startswith(
        "neither GRPO_RUN_TOKEN nor GRPO_SERVER_API_KEY is set"
    ), bare.stderr
    accented = _router(["--url", "http://127.0.0.1:9", "--port", "0"], {**env, "GRPO_SERVER_API_KEY": "tök-secret"})
    assert accented.returncode == 1 and accented.stderr.strip().startswith(
        "GRPO_SERVER_API_KEY: it holds 1 character(s) an HTTP header cannot carry"
    ), accented.stderr
    assert "Traceback" not in accented.stderr and "tök-secret" not in accented.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _router(["--url", "http://127.0.0.1:9", "--port", str(port)], {**env, "GRPO_SERVER_API_KEY": "k"})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"cannot listen on 127.0.0.1:{port}: Address already in use")
    # the port is free again: a --url naming the router itself (each request would come back to it) is refused
    self_loop = _router(["--url", f"http://localhost:{port}", "--port", str(port)], {**env, "GRPO_SERVER_API_KEY": "k"})
    assert self_loop.returncode == 2 and self_loop.stderr.strip().splitlines()[-1] == (
        f"python -m grpo_core.serving.router: error: --url: 'http://localhost:{port}' is this router "
        f"(127.0.0.1:{port}); give the replicas' URLs"
    ), self_loop.stderr


def test_external_servers_that_refuse_the_runs_token_fail_the_start_naming_the_setting(replicas):
    """``/health`` needs no token, so healthy servers that refuse the run's key would fail every request later."""
    from grpo_core.config import ServerConfig
    from grpo_core.errors import ConfigError
    from grpo_core.serving.replicas import wait_external

    urls = [h.url for h in replicas]
    assert wait_external(ServerConfig(urls=urls, startup_timeout_s=30)) == urls  # the replicas' token: accepted
    with pytest.raises(ConfigError) as info:
        wait_external(ServerConfig(urls=urls, api_key="not-their-key-123", startup_timeout_s=30))
    assert str(info.value).startswith(
        f"server.urls: {urls[0]} refuses the bearer token this run sends (HTTP 401); set server.api_key"
    ) and "not-their-key-123" not in str(info.value)


def test_router_with_a_token_the_replicas_refuse_does_not_start(replicas):
    """Its clients would all get 401 whatever token they hold: the router says whose token is wrong instead."""
    env = {**{k: v for k, v in os.environ.items() if k != "GRPO_SERVER_API_KEY"}, "GRPO_RUN_TOKEN": "not-theirs"}
    out = _router([a for h in replicas for a in ("--url", h.url)] + ["--port", "0"], env)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"{replicas[0].url} refuses the bearer token this router sends to the replicas (GRPO_RUN_TOKEN of the "
            "router's environment)"
        )
    ), out.stderr


@pytest.fixture
def dead_urls():
    """Two replica URLs whose ports the test holds, bound but not listening: a connection is refused, and no other
    process (another xdist worker's server) can take a port meanwhile, as one given up by ``free_port`` could."""
    with refusing_ports(2) as ports:
        yield [f"http://127.0.0.1:{port}" for port in ports]


def test_router_answers_503_naming_the_cause_when_every_replica_is_down(dead_urls):
    from fastapi.testclient import TestClient

    from grpo_core.serving.router.app import create_router_app

    dead = dead_urls  # ports this test holds without listening: connections are refused
    replicas = ReplicaSet(dead, api_key="k", max_retries=1, backoff_s=0.01, max_backoff_s=0.01)
    auth = {"Authorization": "Bearer k"}
    with TestClient(create_router_app(replicas, api_key="k")) as client:
        models = client.get("/v1/models", headers=auth)
        assert models.status_code == 503, models.text
        error = models.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
        assert "no generation replica answered (2 behind this router; 0 healthy)" in error["message"]
        assert dead[0] in error["message"] or dead[1] in error["message"]
        done = client.post("/v1/completions", headers=auth, json={"model": "m", "prompt": "hi"})
        message = done.json()["error"]["message"]
        assert done.status_code == 503 and "no generation replica answered" in message
        named = [url for url in dead if f"{url}: POST {url}/v1/completions" in message]  # each with its own error
        assert named and f"on {len(named)} of 2 replica(s); the last error of each: " in message, message
        assert client.get("/health").status_code == 503
        bad = client.post("/v1/completions", headers=auth, content=b"{not json")
        assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
        assert client.post("/pause", headers=auth, content=b"[").status_code == 400
        client.portal.call(replicas.aclose)


def test_every_route_of_the_router_but_health_is_closed_without_the_token(monkeypatch, dead_urls):
    """Every route and method of the router's app (read from ``app.routes``, so a route added later is covered)
    answers 401 without the servers' key or the run's token, with a wrong one or another scheme; only ``/health``
    answers (503 here: its replicas are down). Either token opens a route."""
    from serving_helpers import BAD_AUTH, OPEN_ROUTES, answers_without_token, app_routes

    from grpo_core.security.auth import TOKEN_ENV
    from grpo_core.serving.protocol import NONCE_PATH
    from grpo_core.serving.router.app import create_router_app

    monkeypatch.setenv(TOKEN_ENV, "the-runs-token-0123")
    dead = dead_urls  # ports this test holds without listening: connections are refused
    replicas = ReplicaSet(dead, api_key="servers-key-0123", max_retries=1, backoff_s=0.01, max_backoff_s=0.01)
    app = create_router_app(replicas, api_key="servers-key-0123")
    routes = app_routes(app)
    known = {("POST", p) for p in ("/pause", "/resume", "/reset_prefix_cache", "/update_weights", "/v1/completions")}
    assert known | {("GET", "/metrics"), ("GET", "/v1/models"), ("GET", NONCE_PATH)} <= set(routes)

    async def go():
        try:
            status = await answers_without_token(app, routes)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
                opened = [
                    (await http.get(NONCE_PATH, headers=bearer_headers(token))).status_code
                    for token in ("servers-key-0123", "the-runs-token-0123")
                ]
            return status, opened
        finally:
            await replicas.aclose()

    status, opened = run(go())
    assert len(status) == len(routes) * len(BAD_AUTH)
    left_open = {key: code for key, code in status.items() if (key[0], key[1]) not in OPEN_ROUTES and code != 401}
    assert left_open == {}, f"answered without a token: {left_open}"
    assert {code for key, code in status.items() if (key[0], key[1]) in OPEN_ROUTES} == {503}
    assert opened == [200, 200]


def test_router_url_routes_by_prefix_checks_the_token_and_fans_out(replicas, store_url, tmp_path):
    """The routed set as one OpenAI-compatible URL: bearer token checked, 8 identical prompts prefilled on one
    replica (server counters), a LoRA load refused by one replica rolled back everywhere."""
    urls = [h.url for h in replicas]
    port_file = tmp_path / "router.port"
    cmd = [
        os.sys.executable,
        "-m",
        "grpo_core.serving.router",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--control-retry-s",
        "0.2",
        "--control-timeout-s",
        "1",
    ] + [a for u in urls for a in ("--url", u)]
    proc = subprocess.Popen(
        cmd,
        env=dict(os.environ),  # GRPO_RUN_TOKEN: the router checks it and passes it on
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while not (port_file.is_file() and port_file.read_text()):
            assert proc.poll() is None, "router exited at start"
        base, auth = f"http://127.0.0.1:{int(port_file.read_text())}", {"Authorization": f"Bearer {run_token()}"}
        while not _answers(base + "/health"):
            assert proc.poll() is None, "router exited at start"
        assert httpx.get(base + "/v1/models", timeout=10).status_code == 401
        assert httpx.get(base + "/v1/models", timeout=10, headers={"Authorization": "Bearer wrong"}).status_code == 401
        before = [generated(u) for u in urls]
        body = {"model": TINY, "prompt": PROMPT, "max_tokens": T, "ignore_eos": True}
        answers = [
            httpx.post(base + "/v1/completions", json={**body, "seed": i}, headers=auth, timeout=60) for i in range(8)
        ]
        assert [a.status_code for a in answers] == [200] * 8
        assert sorted(generated(u) - b for u, b in zip(urls, before)) == [0, 0, 8 * T]
        streamed = httpx.post(base + "/v1/completions", json={**body, "stream": True}, headers=auth, timeout=60)
        assert streamed.status_code == 400 and "stream" in streamed.text  # the replica's own refusal, passed on
        metrics = httpx.get(base + "/metrics", headers=auth, timeout=10).text
        assert 'grpo_router_requests_total{outcome="hit"} 8' in metrics
        assert all(f'grpo_router_inflight{{replica="{i}"}} 0' in metrics for i in range(3))
        wide = _published(store_url, tmp_path, "router-r16", 16)
        refused = httpx.post(
            base + "/v1/load_lora_adapter", headers=auth, timeout=60, json={"lora_name": "policy-v9", "lora_path": wide}
        )
        assert refused.status_code == 502 and urls[2] in refused.json()["error"]["message"]
        assert [listed(u) for u in urls] == [[TINY]] * 3
        # every replica refuses alike (a path outside the adapter folder, 403 from each guard): the client's fault,
        # answered with that status as one server would, not as a gateway failure
        outside = httpx.post(
            base + "/v1/load_lora_adapter", headers=auth, timeout=60, json={"lora_name": "outside", "lora_path": "/etc"}
        )
        assert outside.status_code == 403, outside.text
        assert all(f"{u}: ServerRequestError" in outside.json()["error"]["message"] for u in urls)
        assert [listed(u) for u in urls] == [[TINY]] * 3
        # bodies every replica would refuse alike: 400 at once, nothing fanned out (no retries for the timeout)
        for path, content, says in [
            ("/v1/load_lora_adapter", b"[1, 2]", "must be a JSON object, got list"),
            ("/v1/load_lora_adapter", b'{"lora_name": "x"}', "needs 'lora_path' (a non-empty string)"),
            ("/v1/load_lora_adapter", b"", "needs 'lora_name' and 'lora_path'"),
            ("/v1/unload_lora_adapter", b'{"lora_name": 7}', "needs 'lora_name'"),
            ("/pause", b'"x"', "must be a JSON object, got str"),
        ]:
            bad = httpx.post(base + path, headers=auth, content=content, timeout=60)
            assert bad.status_code == 400 and says in bad.json()["error"]["message"], (path, bad.text)
        # a query every replica refuses (400): not retried, as only calls that read shared storage are
        bogus = httpx.post(base + "/pause", params={"mode": "bogus"}, headers=auth, timeout=60)
        assert bogus.status_code == 400 and bogus.text.count("(not retried: a 400 does not change)") == 3, bogus.text
        assert "mode" in bogus.json()["error"]["message"]
        gone = httpx.post(base + "/v1/unload_lora_adapter", headers=auth, timeout=60, json={"lora_name": "typo"})
        assert gone.status_code == 404 and "no replica holds the LoRA adapter 'typo'" in gone.text, gone.text
        # a refusal no retry changes (the name is taken on every replica): the 400 at once, the adapter kept
        narrow = _published(store_url, tmp_path, "router-r4", 4)
        body = {"lora_name": "router-r4", "lora_path": narrow}
        assert httpx.post(base + "/v1/load_lora_adapter", headers=auth, timeout=60, json=body).status_code == 200
        twice = httpx.post(base + "/v1/load_lora_adapter", headers=auth, timeout=60, json=body)
        assert twice.status_code == 400 and twice.text.count("has already been loaded") == 3, twice.text
        assert twice.text.count("(not retried: a 400 does not change)") == 3
        assert [listed(u) for u in urls] == [[TINY, "router-r4"]] * 3  # nothing rolled back: no replica took it
        assert (
            httpx.post(
                base + "/v1/unload_lora_adapter", headers=auth, timeout=60, json={"lora_name": "router-r4"}
            ).status_code
            == 200
        )

        async def through_client():  # the project's client with server.api_key, as the rollout talks to a remote set
            async with GenerationClient(base, api_key=run_token(), max_retries=0) as c:
                out = await c.complete(PROMPT, model=TINY, max_tokens=T, ignore_eos=True)
            async with GenerationClient(base, api_key="not-the-token", max_retries=0) as c:
                with pytest.raises(ServerRequestError, match="server.api_key") as denied:
                    await c.models()
            return out, denied.value

        out, denied = run(through_client())
        assert len(out[0].token_ids) == T and denied.status == 401
    finally:
        proc.terminate()
        proc.wait(30)
    assert proc.returncode is not None


def test_rollout_groups_stick_to_one_replica_and_log_router_metrics(replicas):
    """The rollout loop's own path: each group's rollouts (affinity key = group id) reach one replica only."""
    from grpo_core.config import RolloutConfig
    from grpo_core.rollout import LoopRuntime, RolloutLoop
    from grpo_core.rollout.pace import TokenAllowance
    from grpo_core.rollout.window import MetricWindow as RolloutWindow

    class Queue:
        def put_group(self, prompt_index, samples, tokens):
            pass

        def consumed(self, prompt_index):
            pass

    urls = [h.url for h in replicas]
    window = RolloutWindow()
    runtime = LoopRuntime(
        tokenizer=None,
        server=ReplicaSet(urls, sink=window),
        model_name=TINY,
        max_model_len=256,
        dataset=[],
        queue=Queue(),
        allowance=TokenAllowance(1, 10_000),
        window=window,
    )
    loop = RolloutLoop(RolloutConfig(num_generations=4, max_completion_length=6, num_sampler_logprobs=2), runtime)
    loop.render = lambda messages, schemas=None: PROMPT
    moved = []

    async def go():
        for group in range(3):
            before = [generated(u) for u in urls]
            await loop.run_group(prompt_index=100 + group, row_index=group, epoch=0, row={"prompt": "hi"})
            moved.append([i for i, (u, b) in enumerate(zip(urls, before)) if generated(u) > b])
        await runtime.server.aclose()

    run(go())
    loop.executor.shutdown()
    assert sorted(len(m) for m in moved) == [1, 1, 1] and sorted(m[0] for m in moved) == [0, 1, 2]
    metrics = window.flush()
    assert metrics["router/affinity_hit_frac"] == pytest.approx(3 / 4)


def test_external_urls_are_waited_for_and_a_dead_one_is_named(replicas):
    from grpo_core.config import ServerConfig
    from grpo_core.errors import ServerStartError
    from grpo_core.serving.replicas import wait_external

    urls = [h.url for h in replicas]
    assert wait_external(ServerConfig(urls=[u + "/" for u in urls])) == urls
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    with pytest.raises(ServerStartError, match=r"server.urls: http://127.0.0.1:9 did not answer.*server.api_key"):
        wait_external(ServerConfig(urls=[urls[0], dead], startup_timeout_s=1))


@pytest.mark.parametrize("port, says", [("70000", "70000 is outside 0..65535"), ("-5", "-5 is outside 0..65535")])
def test_the_servers_command_lines_refuse_a_port_outside_the_tcp_range_in_one_line(capsys, port, says):
    """--port 70000 reached bind() and ended in an OverflowError traceback (router, embedded server, simulator)."""
    from grpo_core.serving.embedded.server import build_parser as embedded_parser
    from grpo_core.serving.router.server import build_parser as router_parser
    from grpo_core.serving.simulated.__main__ import parse_args as simulated_args

    commands = [
        (router_parser().parse_args, ["--url", "http://127.0.0.1:9"]),
        (embedded_parser().parse_args, ["--model", "tiny-llama"]),
        (simulated_args, []),
    ]
    for parse, args in commands:
        with pytest.raises(SystemExit) as exit_:
            parse([*args, "--port", port])
        assert exit_.value.code == 2
        assert f"argument --port: {says}" in capsys.readouterr().err
