"""Full-weight sync against real recording HTTP servers: vLLM's (NCCL and IPC) request bodies, failures and
fan-out over two servers, and the embedded server's disk sync (pause all, update all, roll back, resume all).

NCCL needs two GPUs and IPC a CUDA device, which CI never has; both ran against a real vLLM
0.25.1 on an H200 (benchmarks/vllm_weight_sync.py, scripts/gpu_main_job.sh). Here vLLM's
trainer-side calls are replaced by stand-ins that behave as vLLM 0.25.1's source does
(``nccl_common.trainer_init``, ``NCCLWeightTransferEngine.trainer_send_weights`` broadcasting each tensor it is
given), the CUDA IPC handle of the packed buffer by one naming the buffer's address, and each vLLM server is a real
HTTP server that records every request and can be told to fail one path (the fake generation server,
tests/support/fake_generation.py). What is asserted comes from vLLM's API, not
from this module: pause in keep mode (vLLM aborts in-flight requests without it), the init info of the NCCL group,
the packed update bodies (``IPCWeightTransferUpdateInfo`` / ``NCCLWeightTransferUpdateInfo`` fields), and that every
paused server is finished and resumed after a failure. Each server runs behind the run's guard
(``grpo_core.serving.guard``), whose fence takes a replica whose update failed out of routing (a ``ReplicaSet`` over
the servers shows it). tests/unit/train/test_sync_buffer.py checks the buffer's bytes as vLLM unpacks them.
"""

from __future__ import annotations

import asyncio
import base64
import pickle
import sys
import threading
import types

import pytest
import torch
from fake_generation import FakeGeneration
from waiting import wait_until

from grpo_core.errors import ServingError
from grpo_core.serving.guard import RunGuardMiddleware
from grpo_core.serving.protocol import COMPLETIONS_PATH, PAUSE_PATH, START_WEIGHT_UPDATE_PATH, UPDATE_WEIGHTS_PATH
from grpo_core.train.weight_sync.vllm import VllmWeightTransferSync

CLEANUP = [
    ("/finish_weight_update", {}),
    ("/reset_prefix_cache", {"reset_running_requests": ["true"]}),
    ("/resume", {}),
]


TOKEN = "test-run-token"


def stub_vllm(monkeypatch, sent: list) -> None:
    """Install stand-ins for the vLLM trainer-side modules the NCCL sync imports, and for the CUDA IPC handle."""
    from grpo_core.train.weight_sync import vllm as vllm_sync

    def trainer_init(info):
        sent.append(("trainer_init", info["world_size"], info["rank_offset"]))
        return f"group-{len([s for s in sent if s[0] == 'trainer_init'])}"

    class NcclEngine:
        @staticmethod
        def trainer_send_weights(iterator, args):  # vLLM 0.25.1 (not packed): one broadcast per tensor given
            sent.extend(("broadcast", name, tensor.numel(), args["group"]) for name, tensor in iterator)

    def ipc_handle(buffer: torch.Tensor) -> dict:
        sent.append(("ipc_handle", buffer.numel()))
        return {"GPU-test-uuid": ("handle", buffer.numel())}

    monkeypatch.setattr(vllm_sync, "cuda_ipc_handle", ipc_handle)
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    modules = {
        "nccl_common": {"trainer_init": trainer_init},
        "nccl_engine": {"NCCLWeightTransferEngine": NcclEngine},
    }
    for short, attrs in modules.items():
        module = types.ModuleType(f"vllm.distributed.weight_transfer.{short}")
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, module.__name__, module)


def tiny_policy() -> torch.nn.Module:
    policy = torch.nn.Module()
    policy.lm = torch.nn.Module()
    policy.lm.attn = torch.nn.Module()
    policy.lm.attn.q_proj = torch.nn.Linear(3, 2).to(torch.bfloat16)
    return policy


def per_sync(update: bool = True, first: bool = False) -> list[tuple[str, dict]]:
    """One sync's requests to a replica; a replica that took the update has its fence lowered (whoever raised it:
    this trainer, an earlier one, the servers' flow that started it again with the base weights)."""
    steps = [("/pause", {"mode": ["keep"]}), ("/start_weight_update", {})]
    return steps + ([("/update_weights", {})] if update else []) + CLEANUP + ([("/grpo/stale", {})] if update else [])


