"""Module-level pieces of the rollout tests (the rollout process imports them by name: tests/support/ is on its
PYTHONPATH).

The ones configs name are registered config entries (``@config_entry``, as a user module registers its own);
``rollout_helpers`` is in ``GRPO_ALLOWED_MODULES`` (``tests/conftest.py``)."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np

from grpo_core.config import RolloutConfig
from grpo_core.entries import config_entry
from grpo_core.rollout import RolloutLoop, TurnRecord


@config_entry("reward")
def length_reward(completion_ids, **_):
    """Longer completions score higher (token count)."""
    return [float(len(ids)) for ids in completion_ids]


@config_entry("reward")
async def parity_reward(completion_ids, **_):
    """1 when the first generated token id is even (async)."""
    await asyncio.sleep(0)
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]


@config_entry("reward")
def none_for_odd_rows(completion_ids, row_id, **_):
    """Applies only to even ``row_id`` rows."""
    return [None if r % 2 else 1.0 for r in row_id]


@config_entry("reward")
def raising_reward(**_):
    raise RuntimeError("boom in the reward")


@config_entry("reward")
def wrong_length_reward(completion_ids, **_):
    return [1.0] * (len(completion_ids) + 1)


@config_entry("reward")
def flaky_reward(completion_ids, row_id, **_):
    """Hangs (10 s) on row 1, raises on row 2, scores the others by length."""
    if row_id[0] == 1:
        time.sleep(10)
    if row_id[0] == 2:
        raise RuntimeError("boom on row 2")
    return [float(len(ids)) for ids in completion_ids]


@config_entry("reward")
def needs_answer_column(completion_ids, answer):
    """Needs a dataset column ``answer`` the test rows do not have (a wrong signature)."""
    return [1.0] * len(completion_ids)


@config_entry("environment")
class FlakyEnv:
    """Environment whose ``reset`` hangs (10 s) on row 3 and whose ``get_reward`` raises on row 4."""

    def reset(self, row_id, **_):
        self.row_id = row_id
        if row_id == 3:
            time.sleep(10)

    def get_reward(self):
        if self.row_id == 4:
            raise ValueError("no reward for row 4")
        return None


@config_entry("reward")
def even_share(completion_ids, **_):
    """Share of even token ids: varies inside a group, so no group is dropped."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


@config_entry("reward")
def position_reward(completion_ids, **_):
    """The rollout's position in its group: never zero-std."""
    return [float(i) for i in range(len(completion_ids))]


@config_entry("reward")
def nan_first_reward(completion_ids, **_):
    """NaN for the first rollout of each group, length for the others."""
    return [math.nan if i == 0 else float(len(ids)) for i, ids in enumerate(completion_ids)]


@config_entry("dataset")
def rows(n: int, with_row_id: bool = True) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": f"Count to {i}."}], **({"row_id": i} if with_row_id else {})}
        for i in range(n)
    ]


class CurriculumConfig(RolloutConfig):
    pass_rate_cap: float = 0.5
    """Skip prompts whose pass rate reached this."""


@config_entry("loop_class")
class CurriculumLoop(RolloutLoop):
    """Skips prompts it already solves (seed manual's curriculum example, written anew)."""

    config_class = CurriculumConfig

    async def setup(self):
        self.pass_rates = {}

    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


@config_entry("environment")
class CounterEnv:
    """Counter environment: reach the target with ``increment`` tool calls."""

    def reset(self, target, **_):
        self.counter, self.target = 0, target
        return f"Use the increment tool to bring the counter to {target}."

    def get_reward(self):
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: value to add.

        Returns:
            The counter after the addition.
        """
        self.counter += step
        return self.counter


@config_entry("environment")
class SleepyCounterEnv(CounterEnv):
    """``increment`` sleeps 6 s on odd rows: a long multi-turn rollout that outlives a weight sync."""

    def reset(self, row_id, **_):
        self.row_id, self.counter, self.target = row_id, 0, 2

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: value to add.

        Returns:
            The counter after the addition.
        """
        if self.row_id % 2:
            time.sleep(6)
        return super().increment(step)


@config_entry("environment")
class GameEnv:
    """Second environment for routing tests; its only tool is ``move``."""

    def reset(self, **_):
        self.moves = 0
        return "Reach the goal."

    def move(self, direction: str) -> str:
        """Move one tile.

        Args:
            direction: up, down, left or right.
        """
        self.moves += 1
        return f"moved {direction}"


@config_entry("loop_class")
class ScriptedToolLoop(RolloutLoop):
    """Makes the model's first turn a fixed tool call (a tiny random model never emits one),
    recording the tools each rollout saw; later turns sample from the server as usual."""

    async def generate_one(self, prompt, tools, group_id=0):
        names = sorted(t.__name__ for t in tools)
        rollout = await super().generate_one(prompt, tools, group_id)
        rollout.completion.append({"role": "meta", "content": ",".join(names)})
        return rollout

    async def generate_one_turn(self, prompt_ids):
        turn = await super().generate_one_turn(prompt_ids)
        names = self.tokenizer.decode(prompt_ids)
        if "<|im_start|>tool" in names:  # the tool already answered: a normal sampled turn
            return turn
        tool = "increment" if '"increment"' in names else "move"
        args = '{"step": 2}' if tool == "increment" else '{"direction": "up"}'
        text = f'<tool_call>\n{{"name": "{tool}", "arguments": {args}}}\n</tool_call>'
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return TurnRecord(
            prompt_ids=list(prompt_ids),
            output_ids=ids,
            output_log_probs=[-0.5] * len(ids),
            output_sampler_logprobs=[{t: -0.5} for t in ids] if turn.output_sampler_logprobs else None,
            finish_reason="stop",
            text=text,
        )


