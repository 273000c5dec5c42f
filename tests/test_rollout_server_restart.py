"""The generation server dies mid-run: requests are retried and the rollout carries on once it is back."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from serving_helpers import TINY, embedded_server, free_port

from grpo_core.config import RunConfig
from grpo_core.packing import samples_from_arrow
from grpo_core.rollout import start_rollout_process
from grpo_core.transport.flight_client import FlightSource

pytestmark = pytest.mark.slow


def test_server_killed_mid_run_retries_and_carries_on(tmp_path):
    port = free_port()
    config = RunConfig(model={"name": TINY}, server={"max_model_len": 256, "port": port},
                       rollout={"num_generations": 2, "max_completion_length": 8, "num_sampler_logprobs": 2,
                                "max_retries": 8, "first_step_tokens": 40, "max_staleness": 1,
                                "concurrency_poll_s": 0.5, "rollout_worker_timeout_s": 60,
                                "dataset": "rollout_helpers:rows", "dataset_kwargs": {"n": 6},
                                "reward_functions": ["rollout_helpers:parity_reward"]})
    server = embedded_server(tmp_path / "first", port=port)
    handle = server.__enter__()
    helpers = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    started = start_rollout_process(config, [handle.url], tmp_path / "rollout", env={"PYTHONPATH": helpers})
    source = FlightSource(started.wait_location(timeout_s=300), max_staleness=1, timeout_s=60,
                          process=started.process, error_path=started.error_path)
    seen, consumed = [], []
    try:
        first = source.pull(0, timeout_s=60)
        seen += samples_from_arrow(first.samples)
        consumed += first.consumed_prompt_indices
        server.__exit__(None, None, None)  # SIGTERM, then SIGKILL: in-flight requests fail
        time.sleep(1.0)
        with embedded_server(tmp_path / "second", port=port):
            while True:
                batch = source.pull(0, timeout_s=90)
                seen += samples_from_arrow(batch.samples)
                consumed += batch.consumed_prompt_indices
                if batch.exhausted:
                    break
            metrics = source.metrics()
    finally:
        source.close()
        started.stop()
    assert sorted({s.prompt_index for s in seen} | set(consumed)) == list(range(6))
    assert metrics["rollout/vllm_retry_count"] > 0