@pytest.fixture
def servers():
    """Makes vLLM servers: the fake generation server behind the run's guard (``RunGuardMiddleware``, as every server
    the run starts has), recording every request as it arrives; ``fail`` maps a route to the status it answers."""
    made: list[FakeGeneration] = []

    def make(fail: dict[str, int] | None = None, weights_dir=None) -> FakeGeneration:
        fake = FakeGeneration(
            middleware=lambda app: RunGuardMiddleware(app, token=TOKEN, max_pause_s=0, weights_dir=weights_dir)
        )
        for route, status in (fail or {}).items():
            fake.script(route, status=status)
        made.append(fake.start())
        return fake

    yield make
    for s in made:
        s.stop()


def test_nccl_sync_bodies_on_two_servers(monkeypatch, servers):
    sent: list = []
    stub_vllm(monkeypatch, sent)
    a, b = servers(), servers()
    sync = VllmWeightTransferSync([a.url, b.url], "nccl", api_key=TOKEN)
    for version in (1, 2):
        stats = sync.sync(tiny_policy(), version, rank=0)
        assert min(v for k, v in stats.items() if k.startswith("perf/")) >= 0
        # generation is paused only around the copy: the gather comes before, the update and settle inside
        assert stats["perf/weight_sync_pause_s"] >= stats["perf/weight_sync_update_s"]
        assert (
            stats["perf/weight_sync_transfer_s"]
            >= stats["perf/weight_sync_gather_s"] + stats["perf/weight_sync_pause_s"] - 1e-6
        )
    for server in (a, b):
        assert [(r.method, r.route) for r in server.requests][:2] == [
            ("GET", "/get_world_size"),
            ("POST", "/init_weight_transfer_engine"),
        ]
        assert server.posts()[1:] == per_sync(first=True) + per_sync()
        init = server.body("/init_weight_transfer_engine")["init_info"]
        assert init["master_address"] == "127.0.0.1" and init["rank_offset"] == 1 and init["world_size"] == 2
        assert 0 < init["master_port"] < 65536
        assert server.body("/start_weight_update") == {"is_checkpoint_format": True}
        # vLLM's packed NCCL update: weight then bias (bf16, 12 + 4 bytes) in one buffer, one broadcast
        assert server.body("/update_weights") == {
            "update_info": {
                "names": ["attn.q_proj.weight", "attn.q_proj.bias"],
                "dtype_names": ["bfloat16", "bfloat16"],
                "shapes": [[2, 3], [2]],
                "packed": True,
                "packed_buffer_size_bytes": (6 + 2) * 2,
            }
        }
    ports = {s.body("/init_weight_transfer_engine")["init_info"]["master_port"] for s in (a, b)}
    assert len(ports) == 2, "each server needs its own NCCL group"
    assert sent[:2] == [("trainer_init", 2, 1), ("trainer_init", 2, 1)]
    # one broadcast of the whole buffer per replica and sync (the replicas' round trips run in parallel)
    assert sorted(sent[2:]) == sorted(
        ("broadcast", "packed-weights", 16, g) for _ in (1, 2) for g in ("group-1", "group-2")
    )


