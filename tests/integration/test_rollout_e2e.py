"""The rollout engine end to end: the rollout process (started as the flow starts it), the real embedded
server, Flight, FlightSource.

One tiny random Qwen3 server (CPU, 1 thread) is shared by the module; each test starts its
own rollout process with a few prompts, small G and short completions; everything it runs is named in
the config (``rollout_helpers:…``, importable through PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import rollout_helpers as h
import torch
import yaml
from serving_helpers import TINY, adapter_dir, embedded_server, generated_tokens, holds_version, run

from grpo_core.config import RunConfig
from grpo_core.errors import TransportError
from grpo_core.packing import samples_from_arrow
from grpo_core.rollout import start_rollout_process
from grpo_core.transport.flight_client import FlightSource
from grpo_core.transport.types import ResumeState

# The default tier keeps the two staleness tests (each a rollout process on the module's server); the rest are slow.

#: The rollout process imports ``rollout_helpers`` by name.
HELPERS_ENV = {
    "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[1] / "support"), os.environ.get("PYTHONPATH")])
    )
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with embedded_server(tmp_path_factory.mktemp("rollout-server"), max_model_len=512, lora_r=8) as handle:
        yield handle


def _config(**rollout) -> RunConfig:
    settings = {
        "num_generations": 3,
        "max_completion_length": 8,
        "num_sampler_logprobs": 2,
        "concurrency_poll_s": 0.5,
        "rollout_worker_timeout_s": 20,
        "shuffle": False,  # the tests name rows by their prompt position (row r of epoch e is e * n + r)
        **rollout,
    }
    return RunConfig(model={"name": TINY}, server={"max_model_len": 512}, rollout=settings)


def rows(n: int) -> dict:
    """Rollout settings for the prompts ``rollout_helpers.rows(n)``."""
    return {"dataset": "rollout_helpers:rows", "dataset_kwargs": {"n": n}}


@contextmanager
def rollout(server, tmp_path, config: RunConfig, resume: ResumeState | None = None, env: dict | None = None):
    started = start_rollout_process(config, [server.url], tmp_path, resume=resume, env={**HELPERS_ENV, **(env or {})})
    source = FlightSource(
        started.wait_location(timeout_s=300),
        max_staleness=config.rollout.max_staleness,
        timeout_s=config.rollout.rollout_worker_timeout_s,
        process=started.process,
        error_path=started.error_path,
    )
    try:
        yield source
    finally:
        source.close()
        started.stop()


def drain(source, policy_version=0, **kw):
    """Pull until exhausted: (samples, consumed prompt indices, metrics)."""
    samples, consumed = [], []
    while True:
        batch = source.pull(policy_version, timeout_s=60, **kw)
        samples += samples_from_arrow(batch.samples)
        consumed += batch.consumed_prompt_indices
        if batch.exhausted:
            return samples, consumed, source.metrics()


@pytest.mark.slow
def test_advantages_match_rewards_recomputed_from_the_log(server, tmp_path):
    log = tmp_path / "rewards.jsonl"
    config = _config(num_generations=4, **rows(5), reward_functions=["rollout_helpers:recording_reward"])
    with rollout(server, tmp_path, config, env={h.REWARD_LOG_ENV: str(log)}) as source:
        samples, consumed, metrics = drain(source)
    logged = defaultdict(list)
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        logged[entry["row_id"]].append(entry)
    assert sorted({s.prompt_index for s in samples} | set(consumed)) == list(range(5)), "every prompt accounted for"
    assert {e["cuda"] for g in logged.values() for e in g} == {""}, "the rollout process sees no GPU"
    for s in samples:
        group = logged[s.prompt_index]
        rewards = np.array([e["reward"] for e in group])
        expected = (rewards - rewards.mean()) / rewards.std()  # written independently of grpo_core
        trained = s.input_ids[s.completion_mask == 1].tolist()
        (i,) = [k for k, e in enumerate(group) if e["completion_ids"] == trained]
        assert s.advantage == pytest.approx(expected[i], abs=1e-5)
        assert s.sampler_topk is not None and np.all(s.sampler_logprobs[s.completion_mask == 0] == 0)
    for row_id in set(consumed):
        assert len(set(e["reward"] for e in logged[row_id])) == 1, "only zero-std groups are dropped"
    all_rewards = [e["reward"] for g in logged.values() for e in g]
    assert metrics["reward"] == pytest.approx(np.mean(all_rewards))
    assert metrics["frac_reward_zero_std"] == pytest.approx(len(set(consumed)) / 5)
    assert metrics["rollout/generated_tokens_per_s"] > 0 and metrics["rollout/concurrency_cap"] >= 1
    assert metrics["completions/max_length"] <= 8


def test_slow_consumer_never_sees_stale_samples_and_queue_stays_within_allowance(server, tmp_path):
    step_tokens = 60  # the allowance: (max_staleness 1 + 1) x 60 = 120 tokens queued + in flight + held
    config = _config(
        max_staleness=1, first_step_tokens=step_tokens, **rows(8), reward_functions=["rollout_helpers:parity_reward"]
    )
    with rollout(server, tmp_path, config) as source:
        version, seen, consumed, dropped, metrics = 0, [], [], 0, {}
        while True:
            batch = source.pull(version, timeout_s=60)
            pulled = samples_from_arrow(batch.samples)
            assert all(version - s.policy_version <= 1 for s in pulled)
            seen += pulled
            consumed += batch.consumed_prompt_indices
            dropped += batch.dropped_stale_count
            for metric, value in source.metrics().items():
                metrics[metric] = max(metrics.get(metric, value), value)
            if batch.exhausted:
                break
            holds_version(server.url, version)
            source.report(version, step_tokens)
            version += 2  # the trainer syncs weights twice per pull: older samples go stale
            time.sleep(0.3)
    assert dropped > 0 and metrics["sample/dropped_stale_count"] > 0
    assert sorted({s.prompt_index for s in seen} | set(consumed)) == list(range(8))
    largest_group = max(len(s.input_ids) for s in seen) * 3 if seen else 0  # raw tokens of one group of 3
    # this consumer holds nothing between pulls (it reports held_tokens 0): the queue alone stays within the allowance
    assert metrics["rollout/queued_tokens_max"] <= max(2 * step_tokens, largest_group)
    assert metrics["rollout/backpressure_s"] > 0


@pytest.mark.slow
def test_user_code_that_hangs_or_raises_costs_its_group_not_the_run(server, tmp_path):
    # Before: no timeouts (a hang blocked its group forever) and the first raising reward failed the run.
    config = _config(
        reward_timeout_s=1,
        tool_timeout_s=1,
        max_failed_groups=4,
        **rows(6),
        reward_functions=["rollout_helpers:flaky_reward"],
        environment_factory="rollout_helpers:FlakyEnv",
    )
    with rollout(server, tmp_path, config) as source:
        samples, consumed, metrics = drain(source)
    # rows 1 (reward hangs), 2 (reward raises), 3 (reset hangs), 4 (get_reward raises) fail; 0 and 5 train
    assert {s.prompt_index for s in samples} | set(consumed) == set(range(6)), "every prompt reported"
    assert {1, 2, 3, 4} <= set(consumed) and not {1, 2, 3, 4} & {s.prompt_index for s in samples}
    assert metrics["rollout/failed_group_count"] == 4 and metrics["rewards/flaky_reward/timeout_count"] == 1
    assert metrics["env/reset_timeout_count"] == 3, "each of the G=3 rollouts of row 3 timed out in reset"


@pytest.mark.slow
def test_failures_past_the_budget_fail_the_run_naming_the_last_error(server, tmp_path):
    config = _config(max_failed_groups=2, **rows(6), reward_functions=["rollout_helpers:raising_reward"])
    with (
        rollout(server, tmp_path, config) as source,
        pytest.raises(
            TransportError,
            match=r"3 groups failed in user code, more than rollout.max_failed_groups"
            r"=2; the last: reward function 'raising_reward' raised RuntimeError",
        ),
    ):
        drain(source)
    assert "raising_reward" in (tmp_path / "rollout_error.txt").read_text()


def test_group_outliving_its_lora_version_is_dropped_as_stale_not_failing_the_run(server, tmp_path):
    # Before: the sync retired pol-v1 while odd rows slept in a tool; their next turn got 404 and failed the run.
    config = RunConfig(
        model={"name": TINY},
        server={"max_model_len": 512},
        train={"lora": {"enabled": True, "name": "pol", "r": 8}},
        rollout={
            "num_generations": 2,
            "max_completion_length": 8,
            "num_sampler_logprobs": 2,
            "max_staleness": 0,
            "max_tool_calling_iterations": 1,
            "rollout_worker_timeout_s": 30,
            "loop_class": "rollout_helpers:ScriptedToolLoop",
            "environment_factory": "rollout_helpers:SleepyCounterEnv",
            **rows(4),
            "reward_functions": ["rollout_helpers:position_reward"],
        },
    )
    from peft import LoraConfig, get_peft_model

    from grpo_core.config import ModelConfig
    from grpo_core.models import load_model
    from grpo_core.serving.client import GenerationClient

    for version in (1, 2):
        torch.manual_seed(version)
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = get_peft_model(load_model(ModelConfig(name=TINY))[0], lora)
        model.save_pretrained(adapter_dir(server) / f"v{version}")  # the only folder the server loads from

    async def sync(version):  # what the trainer's LoraAdapterSync does with max_staleness 0: keep one version
        async with GenerationClient(server.url) as c:
            if version <= 2:
                await c.load_lora_adapter(f"pol-v{version}", str(adapter_dir(server) / f"v{version}"))
            if version > 1:
                await c.unload_lora_adapter(f"pol-v{version - 1}")

    run(sync(1))
    try:
        with rollout(server, tmp_path, config, resume=ResumeState(policy_version=1)) as source:
            first = source.pull(1, timeout_s=120)  # row 0 (the first group runs alone)
            run(sync(2))  # odd rows are sleeping in their tool: pol-v1 goes under them
            source.report(2, 100)
            samples, consumed, metrics = drain(source, policy_version=2)
    finally:
        run(sync(3))  # the module's server serves the base model alone again
    samples += samples_from_arrow(first.samples)
    consumed += first.consumed_prompt_indices
    assert {s.prompt_index for s in samples} | set(consumed) == set(range(4)), "every prompt reported"
    assert metrics["rollout/stale_group_count"] >= 1, "a group outlived pol-v1"
    assert {s.policy_version for s in samples if s.prompt_index != 0} <= {2}, "no stale sample trained"


@pytest.mark.slow
def test_curriculum_subclass_from_config_skips_solved_prompts(server, tmp_path):
    config = _config(
        num_generations=4,
        num_epochs=3,
        loop_class="rollout_helpers:CurriculumLoop",
        loop_options={"pass_rate_cap": 0.6},
        reward_functions=["rollout_helpers:curriculum_reward"],
        **rows(3),
    )
    with rollout(server, tmp_path, config) as source:
        samples, consumed, metrics = drain(source)
    # Row 0 is solved in epoch 0 (zero std, dropped), then filtered in epochs 1 and 2.
    assert sorted(consumed) == [0, 3, 6]
    assert metrics["rollout/filtered_prompt_count"] == 2 and metrics["rollout/group_count"] == 7
    assert sorted({s.prompt_index for s in samples}) == [1, 2, 4, 5, 7, 8]


@pytest.mark.slow
def test_epoch_rejecting_every_prompt_raises(server, tmp_path):
    with (
        rollout(server, tmp_path, _config(**rows(3), loop_class="rollout_helpers:RejectAllLoop")) as source,
        pytest.raises(TransportError, match="rejected all 3 prompts of epoch 0"),
    ):
        drain(source)


@pytest.mark.slow
def test_environments_with_tool_calls_routed_by_column(server, tmp_path):
    prompts = [
        {"prompt": [{"role": "user", "content": "Play."}], "environment": env, "target": target}
        for env, target in [("counter", 2), ("game", 0), ("counter", 3), ("game", 0)]
    ]
    config = _config(
        num_generations=2,
        max_tool_calling_iterations=1,
        loop_class="rollout_helpers:ScriptedToolLoop",
        environment_factory={"counter": "rollout_helpers:CounterEnv", "game": "rollout_helpers:GameEnv"},
        reward_functions=["rollout_helpers:parity_reward"],
        dataset="rollout_helpers:rows_of",
        dataset_kwargs={"rows": prompts},
    )
    with rollout(server, tmp_path, config) as source:
        samples, consumed, metrics = drain(source)
    # Each rollout saw only its environment's tool: the scripted first turn calls the tool it was shown.
    assert metrics["tools/increment/call_count"] == 4 and metrics["tools/move/call_count"] == 4
    assert "tools/unknown_name_count" not in metrics
    assert metrics["rewards/CounterEnv/mean"] == pytest.approx(0.5)  # target 2 reached, target 3 not
    assert metrics["rollout/turns_mean"] == 2 and metrics["env/reset_s"] >= 0 and "env/reward_s" in metrics
    assert metrics["rollout/samples_per_rollout"] == 1 and metrics["rollout/fork_frac"] == 0
    from transformers import AutoTokenizer

    from grpo_core.config import ModelConfig
    from grpo_core.models import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig(name=TINY)))
    for s in samples:
        text = tok.decode(s.input_ids)
        assert "<tool_call>" in text and "<|im_start|>tool" in text
        tool_answer = text.index("<|im_start|>tool")
        # The tool's answer is context; the call before it and the reply after it are trained.
        mask_by_char = tok.decode(s.input_ids[s.completion_mask == 1])
        assert "<|im_start|>tool" not in mask_by_char and "<tool_call>" in mask_by_char
        assert s.completion_mask[len(tok.encode(text[:tool_answer], add_special_tokens=False)) :].any()


@pytest.mark.slow
def test_reward_functions_get_trainer_state_log_metric_and_the_environments(server, tmp_path):
    # Before: preflight accepted these arguments but scoring never passed them: the first group failed the run.
    prompts = [{"prompt": [{"role": "user", "content": "Count."}], "target": target} for target in (2, 3, 2)]
    config = _config(
        num_generations=2,
        max_tool_calling_iterations=1,
        loop_class="rollout_helpers:ScriptedToolLoop",
        environment_factory="rollout_helpers:CounterEnv",
        reward_functions=["rollout_helpers:state_reward"],
        dataset="rollout_helpers:rows_of",
        dataset_kwargs={"rows": prompts},
    )
    resume = ResumeState(policy_version=3, step=7)
    with rollout(server, tmp_path, config, resume=resume) as source:
        holds_version(server.url, 3)
        source.synced(3)  # the resumed trainer's first sync (the rollout waits for it)
        samples, consumed, metrics = drain(source, policy_version=3)
    assert metrics["state_reward/group_count"] == 3
    assert metrics["trainer_state/step"] == 7 and metrics["trainer_state/policy_version"] == 3
    assert metrics["trainer_state/epoch"] == 0
    # The scripted first turn calls increment(step=2): the counter of every environment ends at 2, so the
    # reward read from the environments is 1 exactly for the rows whose target is 2 (rows 0 and 2).
    assert metrics["rewards/state_reward/mean"] == pytest.approx(2 / 3)
    assert metrics["rewards/CounterEnv/mean"] == pytest.approx(2 / 3)


@pytest.mark.slow
def test_environment_owns_the_data_without_a_dataset(server, tmp_path):
    config = _config(
        num_generations=4,
        dataset_size=3,
        max_tool_calling_iterations=1,
        loop_class="rollout_helpers:ScriptedToolLoop",
        environment_factory="rollout_helpers:SelfSampledCounterEnv",
    )
    with rollout(server, tmp_path, config) as source:
        samples, consumed, metrics = drain(source)
    assert sorted({s.prompt_index for s in samples} | set(consumed)) == [0, 1, 2]
    assert metrics["tools/increment/call_count"] == 12 and "rewards/SelfSampledCounterEnv/mean" in metrics


@pytest.mark.slow
def test_killed_rollout_process_fails_the_pull_within_the_timeout(server, tmp_path):
    config = _config(rollout_worker_timeout_s=5, **rows(200), reward_functions=["rollout_helpers:parity_reward"])
    with rollout(server, tmp_path, config) as source:
        source.pull(0, timeout_s=60)
        remote = FlightSource(source.location, max_staleness=4, timeout_s=3)  # a trainer on another host
        os.kill(source.process.pid, signal.SIGKILL)
        start = time.monotonic()
        # pulls that would wait 300 s for samples: the two errors must come from the dead process (at once) and the
        # remote source's 3 s timeout, well inside 60 s on a loaded box, not from the pulls' own timeouts
        with pytest.raises(TransportError, match="exited with code -9"):
            source.pull(0, timeout_s=300)
        with pytest.raises(TransportError, match="no answer for"):
            remote.pull(0, timeout_s=300)
        assert time.monotonic() - start < 60, "within the remote source's timeout (3 s) + slack, not the pull's"
        remote.close()


@pytest.mark.slow
def test_resume_skips_trained_prompts_without_requests(server, tmp_path):
    resume = ResumeState(policy_version=3, first_untrained_prompt_index=2, trained_above=[3])
    config = _config(num_generations=4, **rows(5), reward_functions=["rollout_helpers:curriculum_reward"])
    with rollout(server, tmp_path, config, resume=resume) as source:
        # The server holds the base weights until the resumed trainer syncs version 3: nothing may be sampled
        # before (those tokens would be tagged version 3); the trainer says so with ``synced``.
        before = generated_tokens(server.url)
        early = source.pull(3, timeout_s=4)
        assert early.samples.num_rows == 0 and not early.consumed_prompt_indices and not early.exhausted
        assert generated_tokens(server.url) == before, "sampled before the trainer synced the resumed version"
        holds_version(server.url, 3)  # the resumed trainer's sync reaches the server (not left to an earlier test)
        source.synced(3)
        samples, consumed, metrics = drain(source, policy_version=3)
    assert sorted({s.prompt_index for s in samples} | set(consumed)) == [2, 4]
    assert metrics["rollout/group_count"] == 2, "no group generated for the trained prompts"
    assert {s.policy_version for s in samples} == {3}


@pytest.mark.slow
def test_stalled_rollout_loop_fails_the_pull(server, tmp_path):
    config = _config(
        rollout_worker_timeout_s=4,
        **rows(4),
        loop_class="rollout_helpers:StallLoop",
        reward_functions=["rollout_helpers:parity_reward"],
    )
    with rollout(server, tmp_path, config) as source:
        source.wait_running()
        start = time.monotonic()
        with pytest.raises(TransportError, match="has not ticked"):
            drain(source)
        # the pulls' own timeout is 60 s (drain): the error comes from the 4 s tick timeout during the 8 s stall;
        # 45 s leaves a loaded box 33 s of slack and stays below the pull timeout
        assert time.monotonic() - start < 45, "within the stall (8 s) + timeout (4 s) + slack"


@pytest.mark.slow
def test_config_file_with_a_reasoning_gym_dataset_and_a_trainer_that_did_not_start_the_process(server, tmp_path):
    config = {
        "model": {"name": TINY},
        "server": {"max_model_len": 512},
        "rollout": {
            "dataset": "reasoning_gym:basic_arithmetic",
            "dataset_size": 3,
            "num_generations": 2,
            "max_completion_length": 8,
            "num_sampler_logprobs": 2,
            "reward_functions": ["rollout_helpers:parity_reward"],
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    started = start_rollout_process(tmp_path / "run.yaml", [server.url], tmp_path / "rollout", env=HELPERS_ENV)
    try:
        source = FlightSource(started.wait_location(timeout_s=300), max_staleness=4, timeout_s=30)
        samples, consumed, metrics = drain(source)
        source.close()  # its shutdown action ends the process
        assert started.process.wait(timeout=30) == 0
    finally:
        started.stop()
    assert sorted({s.prompt_index for s in samples} | set(consumed)) == [0, 1, 2]
    assert "rewards/reasoning_gym_reward/mean" in metrics and "rewards/parity_reward/mean" in metrics
