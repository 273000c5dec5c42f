"""Checks of a run config that need imports or data but no server (fail fast before anything starts).

``RunConfig`` validation catches field and cross-field errors; :func:`check_run` adds what only
importing the named code or reading the dataset can tell: the model name resolves (a Hub id is
downloaded here, once, before any server starts) and its layers can be packed, the loop class,
reward functions and tools import, and the dataset has the columns the rollout needs.
"""

from __future__ import annotations

import inspect
import logging

from grpo_core.config import RunConfig
from grpo_core.errors import ConfigError

logger = logging.getLogger(__name__)

# Keyword arguments the rollout passes to every reward function besides the dataset's columns.
_REWARD_BUILTINS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                    "environments"}


def check_model(cfg: RunConfig) -> None:
    """Resolve ``model.name`` (build a registry model, find a folder or download a Hub id) and check
    that every layer of it can run on packed tree rows (built on the meta device, no weights read).

    Raises:
        ConfigError: the name does not resolve, or a layer cannot be packed (the layer type named).
    """
    from grpo_core.models import resolve_model_dir
    from grpo_core.train.packable import check_model_folder

    check_model_folder(resolve_model_dir(cfg.model), cfg.model.name, cfg.token_budget())


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

    check_model(cfg)
    loop_class_and_config(cfg.rollout)
    for name in cfg.rollout.tools:
        import_object(name, "rollout.tools")
    check_dataset(cfg)
    logger.info("run config checked: model %s, dataset %s", cfg.model.name, cfg.rollout.dataset)