def test_ipc_sync_frames_the_handles_as_vllm_http_transport(monkeypatch, servers):
    sent: list = []
    stub_vllm(monkeypatch, sent)
    a, b = servers(), servers()
    sync = VllmWeightTransferSync([a.url, b.url], "ipc", lora_names=True, api_key=TOKEN)
    sync.sync(tiny_policy(), 1, rank=0)
    sync.sync(tiny_policy(), 2, rank=0)
    names = ["attn.q_proj.base_layer.weight", "attn.q_proj.base_layer.bias"]  # --enable-lora wraps the linear layers
    assert sent == [("ipc_handle", 16)], "one handle, for the packed buffer, made once and sent to every server"
    for server in (a, b):
        assert server.posts() == [("/init_weight_transfer_engine", {})] + per_sync(first=True) + per_sync()
        assert server.body("/init_weight_transfer_engine") == {"init_info": {}}
        info = server.body("/update_weights")["update_info"]
        assert set(info) == {"names", "dtype_names", "shapes", "packed", "tensor_sizes", "ipc_handles_pickled"}
        assert (info["names"], info["dtype_names"], info["shapes"], info["packed"], info["tensor_sizes"]) == (
            names,
            ["bfloat16", "bfloat16"],
            [[2, 3], [2]],
            True,
            [12, 4],
        )
        handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
        assert handles == {"GPU-test-uuid": ("handle", 16)}  # packed: one {GPU UUID: handle} for the whole buffer


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_update_failing_on_one_replica_fences_it_off_until_an_update_reaches_it(monkeypatch, servers, backend):
    from grpo_core.serving.replicas import ReplicaSet

    stub_vllm(monkeypatch, [])
    good, bad = servers(), servers(fail={"/update_weights": 500})
    sync = VllmWeightTransferSync([bad.url, good.url], backend, api_key=TOKEN)
    out = sync.sync(tiny_policy(), 1, rank=0)  # the good replica serves version 1: the run goes on
    assert out["weight_sync/failed_replica_count"] == 1 and list(sync.stale) == [bad.url]
    assert good.posts()[-len(per_sync(first=True)) :] == per_sync(first=True)
    # the failed replica is fenced off before it is resumed, and still finished and resumed (never left paused)
    fenced = per_sync()[:3] + [("/grpo/stale", {})] + CLEANUP  # and no fence lifted after the clean-up
    assert bad.posts()[-len(fenced) :] == fenced
    assert bad.body("/grpo/stale")["stale"] is True and "policy version 1" in bad.body("/grpo/stale")["reason"]
    assert [p for p, _ in bad.posts()].count("/resume") == 1 and bad.guard.stale and not good.guard.stale

    async def route(n: int) -> tuple[bool, list[str], int]:
        async with ReplicaSet([bad.url, good.url], api_key=TOKEN, max_retries=2) as rs:
            healthy = await rs.health()
            served = [await rs.routed(("group", i), lambda c: _served_by(c)) for i in range(n)]
            return healthy, served, rs.policy.counts.replica_down

    healthy, served, down = asyncio.run(route(6))
    assert not healthy, "/health of the set is healthy only when every replica is"
    assert served == [good.url] * 6 and down == 1  # routed around, counted once

    bad.script(UPDATE_WEIGHTS_PATH)  # no failure: the next sync reaches it, the fence comes down after its clean-up
    out = sync.sync(tiny_policy(), 2, rank=0)
    assert out["weight_sync/failed_replica_count"] == 0 and not sync.stale and bad.guard.stale is None
    assert bad.posts()[-len(per_sync()) :] == per_sync()  # ending with the fence lifted
    assert bad.requests[-1].body == {"stale": False, "version": 2}  # the fence comes down naming the version it holds
    healthy, served, down = asyncio.run(route(8))
    assert healthy and set(served) == {bad.url, good.url} and down == 0


async def _served_by(client) -> str:
    await client.call("POST", "/v1/completions", {"model": "m", "prompt": [1], "n": 1})
    return client.base_url


def test_update_failing_on_the_only_replica_fails_the_sync_and_resumes_it(monkeypatch, servers):
    stub_vllm(monkeypatch, [])
    bad = servers(fail={"/update_weights": 500})
    sync = VllmWeightTransferSync([bad.url], "ipc", api_key=TOKEN)
    with pytest.raises(ServingError, match=r"failed on every replica.*/update_weights answered 500"):
        sync.sync(tiny_policy(), 1, rank=0)
    assert bad.posts()[-len(CLEANUP) :] == CLEANUP and bad.guard.stale


def test_generation_in_flight_when_the_fence_goes_up_answers_503(servers):
    import httpx

    server = servers()
    hold = threading.Event()  # the completion is being generated
    server.script(COMPLETIONS_PATH, hold_until=hold)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(headers=auth, timeout=30) as http:
        result: list = []
        worker = threading.Thread(
            target=lambda: result.append(http.post(server.url + "/v1/completions", json={"prompt": [1]}))
        )
        worker.start()
        wait_until(
            lambda: server.calls(COMPLETIONS_PATH),
            "the held completion to reach the server",
            30,
            0.01,
        )
        assert (
            http.post(server.url + "/grpo/stale", json={"stale": True, "reason": "update v3 failed"}).status_code == 200
        )
        hold.set()
        worker.join(timeout=30)
        assert result[0].status_code == 503 and "update v3 failed" in result[0].text  # not old-weights tokens
        assert http.get(server.url + "/health").status_code == 503
        assert http.post(server.url + "/v1/completions", json={"prompt": [1]}).status_code == 503
        assert http.post(server.url + "/grpo/stale", json={"stale": "no"}).status_code == 400
        assert http.post(server.url + "/grpo/stale", json={"stale": False}).status_code == 200
        assert http.get(server.url + "/health").status_code == 200
        assert http.post(server.url + "/v1/completions", json={"prompt": [1]}).status_code == 200
    assert httpx.post(server.url + "/grpo/stale", json={"stale": True}).status_code == 401  # the run's token only


