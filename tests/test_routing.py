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

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import TINY, run

from grpo_core.config import ModelConfig, RunConfig
from grpo_core.metrics import MetricWindow
from grpo_core.serving.routing import HIT, SPILL, UNMATCHED, ControlFanOutError, ReplicaSet, RoutingPolicy
from grpo_core.serving.vllm import ServerHandle, embedded_command, launch, teardown, wait_healthy

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


# ----- three embedded replicas ---------------------------------------------------------------------


def _config(log_dir, lora_rank: int) -> RunConfig:
    return RunConfig(model=ModelConfig(name=TINY), server={
        "backend": "embedded", "port": 0, "embedded_num_threads": 1, "max_model_len": 256, "max_num_seqs": 64,
        "log_dir": log_dir, "startup_timeout_s": 180, "num_replicas": 3, "enable_lora": True, "lora_rank": lora_rank},
        rollout={"max_completion_length": 64, "num_sampler_logprobs": 4})


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Three embedded replicas; the third accepts LoRA ranks up to 8 only (it refuses a rank-16 adapter)."""
    log_dir = tmp_path_factory.mktemp("replicas")
    specs = [embedded_command(_config(log_dir, 16), 0), embedded_command(_config(log_dir, 16), 1),
             embedded_command(_config(log_dir, 8), 2)]
    handles = [launch(spec) for spec in specs]
    try:
        for handle in handles:
            wait_healthy(handle, 180)
        yield handles
    finally:
        teardown(handles)


def generated(url: str) -> float:
    """The server's own count of generated tokens."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:generation_tokens_total")


async def _group(rs: ReplicaSet, key, n: int, tokens: int = T) -> list:
    outs = await asyncio.gather(*(rs.complete(PROMPT, affinity_key=key, model=TINY, max_tokens=tokens, seed=i,
                                              ignore_eos=True) for i in range(n)))
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


def _adapter(path, rank: int) -> str:
    import torch
    from peft import LoraConfig, get_peft_model

    from grpo_core.models import load_model

    torch.manual_seed(rank)
    base = load_model(ModelConfig(name=TINY))[0]
    get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                                    init_lora_weights=False)).save_pretrained(path)
    return str(path)


def listed(url: str) -> list[str]:
    return [card["id"] for card in httpx.get(url + "/v1/models", timeout=10).json()["data"]]


def test_adapter_load_is_all_or_nothing(replicas, tmp_path):
    urls = [h.url for h in replicas]
    wide, narrow = _adapter(tmp_path / "r16", 16), _adapter(tmp_path / "r8", 8)

    async def go():
        async with ReplicaSet(urls, control_retry_s=0.2, control_timeout_s=1.0) as rs:
            with pytest.raises(ControlFanOutError) as refused:
                await rs.fan_out("load policy-v2", lambda c: c.load_lora_adapter("policy-v2", wide),
                                 undo=lambda c: c.unload_lora_adapter("policy-v2"))
            after_refusal = [listed(u) for u in urls]
            await rs.fan_out("load policy-v1", lambda c: c.load_lora_adapter("policy-v1", narrow),
                             undo=lambda c: c.unload_lora_adapter("policy-v1"))
            loaded = [listed(u) for u in urls]
            await rs.fan_out("unload policy-v1", lambda c: c.unload_lora_adapter("policy-v1"))
            return refused.value, after_refusal, loaded
    refused, after_refusal, loaded = run(go())
    assert list(refused.failed) == [urls[2]] and sorted(refused.rolled_back) == sorted(urls[:2])
    assert after_refusal == [[TINY]] * 3, "rollback leaves no replica on the new version"
    assert loaded == [[TINY, "policy-v1"]] * 3


def _restart(handle: ServerHandle) -> ServerHandle:
    port = int(handle.url.rsplit(":", 1)[1])
    argv = list(handle.spec.argv)
    argv[argv.index("--port") + 1] = str(port)
    new = launch(dataclasses.replace(handle.spec, argv=argv, port=port))
    wait_healthy(new, 180)
    return new


def test_replica_killed_mid_run_is_routed_around_and_rejoins(replicas):
    urls = [h.url for h in replicas]
    window = MetricWindow()
    victim = replicas[1]

    async def go():
        async with ReplicaSet(urls, sink=window, max_retries=3, backoff_s=0.1) as rs:
            tasks = [asyncio.create_task(_group(rs, ("kill", g), 4, tokens=48)) for g in range(3)]
            while generated(urls[1]) == victim_start and not all(t.done() for t in tasks):
                await asyncio.sleep(0.05)
            os.killpg(victim.process.pid, signal.SIGKILL)
            victim.process.wait(30)
            tasks.append(asyncio.create_task(_group(rs, ("kill", 1), 4, tokens=48)))  # homed on the dead replica
            outs = [o for group in await asyncio.gather(*tasks) for o in group]
            down_while_dead = list(rs.policy.healthy)
            replicas[1] = _restart(victim)
            while not rs.policy.healthy[1]:
                await asyncio.sleep(0.2)
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
    out = subprocess.run([os.sys.executable, "-m", "grpo_core.serving.router", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--url" in out.stdout
