"""Prompt datasets of the rollout loop: HF Dataset / IterableDataset, reasoning-gym, JSON lines.

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
import glob
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from grpo_core.allowlist import import_object
from grpo_core.config import RolloutConfig, user_path
from grpo_core.entries import config_entry
from grpo_core.errors import ConfigError, did_you_mean

REASONING_GYM_PREFIX = "reasoning_gym:"
RG_SYSTEM_PROMPT = "Solve the problem. Think briefly, then give only the final answer inside <answer></answer> tags."


def reasoning_gym_dataset(task: str, size: int, seed: int, **task_config: Any) -> Any:
    """A reasoning-gym task as an HF Dataset: ``prompt`` (system + question), ``answer``, ``rg_task``, ``rg_entry``.

    ``rg_entry`` is the task entry as JSON (for ``score_answer``); score it with
    :func:`reasoning_gym_reward`. ``task_config`` (``rollout.dataset_kwargs``) goes to the task's
    config, e.g. ``min_terms``/``max_digits`` of ``chain_sum``.
    """
    import datasets
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    spec = f"rollout.dataset='{REASONING_GYM_PREFIX}{task}'"
    if task not in DATASETS:
        hint = did_you_mean(task, DATASETS, REASONING_GYM_PREFIX) or f"; the tasks: {', '.join(sorted(DATASETS))}"
        raise ConfigError(f"{spec}: no such reasoning-gym task{hint}")
    try:
        source = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_config)
    except TypeError as exc:  # an option the task's config class does not take
        options = sorted(getattr(DATASETS[task][1], "__dataclass_fields__", ()))
        raise ConfigError(
            f"{spec}: rollout.dataset_kwargs {task_config} are not all options of the task ({exc}); "
            f"its options: {', '.join(options)}"
        ) from None
    except (KeyError, ValueError, AssertionError) as exc:  # the task's config refuses a value
        raise ConfigError(f"{spec} with rollout.dataset_kwargs {task_config}: {exc}") from None
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
_JSON_FIX = 'write one JSON object per line ({"prompt": [{"role": "user", "content": "..."}]}), or fix the path'


#: Compressed files the datasets json loader opens (fsspec's compression by suffix).
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")


def _json_lines_files(pattern: str) -> list[Path]:
    """The local files a ``json:`` dataset names: the path, or every match of a glob pattern ([] for a URL).

    Raises:
        ConfigError: nothing matches, or the path is a folder (names ``rollout.dataset`` and the fix).
    """
    spec = f"rollout.dataset='{JSON_PREFIX}{pattern}'"
    if "://" in pattern:
        return []  # a URL (https://, hf://, s3://): datasets fetches and reads it
    path = user_path(pattern)  # ~ and $VARS, as every path setting (grpo_core.config.user_path)
    if glob.has_magic(pattern):
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
        if not files:
            raise ConfigError(f"{spec}: no file matches {pattern!r}; {_JSON_FIX}")
        return files
    if path.is_dir():
        raise ConfigError(
            f"{spec}: {path} is a folder; name a JSON-lines file in it (or a glob, e.g. '{JSON_PREFIX}{path}/*.jsonl')"
        )
    if not path.is_file():
        raise ConfigError(f"{spec}: no such file {path.resolve()}; {_JSON_FIX}")
    return [path]


def _json_lines_problem(path: Path) -> str | None:
    """Where ``path`` stops being JSON lines (``line N is ...``); None when every non-blank line is a JSON object, or
    the file starts with ``[`` (one JSON array) or is compressed (``.gz``, ...), which ``datasets`` reads and checks
    itself."""
    if path.suffix.lower() in COMPRESSED_SUFFIXES:
        return None
    try:
        with path.open("rb") as f:
            if f.read(4096).lstrip().startswith(b"["):
                return None
            f.seek(0)
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    return f"line {number} is not UTF-8 text (byte {e.start})"
                line = line.strip()
                if not line:
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    return f"line {number} is not JSON ({e.msg}, column {e.colno}): {line[:60]!r}"
                if not isinstance(value, dict):
                    return f"line {number} is a JSON {type(value).__name__}, not an object: {line[:60]!r}"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def json_lines_dataset(pattern: str) -> Any:
    """A ``json:PATH`` prompt dataset: an HF Dataset of the JSON-lines file(s) ``pattern`` names (a path or a glob;
    a file holding one JSON array of objects is read too, as ``datasets``' json loader does).

    Raises:
        ConfigError: no such file, a folder, or a file ``datasets`` cannot read; names ``rollout.dataset``, the
            file, the first line that is not a JSON object when there is one, and the fix.
    """
    import datasets

    files = _json_lines_files(pattern)
    for path in files:  # pyarrow takes some broken files (bytes that are not UTF-8) and fails only on reading a row
        problem = _json_lines_problem(path)
        if problem is not None:
            raise ConfigError(f"rollout.dataset='{JSON_PREFIX}{pattern}': {path}, {problem}; {_JSON_FIX}")
    loader_log = logging.getLogger("datasets.packaged_modules.json.json")  # logs each failure before it raises
    level, bars_off = loader_log.level, datasets.utils.are_progress_bars_disabled()
    loader_log.setLevel(logging.CRITICAL)
    datasets.utils.disable_progress_bars()
    try:
        return datasets.load_dataset("json", data_files=[str(f) for f in files] or pattern, split="train")
    except Exception as exc:  # noqa: BLE001 - pyarrow/datasets raise many types; each is reported as bad input
        cause = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        where = ", ".join(map(str, files)) or pattern
        raise ConfigError(
            f"rollout.dataset='{JSON_PREFIX}{pattern}': the datasets json loader cannot read {where} "
            f"({type(exc).__name__}: {cause}); {_JSON_FIX}"
        ) from None
    finally:
        loader_log.setLevel(level)
        if not bars_off:
            datasets.utils.enable_progress_bars()


def load_dataset(config: RolloutConfig) -> Any:
    """The prompt dataset named by ``config.dataset``.

    Raises:
        ConfigError: unset, unknown form, a ``json:`` file that is missing or not JSON lines
            (:func:`json_lines_dataset`), or the callable does not return rows.
    """
    spec = config.dataset
    if spec is None:
        raise ConfigError(
            "rollout.dataset is unset and no rollout.environment_factory makes the prompts; set it to "
            "'reasoning_gym:TASK', 'json:PATH' or 'module:callable'"
        )
    if spec.startswith(REASONING_GYM_PREFIX):
        return reasoning_gym_dataset(
            spec[len(REASONING_GYM_PREFIX) :], config.dataset_size, config.dataset_seed, **config.dataset_kwargs
        )
    if spec.startswith(JSON_PREFIX):
        return json_lines_dataset(spec[len(JSON_PREFIX) :])
    factory = import_object(spec, "rollout.dataset")
    data = factory(**config.dataset_kwargs) if callable(factory) else factory
    if not isinstance(data, Iterable):
        raise ConfigError(f"rollout.dataset={spec!r} returned {type(data).__name__}, not a Dataset or rows")
    return data


def default_rewards(config: RolloutConfig) -> list[Callable[..., Any]]:
    """Reward functions implied by the dataset (reasoning-gym's verifier)."""
    if config.dataset and config.dataset.startswith(REASONING_GYM_PREFIX):
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