@config_entry("reward")
def curriculum_reward(completion_ids, row_id, **_):
    """Row 0 is always solved; other rows pass half their rollouts (by position)."""
    if row_id[0] == 0:
        return [1.0] * len(completion_ids)
    return [float(i % 2) for i in range(len(completion_ids))]


@config_entry("loop_class")
class RejectAllLoop(RolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return False


#: Environment variable naming the JSON-lines file :func:`recording_reward` appends to.
REWARD_LOG_ENV = "ROLLOUT_HELPERS_REWARD_LOG"


@config_entry("reward")
def recording_reward(completion_ids, row_id, **_):
    """Parity reward that also appends what it scored to the file named by ``$ROLLOUT_HELPERS_REWARD_LOG``
    (for independent checks)."""
    import json
    import os

    rewards = [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]
    cuda = os.environ.get("CUDA_VISIBLE_DEVICES")
    with open(os.environ[REWARD_LOG_ENV], "a") as f:
        for ids, r, row in zip(completion_ids, rewards, row_id):
            f.write(json.dumps({"row_id": row, "completion_ids": ids, "reward": r, "cuda": cuda}) + "\n")
    return rewards


@config_entry("loop_class")
class StallLoop(RolloutLoop):
    """Blocks its event loop for 8 s on the second prompt (a sync hook gone wrong)."""

    def filter_prompt(self, row_index, row, epoch):
        if row_index == 1:
            import time

            time.sleep(8)
        return True


@config_entry("environment")
class SelfSampledCounterEnv(CounterEnv):
    """Owns its data: reset() draws the target and returns the prompt (no dataset)."""

    def reset(self, **_):
        import random

        return super().reset(target=random.randint(1, 3))


@config_entry("reward")
def state_reward(completion_ids, trainer_state, log_metric, environments, target, **_):
    """Reads what the rollout supplies besides columns: the environments' state after the rollout
    (the counter), and reports ``trainer_state`` through ``log_metric``."""
    log_metric("trainer_state/step", trainer_state.step)
    log_metric("trainer_state/policy_version", trainer_state.policy_version)
    log_metric("trainer_state/epoch", trainer_state.epoch)
    log_metric("state_reward/group_count", 1)
    return [float(env.counter == t) for env, t in zip(environments, target, strict=True)]


@config_entry("reward")
def needs_every_supplied_argument(
    prompts, completions, completion_ids, trainer_state, log_metric, environments, answer
):
    """Requires every argument of ``REWARD_ARGUMENTS`` and one column."""
    return [0.0] * len(completions)


@config_entry("reward")
def needs_log_extra(completions, log_extra):
    """Requires TRL's ``log_extra``, which grpo-flow does not supply."""
    return [0.0] * len(completions)


@config_entry("dataset")
def rows_of(rows):
    """A ``module:callable`` dataset: the given rows as a list."""
    return list(rows)


@config_entry("loop_class")
class PlainRenderLoop(RolloutLoop):
    """Renders prompts without a chat template (plain text of the messages)."""

    def render(self, messages, tool_schemas_=None):
        return self.tokenizer.encode("\n".join(m["content"] for m in messages), add_special_tokens=False)


def run_count_groups(server_url: str, num_prompts: int, **rollout):
    """Run the real rollout loop in this process for ``num_prompts`` "Count to i." prompts (one group each,
    in order) against ``server_url`` (the tiny-qwen3 model, ``rollout_helpers:even_share`` reward,
    ``rollout`` fields on top: temperature, num_sampler_logprobs, ...); returns ``(samples, loop)``: the queued
    samples as one Sample-schema ``RecordBatch`` and the loop that made them."""
    import pyarrow as pa

    from grpo_core.config import ModelConfig, RunConfig
    from grpo_core.rollout.build import build_loop
    from grpo_core.rollout.pace import TokenAllowance
    from grpo_core.rollout.process import RolloutJob
    from grpo_core.rollout.queue import SampleQueue
    from grpo_core.rollout.window import MetricWindow

    rows = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(num_prompts)]
    cfg = RunConfig(
        model=ModelConfig(name="tiny-qwen3"),
        server={"backend": "embedded", "max_model_len": 256},
        rollout={
            "dataset": "rollout_helpers:rows_of",
            "dataset_kwargs": {"rows": rows},
            "reward_functions": ["rollout_helpers:even_share"],
            **rollout,
        },
    )
    job = RolloutJob(config=cfg.rollout_process(), server_urls=[server_url])

    async def go():
        queue = SampleQueue(TokenAllowance(1, 10**9), with_topk=cfg.rollout.num_sampler_logprobs > 0)
        loop = await build_loop(job, queue, MetricWindow())
        try:
            for i, row in enumerate(rows):
                await loop.run_group(i, i, 0, row)
        finally:
            loop.executor.shutdown()
            await loop.runtime.server.aclose()
        batches, *_ = queue.take(0, 0.0)
        return batches, loop

    batches, loop = asyncio.run(go())
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0], loop
