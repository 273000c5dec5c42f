"""Checks of a run config that need imports or data but no server (fail fast before anything starts).

``RunConfig`` validation catches field and cross-field errors; :func:`check_run` adds what only
importing the named code or reading the dataset can tell: the model name resolves, the loop class,
reward functions and tools import, the dataset has the columns the rollout needs, and a Hub push
(``export.push_to_hub``) has a repository id and a token.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

from grpo_core.config import RunConfig
from grpo_core.errors import ConfigError
from grpo_core.hub import check_push

logger = logging.getLogger(__name__)

# Keyword arguments the rollout passes to every reward function besides the dataset's columns.
_REWARD_BUILTINS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                    "environments"}


def check_model(cfg: RunConfig) -> None:
    """Raise ``ConfigError`` when ``model.name`` is neither a registry name nor a folder with a config.json."""
    from grpo_core.models import registry_names

    name = cfg.model.name
    if name in registry_names() or (Path(name).expanduser() / "config.json").is_file():
        return
    raise ConfigError(f"model.name={name!r} is neither a registry name ({', '.join(registry_names())}) "
                      "nor a local folder with a config.json; fix model.name")


def check_dataset(cfg: RunConfig) -> None:
    """Load the dataset's first row and check the columns the rollout and the reward functions need.

    Raises:
        ConfigError: no dataset, an empty one, a missing ``prompt`` column (without an environment),
            or a reward function argument that is no column of the dataset.
    """
    from grpo_core.rollout.data import default_rewards, import_object, iter_rows, load_dataset

    rollout = cfg.rollout
    if rollout.dataset is None:
        if rollout.environment_factory is None:
            raise ConfigError("rollout.dataset is unset and there is no rollout.environment_factory: set "
                              "rollout.dataset to 'reasoning_gym:TASK', 'json:PATH' or 'module:callable'")
        return
    first = next(iter_rows(load_dataset(rollout)), None)
    if first is None:
        raise ConfigError(f"rollout.dataset={rollout.dataset!r} has no rows")
    columns = sorted(first)
    if "prompt" not in first and rollout.environment_factory is None:
        raise ConfigError(f"rollout.dataset={rollout.dataset!r} has no 'prompt' column (columns: {columns}); "
                          "add a 'prompt' column (a list of {'role', 'content'} messages) or set "
                          "rollout.environment_factory")
    funcs = [(name, import_object(name, "rollout.reward_functions")) for name in rollout.reward_functions]
    funcs += [(f.__name__, f) for f in default_rewards(rollout)]
    for name, func in funcs:
        for param in inspect.signature(func).parameters.values():
            required = param.default is inspect.Parameter.empty and param.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            if required and param.name not in _REWARD_BUILTINS and param.name not in first:
                raise ConfigError(f"rollout.reward_functions: {name} needs the dataset column {param.name!r}, "
                                  f"which rollout.dataset={rollout.dataset!r} lacks (columns: {columns})")


def check_run(cfg: RunConfig) -> None:
    """Every check that can run before a server starts.

    Raises:
        ConfigError: the first problem found, naming the field and the fix.
    """
    from grpo_core.rollout.build import loop_class_and_config
    from grpo_core.rollout.data import import_object
    from grpo_core.rollout.tools import resolve_response_template

    check_model(cfg)
    if cfg.server.backend == "vllm":
        from grpo_core.serving.vllm import choose_backend

        choose_backend(cfg)  # vLLM must be installed
    loop_class_and_config(cfg.rollout)
    for name in cfg.rollout.tools:
        import_object(name, "rollout.tools")
    resolve_response_template(cfg.rollout.response_template)
    check_dataset(cfg)
    check_push(cfg)
    logger.info("run config checked: model %s, dataset %s", cfg.model.name, cfg.rollout.dataset)
