"""Assemble a :class:`RolloutLoop` from a job: config objects, tokenizer, dataset, rewards, tools, the replica set.

Runs inside the rollout process, on its event loop (the HTTP clients belong to it).
"""

from __future__ import annotations

import logging
from typing import Any

from grpo_core.config import RolloutConfig
from grpo_core.errors import ConfigError
from grpo_core.security.allowlist import import_object

from .data import default_rewards, load_dataset
from .loop import LoopRuntime, RolloutLoop
from .tools import resolve_response_template

logger = logging.getLogger(__name__)


def loop_class_and_config(rollout: RolloutConfig) -> tuple[type[RolloutLoop], RolloutConfig]:
    """The loop class and its config: ``rollout`` re-validated as the class's ``config_class`` with ``loop_options``.

    Raises:
        ConfigError: the class is not a ``RolloutLoop`` subclass, or ``loop_options`` do not fit its config.
    """
    cls = import_object(rollout.loop_class, "rollout.loop_class")
    if not (isinstance(cls, type) and issubclass(cls, RolloutLoop)):
        raise ConfigError(f"rollout.loop_class={rollout.loop_class!r} is not a RolloutLoop subclass")
    config_cls = cls.config_class
    data = {**rollout.model_dump(), **rollout.loop_options}
    try:
        config = config_cls.model_validate(data)
    except ValueError as exc:
        raise ConfigError(f"rollout.loop_options do not fit {config_cls.__name__} of {cls.__name__}: {exc}") from exc
    return cls, config


def _environment_factory(rollout: RolloutConfig) -> Any:
    spec = rollout.environment_factory
    if spec is None:
        return None
    if isinstance(spec, str):
        return import_object(spec, "rollout.environment_factory")
    return {name: import_object(path, f"rollout.environment_factory[{name!r}]") for name, path in spec.items()}


def config_rewards(rollout: RolloutConfig) -> list[Any]:
    """The reward functions of a run: those named in config and the dataset's own verifier (reasoning-gym)
    unless already named."""
    rewards = [import_object(n, "rollout.reward_functions") for n in rollout.reward_functions]
    return rewards + [f for f in default_rewards(rollout) if f not in rewards]


async def build_loop(job: Any, queue: Any, window: Any, completions: Any = None) -> RolloutLoop:
    """The loop of ``job`` (a ``RolloutJob``), ready for ``drive``; ``completions`` = the table sample or None."""
    from transformers import AutoTokenizer

    from grpo_core.models import resolve_model_dir
    from grpo_core.serving.replicas import ReplicaSet

    run = job.config
    rollout = run.rollout
    cls, config = loop_class_and_config(rollout)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(run.model))
    template = resolve_response_template(rollout.response_template)
    if template is not None:
        tokenizer.response_template = template
    environment_factory = _environment_factory(rollout)
    if rollout.dataset is None and environment_factory is not None:
        # The environment owns the data: reset() returns each prompt; an epoch is dataset_size rollouts.
        dataset: Any = [{} for _ in range(rollout.dataset_size)]
    else:
        dataset = load_dataset(rollout)
    rewards = config_rewards(rollout)
    tools = [import_object(n, "rollout.tools") for n in rollout.tools]
    if not job.server_urls:
        raise ConfigError("the rollout needs at least one generation server URL")
    server = ReplicaSet.from_config(
        run.server,
        job.server_urls,
        max_connections=rollout.max_concurrent_rollouts,
        timeout_s=rollout.server_timeout_s,
        max_retries=rollout.max_retries,
        behind_wait_s=rollout.rollout_worker_timeout_s,
        sink=window,
    )
    try:
        max_model_len = await server.max_model_len()
    except (ValueError, KeyError):
        max_model_len = run.max_model_len
    runtime = LoopRuntime(
        tokenizer=tokenizer,
        server=server,
        model_name=run.served_model_name,
        max_model_len=max_model_len,
        dataset=dataset,
        queue=queue,
        allowance=queue.allowance,
        reward_functions=rewards,
        tools=tools,
        environment_factory=environment_factory,
        resume=job.resume,
        window=window,
        lora_name=run.adapter_name,
        completions=completions,
        max_steps=run.max_steps,
    )
    if not rewards and runtime.environment_factory is None:
        logger.warning(
            "no reward function and no environment: every group is unscored and dropped; set rollout.reward_functions"
        )
    return cls(config, runtime)
