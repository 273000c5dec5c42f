"""Prompt datasets of the rollout loop: data files (``grpo_core.rollout.sources``), reasoning-gym, ``module:callable``
and weighted mixtures (``grpo_core.rollout.mixture``).

A prompt dataset yields rows (dicts) with a conversational ``prompt`` column (a list of
``{"role", "content"}`` messages); other columns reach reward functions and an
environment's ``reset`` as keyword arguments. With an ``environment_factory`` the ``prompt``
column may be missing (``reset`` returns the prompt text).

Prompt positions: the rollout numbers prompts across epochs, ``prompt_index = epoch *
num_rows + k`` for the k-th prompt of an epoch (in a seeded order of its own with
``rollout.shuffle``, ``grpo_core.rollout.driver.prompt_stream``); it is the ``prompt_index``
and ``group_id`` of the samples and the position a resume restarts from.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from grpo_core.config import RolloutConfig, dataset_form
from grpo_core.config.rollout import unknown_prefix_hint
from grpo_core.entries import config_entry
from grpo_core.errors import ConfigError, did_you_mean
from grpo_core.security.allowlist import import_object

from .mixture import Mixture, Source, view
from .sources import json_dataset, local_files, read_source

REASONING_GYM_PREFIX = "reasoning_gym:"
RG_SYSTEM_PROMPT = "Solve the problem. Think briefly, then give only the final answer inside <answer></answer> tags."


def reasoning_gym_dataset(task: str, size: int, seed: int, **task_config: Any) -> Any:
    """A reasoning-gym task as an HF Dataset: ``prompt`` (system + question), ``answer``, ``rg_task``, ``rg_entry``.

    ``rg_entry`` is the task entry as JSON (for ``score_answer``); score it with
    :func:`reasoning_gym_reward`. ``task_config`` (``rollout.dataset_kwargs``) goes to the task's
    config, e.g. ``min_terms``/``max_digits`` of ``chain_sum``.

    Raises:
        ConfigError: no such task, or an option the task's config does not take or refuses (names
            ``rollout.dataset`` and ``rollout.dataset_kwargs``).
    """
    return _reasoning_gym_rows(task, size, seed, task_config, f"rollout.dataset='{REASONING_GYM_PREFIX}{task}'")


def _reasoning_gym_rows(task: str, size: int, seed: int, task_config: dict[str, Any], where: str) -> Any:
    """:func:`reasoning_gym_dataset` whose errors start with ``where`` (``eval.dataset='reasoning_gym:TASK'``) and
    name the ``dataset_kwargs`` beside that field."""
    import datasets
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    spec, options_field = where, where.partition("=")[0].rsplit(".", 1)[0] + ".dataset_kwargs"
    if task not in DATASETS:
        hint = did_you_mean(task, DATASETS, REASONING_GYM_PREFIX) or f"; the tasks: {', '.join(sorted(DATASETS))}"
        raise ConfigError(f"{spec}: no such reasoning-gym task{hint}")
    try:
        source = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_config)
    except TypeError as exc:  # an option the task's config class does not take
        options = sorted(getattr(DATASETS[task][1], "__dataclass_fields__", ()))
        raise ConfigError(
            f"{spec}: {options_field} {task_config} are not all options of the task ({exc}); "
            f"its options: {', '.join(options)}"
        ) from None
    except (KeyError, ValueError, AssertionError) as exc:  # the task's config refuses a value
        raise ConfigError(f"{spec} with {options_field} {task_config}: {exc}") from None
    rows = [
        {
            "prompt": [{"role": "system", "content": RG_SYSTEM_PROMPT}, {"role": "user", "content": e["question"]}],
            "answer": str(e["answer"]),
            "rg_task": task,
            "rg_entry": json.dumps(e, default=str),
        }
        for e in source
    ]
    return datasets.Dataset.from_list(rows)


@functools.lru_cache(maxsize=64)
def _rg_scorer(task: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0)


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str:
    """The last ``<answer>…</answer>`` of a completion, else its last non-empty line."""
    found = _ANSWER.findall(text)
    if found:
        return found[-1].strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


@config_entry("reward")
def reasoning_gym_reward(
    completions: list[list[dict[str, Any]]],
    rg_task: list[str] | None = None,
    rg_entry: list[str] | None = None,
    **_: Any,
) -> list[float | None]:
    """Reward of reasoning-gym rows: the task's ``score_answer`` (0-1) on the extracted answer; None elsewhere."""
    if rg_task is None or rg_entry is None:
        return [None] * len(completions)
    out: list[float | None] = []
    for completion, task, entry in zip(completions, rg_task, rg_entry, strict=True):
        if not task:
            out.append(None)
            continue
        text = "".join(m.get("content") or "" for m in completion if m.get("role") == "assistant")
        out.append(float(_rg_scorer(task).score_answer(extract_answer(text), json.loads(entry))))
    return out