@pytest.mark.serial  # two attempts must fit server.control_timeout_s=0.3: alone on the machine
def test_failed_pause_resumes_the_replicas_paused_and_names_the_refusing_one(monkeypatch, servers):
    from grpo_core.serving.replicas import ControlFanOutError

    stub_vllm(monkeypatch, [])
    first, refusing = servers(), servers(fail={"/pause": 500})
    sync = VllmWeightTransferSync(
        [first.url, refusing.url], "ipc", api_key=TOKEN, control_retry_s=0.05, control_timeout_s=0.3
    )
    with pytest.raises(
        ControlFanOutError, match=rf"pause failed on 1 of 2 replicas.*{refusing.url}/pause answered 500"
    ) as err:
        sync.sync(tiny_policy(), 1, rank=0)
    assert list(err.value.failed) == [refusing.url]
    assert (
        first.posts()
        == [("/init_weight_transfer_engine", {}), ("/pause", {"mode": ["keep"]}), ("/start_weight_update", {})]
        + CLEANUP
    )
    pauses = [p for p, _ in refusing.posts()].count("/pause")
    assert pauses >= 2, "a refused pause is retried (server.control_retry_s) before the fan-out fails"
    assert refusing.posts()[-4:] == [("/pause", {"mode": ["keep"]})] + CLEANUP
    assert not any(p in ("/update_weights", "/grpo/stale") for p, _ in first.posts() + refusing.posts())


@pytest.mark.parametrize("status", [401, 404])
def test_a_final_refusal_of_the_pause_ends_the_fan_out_at_once(monkeypatch, servers, status):
    """The full-weight sync asks the one retry policy of control calls (``replicas.control_verdict``): a 401 (wrong
    token) or 404 (a route the server lacks) is not retried for server.control_timeout_s, as for LoRA."""
    from grpo_core.serving.replicas import ControlFanOutError

    stub_vllm(monkeypatch, [])
    first, refusing = servers(), servers(fail={"/pause": status})
    sync = VllmWeightTransferSync(
        [first.url, refusing.url], "ipc", api_key=TOKEN, control_retry_s=0.05, control_timeout_s=30.0
    )
    with pytest.raises(
        ControlFanOutError, match=rf"answered {status}.*not retried: a {status} does not change"
    ) as info:
        sync.sync(tiny_policy(), 1, rank=0)
    assert list(info.value.failed) == [refusing.url] and refusing.url in str(info.value), "names the refusing replica"
    assert [p for p, _ in refusing.posts()].count("/pause") == 1, "a final refusal is asked once"
    assert not any(p == "/update_weights" for p, _ in first.posts() + refusing.posts())


