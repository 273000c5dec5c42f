"""The generation server dies mid-run: requests are retried and the rollout carries on once it is back."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from serving_helpers import TINY, embedded_server

from grpo_core.config import RunConfig
from grpo_core.packing import samples_from_arrow
from grpo_core.rollout import start_rollout_process
from grpo_core.run.children import free_port
from grpo_core.transport.flight_client import FlightSource

pytestmark = pytest.mark.slow


def pull_to_end(source: FlightSource, policy_version: int, seen: list, consumed: list) -> None:
    """Pull until the rollout says the dataset is done, adding the samples to ``seen`` and the prompts finished
    without a sample to ``consumed``."""
    while True:
        batch = source.pull(policy_version, timeout_s=90)
        seen += samples_from_arrow(batch.samples)
        consumed += batch.consumed_prompt_indices
        if batch.exhausted:
            return


def test_server_killed_mid_run_retries_and_carries_on(tmp_path):
    port = free_port()
    config = RunConfig(
        model={"name": TINY},
        server={"max_model_len": 256, "port": port},
        rollout={
            "num_generations": 2,
            "max_completion_length": 8,
            "num_sampler_logprobs": 2,
            "max_retries": 8,
            "first_step_tokens": 40,
            "max_staleness": 1,
            "concurrency_poll_s": 0.5,
            "rollout_worker_timeout_s": 60,
            "dataset": "rollout_helpers:rows",
            "dataset_kwargs": {"n": 6},
            "reward_functions": ["rollout_helpers:parity_reward"],
        },
    )
    server = embedded_server(tmp_path / "first", port=port)
    handle = server.__enter__()
    helpers = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[1] / "support"), os.environ.get("PYTHONPATH")])
    )
    started = start_rollout_process(config, [handle.url], tmp_path / "rollout", env={"PYTHONPATH": helpers})
    source = FlightSource(
        started.wait_location(timeout_s=300),
        max_staleness=1,
        timeout_s=60,
        process=started.process,
        error_path=started.error_path,
    )
    seen, consumed = [], []
    try:
        first = source.pull(0, timeout_s=60)
        seen += samples_from_arrow(first.samples)
        consumed += first.consumed_prompt_indices
        server.__exit__(None, None, None)  # SIGTERM, then SIGKILL: in-flight requests fail
        time.sleep(1.0)
        with embedded_server(tmp_path / "second", port=port):
            pull_to_end(source, 0, seen, consumed)
            metrics = source.metrics()
    finally:
        source.close()
        started.stop()
    assert sorted({s.prompt_index for s in seen} | set(consumed)) == list(range(6))
    assert metrics["rollout/vllm_retry_count"] > 0


def test_a_server_restarted_with_the_base_weights_is_reported_behind_not_sampled_under_a_later_version(tmp_path):
    """Policy version 1 is on the servers (the trainer's sync lowered the fence naming it); the server is killed and
    started again by its owner on the same port: it holds the base weights. The rollout's requests for version 1
    are refused by its guard (503 ``PolicyVersionBehind``) instead of being sampled from the base weights, the pulls
    report the replica behind, and once a sync reaches it (here: its last call, ``{"stale": false, "version": 1}``)
    the rollout finishes every prompt."""
    import httpx

    from grpo_core.security.auth import bearer_headers, run_token
    from grpo_core.serving.launch import relaunch, wait_healthy

    port = free_port()
    config = RunConfig(
        model={"name": TINY},
        server={"max_model_len": 256, "port": port},
        rollout={
            "num_generations": 2,
            "max_completion_length": 8,
            "max_retries": 8,  # rides out the restart window on a loaded box (the group fails otherwise)
            "first_step_tokens": 40,
            "max_staleness": 1,
            "concurrency_poll_s": 0.5,
            "rollout_worker_timeout_s": 120,
            "dataset": "rollout_helpers:rows",
            "dataset_kwargs": {"n": 8},
            "reward_functions": ["rollout_helpers:parity_reward"],
        },
    )
    server = embedded_server(tmp_path / "first", port=port)
    handle = server.__enter__()
    auth = bearer_headers(run_token())

    def lift(version: int) -> None:  # what every full-weight sync's last call does
        httpx.post(
            handle.url + "/grpo/stale", json={"stale": False, "version": version}, headers=auth, timeout=10
        ).raise_for_status()

    helpers = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[1] / "support"), os.environ.get("PYTHONPATH")])
    )
    started = start_rollout_process(config, [handle.url], tmp_path / "rollout", env={"PYTHONPATH": helpers})
    source = FlightSource(
        started.wait_location(timeout_s=300),
        max_staleness=1,
        timeout_s=120,
        process=started.process,
        error_path=started.error_path,
    )
    seen, consumed, behind = [], [], []
    try:
        first = source.pull(0, timeout_s=60)
        seen += samples_from_arrow(first.samples)
        consumed += first.consumed_prompt_indices
        lift(1)
        source.report(1, sum(len(s.input_ids) for s in seen))  # the trainer stepped: new groups sample version 1
        server.__exit__(None, None, None)
        # Started again on its port by its owner, as the servers' flow does (relaunch, then a wait that adopts a
        # fenced replica): the rollout's next request for version 1 may fence it before its owner saw it healthy.
        again = relaunch(handle, run_token())
        try:
            wait_healthy(again, 180, run_token(), fenced_ok=True)
            deadline = time.monotonic() + 120
            while not behind:
                assert time.monotonic() < deadline, "the restarted server was never reported behind"
                batch = source.pull(1, timeout_s=5)
                seen += samples_from_arrow(batch.samples)
                consumed += batch.consumed_prompt_indices
                behind = batch.servers_behind
            refused = httpx.get(handle.url + "/health", timeout=5)
            lift(1)
            pull_to_end(source, 1, seen, consumed)
        finally:
            again.stop()
    finally:
        source.close()
        started.stop()
    assert behind == [handle.url]
    assert refused.status_code == 503 and "base weights" in refused.text  # fenced, not sampling version 1
    assert sorted({s.prompt_index for s in seen} | set(consumed)) == list(range(8))
    assert {s.policy_version for s in seen} <= {0, 1}