JSON_PREFIX = "json:"


def _json_lines_files(pattern: str) -> list[Path]:
    """The local files a ``json:`` dataset names: the path, or every match of a glob pattern ([] for a URL).

    Raises:
        ConfigError: nothing matches, or the path is a folder (names ``rollout.dataset`` and the fix).
    """
    return local_files(pattern, f"rollout.dataset='{JSON_PREFIX}{pattern}'", "JSON-lines")


def json_lines_dataset(pattern: str) -> Any:
    """A ``json:PATH`` prompt dataset: the JSON-lines file(s) ``pattern`` names (a path or a glob; a file holding
    one JSON array of objects, or a compressed one, is read too), values exactly as written
    (:func:`grpo_core.rollout.sources.json_dataset`).

    Raises:
        ConfigError: no such file, a folder, a line that is not a JSON object, or no rows; names
            ``rollout.dataset``, the file, the line and the fix.
    """
    return json_dataset(pattern, f"rollout.dataset='{JSON_PREFIX}{pattern}'")


def open_dataset(
    spec: str, where: str, config: RolloutConfig, split: str, column_types: dict[str, str], kwargs: dict[str, Any]
) -> Any:
    """The rows one dataset spec names, unmapped: ``reasoning_gym:TASK`` (``config.dataset_size`` rows of
    ``config.dataset_seed``), ``module:callable`` (called with ``kwargs``), or a data form read by
    :func:`grpo_core.rollout.sources.read_source`.

    Raises:
        ConfigError: names ``where`` and the problem (no such file or task, unreadable rows, ...).
    """
    form, rest = dataset_form(spec)
    if form == "reasoning_gym":
        return _reasoning_gym_rows(rest, config.dataset_size, config.dataset_seed, kwargs, where)
    if form != "module":
        return read_source(spec, where, split, column_types)
    try:
        factory = import_object(spec, where.partition("=")[0])
    except ConfigError as exc:
        if not isinstance(exc.__cause__, ModuleNotFoundError):
            raise
        raise ConfigError(
            f"{exc}; or, for data, name a local file or folder: no file or folder {spec!r} exists here"
            f"{unknown_prefix_hint(spec)}"
        ) from exc
    data = factory(**kwargs) if callable(factory) else factory
    if not isinstance(data, Iterable):
        raise ConfigError(f"{where} returned {type(data).__name__}, not a Dataset or rows")
    return data


def load_dataset(config: RolloutConfig, section: str = "rollout", prompt_column_field: str | None = None) -> Any:
    """The prompt rows of a run: ``config.dataset`` with its prompt column mapped onto ``prompt``
    (:func:`~grpo_core.rollout.mixture.view`), or the weighted :class:`~grpo_core.rollout.mixture.Mixture` of
    ``config.datasets``.

    Args:
        config: the dataset settings (the rollout's, or the eval dataset's in their place).
        section: the config section errors name the dataset by (``eval`` -> ``eval.dataset='...'``).
        prompt_column_field: the field errors name the prompt column by; None = ``{section}.prompt_column``.

    Raises:
        ConfigError: unset, unknown form, a file that is missing, empty or unreadable, a mixture source that is
            streaming or empty, or the callable does not return rows.
    """
    if config.datasets:
        return load_mixture(config)
    spec = config.dataset
    if spec is None:
        raise ConfigError(
            "rollout.dataset is unset and no rollout.environment_factory makes the prompts; set it to "
            f"a data file (.jsonl, .parquet, .csv, .arrow), 'hf:owner/name', {_FORMS}"
        )
    where = f"{section}.dataset={spec!r}"
    data = open_dataset(spec, where, config, config.dataset_split, config.column_types, config.dataset_kwargs)
    check_prompt_column(data, config.prompt_column, prompt_column_field or f"{section}.prompt_column", spec)
    return view(data, config.prompt_column, config.system_prompt)