def test_a_restarted_trainer_lowers_the_fence_an_earlier_one_raised(monkeypatch, servers):
    import httpx

    stub_vllm(monkeypatch, [])
    fenced = servers()
    httpx.post(
        fenced.url + "/grpo/stale",
        json={"stale": True, "reason": "update v4 failed"},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert fenced.guard.stale == "update v4 failed"
    sync = VllmWeightTransferSync([fenced.url], "ipc", api_key=TOKEN)  # the resumed trainer re-syncs its version
    assert sync.sync(tiny_policy(), 4, rank=0)["weight_sync/failed_replica_count"] == 0
    assert fenced.guard.stale is None and fenced.posts()[-1] == ("/grpo/stale", {})


@pytest.mark.serial  # two attempts must fit server.control_timeout_s=0.3: alone on the machine
def test_embedded_disk_sync_pauses_every_replica_first_and_rolls_back_a_refused_update(servers, tmp_path):
    from grpo_core.config import ServerConfig
    from grpo_core.serving.replicas import ControlFanOutError
    from grpo_core.train.weight_sync import DiskFullWeightSync

    out = tmp_path / "out"
    weights = out / ".weights"
    good, bad = servers(weights_dir=weights), servers(weights_dir=weights)
    settings = ServerConfig(api_key=TOKEN, control_retry_s=0.05, control_timeout_s=0.3)
    sync = DiskFullWeightSync([good.url, bad.url], out, server=settings)
    sync.sync(tiny_policy(), 1, rank=0)
    phase = [
        ("/pause", {"mode": ["keep"]}),
        ("/start_weight_update", {}),
        ("/update_weights", {}),
        ("/finish_weight_update", {}),
        ("/reset_prefix_cache", {"reset_running_requests": ["true"]}),
        ("/grpo/stale", {}),
        ("/resume", {}),
    ]  # every replica holds v1: any fence comes down
    for server in (good, bad):
        assert server.posts() == phase and server.body("/update_weights") == {
            "update_info": {"path": str(weights / "v1")}
        }
    pauses = [r.number for s in (good, bad) for r in s.calls(PAUSE_PATH)]
    starts = [r.number for s in (good, bad) for r in s.calls(START_WEIGHT_UPDATE_PATH)]
    assert max(pauses) < min(starts), "every replica is paused before any update starts"

    bad.script(UPDATE_WEIGHTS_PATH, status=500)
    good.requests.clear(), bad.requests.clear()
    with pytest.raises(
        ControlFanOutError,
        match=rf"weight sync v2 failed on 1 of 2 replicas.*{bad.url}.*rolled back "
        rf"on {good.url}",
    ):
        sync.sync(tiny_policy(), 2, rank=0)
    bodies = [r.body["update_info"]["path"] for r in good.calls(UPDATE_WEIGHTS_PATH)]
    assert bodies == [str(weights / "v2"), str(weights / "v1")], "the replica that took v2 is restored to v1"
    for server in (good, bad):  # paused once, resumed once: none left paused
        names = [p for p, _ in server.posts()]
        assert names.count("/pause") == 1 and names[-1] == "/resume" and names.count("/resume") == 1
    assert [p for p, _ in bad.posts()].count("/update_weights") >= 2  # retried before the fan-out gave up


# --- a replica that restarted holds the base weights: it refuses later policy versions until a sync reaches it ---


def test_a_guard_no_sync_reached_refuses_later_policy_versions_until_a_sync_names_one(servers):
    import httpx

    from grpo_core.serving.protocol import POLICY_VERSION_HEADER

    server = servers()  # a process just started: it holds the base weights (policy version 0)
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def ask(version: str) -> httpx.Response:
        return httpx.post(
            server.url + "/v1/completions",
            json={"prompt": [1]},
            timeout=30,
            headers={**auth, POLICY_VERSION_HEADER: version},
        )

    assert ask("0").status_code == 200  # the base weights are policy version 0 of a fresh run
    assert httpx.post(server.url + "/v1/completions", json={"prompt": [1]}, headers=auth).status_code == 200
    assert ask("x").status_code == 400
    refused = ask("3")
    assert refused.status_code == 503 and "PolicyVersionBehind" in refused.text and "base weights" in refused.text
    assert httpx.get(server.url + "/health").status_code == 503  # out of every router until a sync reaches it
    assert ask("0").status_code == 503
    lifted = httpx.post(server.url + "/grpo/stale", json={"stale": False, "version": 3}, headers=auth)
    assert lifted.status_code == 200 and lifted.json() == {"stale": False, "policy_version": 3}
    assert httpx.get(server.url + "/health").status_code == 200
    # a request for the next version may arrive while that sync still runs: a replica a sync reached is not behind
    assert ask("4").status_code == 200 and ask("3").status_code == 200
    for bad in ({"stale": False, "version": -1}, {"stale": False, "version": "3"}, {"stale": False, "version": True}):
        assert httpx.post(server.url + "/grpo/stale", json=bad, headers=auth).status_code == 400, bad
    assert server.guard.policy_version == 3


def test_routing_sends_a_refused_version_to_a_replica_that_holds_it_and_reports_the_one_behind(servers):
    import httpx

    from grpo_core.errors import ReplicaBehindError
    from grpo_core.serving.protocol import POLICY_VERSION_HEADER
    from grpo_core.serving.replicas import ReplicaSet

    behind, synced = servers(), servers()
    httpx.post(
        synced.url + "/grpo/stale", json={"stale": False, "version": 2}, headers={"Authorization": f"Bearer {TOKEN}"}
    ).raise_for_status()
    body, version = {"model": "m", "prompt": [1], "n": 1}, {POLICY_VERSION_HEADER: "2"}

    async def route():
        async with ReplicaSet([behind.url, synced.url], api_key=TOKEN, max_retries=3, behind_wait_s=0.0) as rs:
            rs.policy.inflight[1] = 100  # the key's first choice is the replica behind
            served = await rs.routed(("group", 0), lambda c: _served_with(c, body, version))
            seen_behind = set(rs.behind)
            rs.policy.inflight[1] = 0
            async with ReplicaSet([behind.url], api_key=TOKEN, max_retries=1, behind_wait_s=0.0) as alone:
                with pytest.raises(ReplicaBehindError):
                    await alone.clients[0].call("POST", "/v1/completions", body, headers=version)
            return served, seen_behind

    served, seen_behind = asyncio.run(route())
    assert served == synced.url and seen_behind == {0}
    model_calls = behind.calls(COMPLETIONS_PATH)
    assert model_calls and behind.guard.stale is not None and "policy version 2" in behind.guard.stale


async def _served_with(client, body, headers) -> str:
    await client.call("POST", "/v1/completions", body, headers=headers)
    return client.base_url