def column_names(dataset: Any) -> list[str] | None:
    """The columns of a dataset: its ``column_names`` (Hugging Face), else the keys of its first row when it is
    map-style and not empty; None when they cannot be told without consuming a stream."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list | tuple):
        return [str(n) for n in names]
    size = num_rows(dataset)
    if not size:
        return None
    try:
        return [str(k) for k in dict(dataset[0])]
    except (TypeError, KeyError, IndexError, ValueError):
        return None


def check_prompt_column(dataset: Any, column: str, field: str, spec: str) -> None:
    """Refuse a ``prompt_column`` that is not a column of the dataset (a misspelling would otherwise fall back to
    the rows' own ``prompt``, without the system prompt). The default ``prompt`` is left to preflight's row scan
    (an environment may make the prompts), and so is a dataset whose columns cannot be told (a stream).

    Raises:
        ConfigError: ``field='column' is not a column of SPEC (columns: ...)``.
    """
    if column == "prompt":
        return
    names = column_names(dataset)
    if names is None or column in names:
        return
    raise ConfigError(
        f"{field}={column!r} is not a column of {spec} (columns: {', '.join(sorted(names))})"
        f"{did_you_mean(column, names) or '; set it to the column holding the prompt'}"
    )


_FORMS = "'reasoning_gym:TASK', 'json:PATH' or 'module:callable'"


def load_mixture(config: RolloutConfig) -> Mixture:
    """The :class:`~grpo_core.rollout.mixture.Mixture` of ``config.datasets``, seeded by ``shuffle_seed`` (by 0 with
    ``shuffle`` off: the sources still interleave by weight, each read in its own order).

    Raises:
        ConfigError: a source that cannot be read, is streaming (no length) or empty; names ``rollout.datasets[i]``.
    """
    sources = []
    for i, item in enumerate(config.datasets):
        where = f"rollout.datasets[{i}].path={item.path!r}"
        data = open_dataset(item.path, where, config, item.split, item.column_types, item.dataset_kwargs)
        if num_rows(data) is None:
            raise ConfigError(f"{where} is a streaming dataset (no length); a mixture needs map-style sources")
        check_prompt_column(data, item.prompt_column, f"rollout.datasets[{i}].prompt_column", item.path)
        sources.append(Source(item.source_name(), view(data, item.prompt_column, item.system_prompt), item.weight))
    # shuffle off: a fixed draw (seed 0), as the fingerprint records no shuffle_seed then (a resume that changed it
    # must not change the order)
    seed = config.shuffle_seed if config.shuffle else 0
    return Mixture(sources, config.mixture_epoch_size, seed, config.shuffle)


def default_rewards(config: RolloutConfig) -> list[Callable[..., Any]]:
    """Reward functions implied by the dataset (reasoning-gym's verifier)."""
    specs = [config.dataset] if config.dataset else [s.path for s in config.datasets]
    if any(spec.startswith(REASONING_GYM_PREFIX) for spec in specs):
        return [reasoning_gym_reward]
    return []


def num_rows(dataset: Any) -> int | None:
    """Rows of a map-style dataset, None for a streaming one."""
    try:
        return len(dataset)
    except TypeError:
        return None


def iter_rows(dataset: Any) -> Iterator[dict[str, Any]]:
    """Rows of any dataset as plain dicts, in order."""
    for row in dataset:
        yield dict(row)
