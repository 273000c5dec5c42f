"""The ``rollout`` section: dataset, sampling, rewards, staleness and the rollout loop."""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from grpo_core.config.base import REMOVED_ROLLOUT_FIELDS, _CandidateFilter, _changed, _refuse_removed, _Strict
from grpo_core.errors import ConfigError

logger = logging.getLogger(__name__)


#: Prefixes of ``rollout.dataset`` that name data, not code: the form, then what it reads.
DATA_PREFIXES = ("reasoning_gym:", "json:", "parquet:", "csv:", "arrow:", "disk:", "hf:")
#: File suffixes that make a plain path a data file (with compression suffixes after them).
DATA_SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet", ".csv", ".tsv", ".arrow")
#: Types ``column_types`` may name for a CSV column (``str`` keeps the text as written).
COLUMN_TYPES = ("str", "int", "float", "bool", "json")


def dataset_form(spec: str) -> tuple[str, str]:
    """The form of a dataset spec and what it names: ``(prefix without ':', rest)`` for :data:`DATA_PREFIXES`,
    ``("path", spec)`` for a path (a ``/``, a leading ``~``, ``.`` or ``$``, a data-file suffix of
    :data:`DATA_SUFFIXES`, compressed or not, no ``:`` at all, as a bare folder name ``data``, or a file or folder
    that exists here), else ``("module", spec)`` (``module:callable``)."""
    for prefix in DATA_PREFIXES:
        if spec.startswith(prefix):
            return prefix[:-1], spec[len(prefix) :]
    name = spec.lower()
    for compressed in (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip"):
        name = name.removesuffix(compressed)
    if "/" in spec or "\\" in spec or spec.startswith(("~", ".", "$")) or name.endswith(DATA_SUFFIXES):
        return "path", spec
    if ":" not in spec or os.path.exists(spec):  # 'module:callable' needs its ':'; a local path comes first
        return "path", spec
    return "module", spec


#: Forms of a dataset spec that read a local file or folder (:func:`dataset_form`).
FILE_FORMS = ("path", "json", "parquet", "csv", "arrow", "disk")
#: Forms whose rows ``dataset_kwargs`` reaches (a generated task's config, a callable's arguments).
KWARGS_FORMS = ("reasoning_gym", "module")


def dataset_identity(spec: str) -> str:
    """What a dataset spec reads, one string per data source however the spec is written: a local file or folder as
    ``file:`` and its real absolute path (``json:data.jsonl``, ``data.jsonl`` and ``./data.jsonl`` are one file;
    ``~`` and ``$VAR`` expanded, relative paths from the working folder, as the run reads them); any other spec
    (``reasoning_gym:TASK``, ``hf:owner/name``, ``module:callable``) as written."""
    form, rest = dataset_form(spec)
    if form not in FILE_FORMS:
        return spec
    return "file:" + os.path.realpath(os.path.expanduser(os.path.expandvars(rest)))


def reads_csv(spec: str) -> bool:
    """Whether a dataset spec names CSV/TSV rows (``csv:PATH``, or a path ending in ``.csv``/``.tsv``, compressed or
    not): the only form whose cells ``column_types`` converts (the others carry their own types)."""
    form, rest = dataset_form(spec)
    name = rest.lower()
    for compressed in (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip"):
        name = name.removesuffix(compressed)
    return form == "csv" or (form == "path" and name.endswith((".csv", ".tsv")))


#: A leading ``word:`` of a dataset spec that may be a mistyped prefix (two characters at least: ``C:`` is a drive).
_PREFIX_LIKE = re.compile(r"^([A-Za-z][A-Za-z0-9_.-]+):")


def unknown_prefix_hint(spec: str) -> str:
    """For a dataset spec that named nothing (no such file, no such module): if it starts with a ``word:`` that is
    not one of :data:`DATA_PREFIXES` (``hf2:owner/name``, ``jsonl:data.jsonl``), a sentence naming the known
    prefixes; else ``""``."""
    match = _PREFIX_LIKE.match(spec)
    if match is None or f"{match.group(1)}:" in DATA_PREFIXES:
        return ""
    return (
        f"; {match.group(1) + ':'!r} is not a dataset prefix (known: {', '.join(DATA_PREFIXES)}; "
        "or 'module:callable', a path or a file with a data suffix)"
    )


def _check_column_types(types: dict[str, str], field: str, spec: str | None) -> None:
    bad = {k: v for k, v in types.items() if v not in COLUMN_TYPES}
    if bad:
        raise ConfigError(f"{field}: {bad} are not column types; use one of {', '.join(COLUMN_TYPES)}")
    if types and spec is not None and not reads_csv(spec):
        raise ConfigError(
            f"{field}: {spec!r} is not read as CSV, and column_types converts CSV cells only (JSON lines, Parquet, "
            "Arrow, saved and Hub datasets keep their own types; a generated or module:callable dataset makes its "
            "rows); delete column_types, or give the CSV file as 'csv:PATH' or a .csv/.tsv path"
        )


class DatasetSource(_Strict):
    """One dataset of a weighted mixture (``rollout.datasets``)."""

    path: str = Field(min_length=1)
    """The dataset, in any form ``rollout.dataset`` takes (a file, ``hf:owner/name``, ``reasoning_gym:TASK``, ...)."""
    weight: float = Field(default=1.0, gt=0)
    """Relative share of the mixture's prompts (normalised over the sources); finite."""
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")
    """Name in the per-source metrics ``rollout/source/<name>/...``; None = from the path (its file stem, task or
    dataset name)."""
    split: str = "train"
    """Split of an ``hf:`` dataset or of a saved ``DatasetDict``."""
    prompt_column: str = "prompt"
    """Column holding the prompt (chat messages or a string)."""
    system_prompt: str | None = None
    """System message put before each prompt that has none (a string prompt becomes a user message after it)."""
    column_types: dict[str, str] = Field(default_factory=dict)
    """Types of CSV columns (``str``, ``int``, ``float``, ``bool``, ``json``); other columns are strings. CSV sources
    only (refused with another form)."""
    dataset_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of a ``module:callable`` source, or the task config of a ``reasoning_gym:`` one."""

    def source_name(self) -> str:
        """``name``, else a name from the path: the task, the dataset's or the file's stem (metric-safe)."""
        if self.name:
            return self.name
        form, rest = dataset_form(self.path)
        rest = rest.partition("@")[0].rstrip("/")
        stem = rest.rsplit(":", 1)[-1] if form == "module" else rest.replace("\\", "/").rsplit("/", 1)[-1]
        stem = stem.split(".")[0] if form in ("path", "json", "parquet", "csv", "arrow") else stem
        return re.sub(r"[^A-Za-z0-9_.-]", "_", stem) or "source"

    @model_validator(mode="after")
    def _check_source(self) -> DatasetSource:
        _check_column_types(self.column_types, f"rollout.datasets ({self.path}).column_types", self.path)
        return self


class RolloutConfig(_CandidateFilter):
    """The rollout process: sampling settings, dataset, rewards, tools/environments, pace and transport.

    The ``module:name`` fields (``dataset``, ``reward_functions``, ``tools``, ``environment_factory``,
    ``loop_class``) resolve only inside the allow-list ``GRPO_ALLOWED_MODULES`` (``grpo_core.security.allowlist``)."""

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        return _refuse_removed(data, "rollout", REMOVED_ROLLOUT_FIELDS)

    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature; 0 = greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass kept; 1.0 = off. Below 1 needs top_k > 0."""
    top_k: int = Field(default=0, ge=0)
    """Candidates kept per step; 0 = off."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    """Drop tokens below min_p times the top probability; 0 = off."""
    max_completion_length: int = Field(default=2048, ge=1)
    """Most tokens generated per turn (the request's ``max_tokens``)."""
    num_sampler_logprobs: int = Field(default=8, ge=0)
    """Top log-probs requested per generated token (score centering); 0 = none."""
    max_staleness: int = Field(default=4, ge=0)
    """Most policy versions a sample may lag the trainer before it is dropped."""
    max_concurrent_rollouts: int = Field(default=512, ge=1)
    """Most rollouts in flight at once (also the HTTP connection pool size)."""
    batch_group_prompts: bool = False
    """Send the first requests of a group's rollouts that start together as one request with ``n`` choices
    instead of ``n`` requests (``grpo_core.rollout.coalesce``): on a small model vLLM's API server spends its CPU
    mostly per request. Each rollout keeps its own seed either way; the router then sees one request per group
    (``router/affinity_hit_frac`` counts requests, so it falls towards 0)."""
    server_timeout_s: float = Field(default=1800.0, gt=0)
    """Seconds a single request to the server may take before it is retried."""
    max_retries: int = Field(default=5, ge=0)
    """Retries of a request after connection errors, timeouts and 5xx answers."""
    max_abort_retries: int = Field(default=3, ge=0)
    """Times a turn the server cut short (``finish_reason: abort``) is resubmitted as its continuation before
    its group is dropped (counted in ``rollout/aborted_group_count``); aborted tokens are never trained as a
    finished turn."""
    reward_timeout_s: float | None = Field(default=300.0, gt=0)
    """Seconds one reward function call, or one environment ``get_reward()``, may take; past it the group fails
    (counted in ``rewards/<name>/timeout_count``, charged to ``max_failed_groups``). None = no limit."""
    reward_workers: int = Field(default=2, ge=0)
    """Worker processes that run the sync reward functions, each call in a process's main thread, so functions
    that bound their time with ``signal.alarm`` (math verifiers such as ``math_verify``) work. The function, its
    arguments and its answer are pickled (define it at the top level of an importable module); environments
    reach it as copies. A call past ``reward_timeout_s`` kills its worker, which is replaced. 0 = run them in
    threads of the rollout process (no signals; a timed-out call keeps its thread). Async functions are always
    awaited in the rollout's event loop."""
    score_queue_maxsize: int = Field(default=16, ge=1)
    """Groups (whole groups, not samples) whose rollouts have all finished and that wait for a scoring worker; when
    this many wait, the rollout starts no new group until one is taken (generation held back, the wait logged as
    ``rollout/score_block_s``). Scoring workers: ``reward_workers`` groups at once when a sync reward function runs
    in the worker processes, else ``max_concurrent_rollouts``. Groups already generating still finish and queue, so
    the backlog may pass it by those. Default 16 as TRL's AsyncGRPO ``score_queue_maxsize``."""
    tool_timeout_s: float | None = Field(default=120.0, gt=0)
    """Seconds one tool call, or one environment ``reset()``, may take. A timed-out tool call answers the model
    with an error message (``tools/<name>/timeout_count``); a timed-out ``reset()`` fails its group. None = no
    limit. A timed-out sync call keeps its worker thread until it returns (Python cannot stop a thread)."""
    max_failed_groups: int = Field(default=10, ge=0)
    """Groups that may fail in user code (a reward function, ``env.reset``/``get_reward`` raising or timing out)
    before the run fails naming the last error; each failed group's prompt counts as consumed and is counted in
    ``rollout/failed_group_count``. 0 = the first failure fails the run. A misconfigured function (wrong
    signature, wrong return type or length) fails the run at once."""
    num_generations: int = Field(default=8, ge=2)
    """G: rollouts per prompt (one group); advantages are normalised inside it."""
    scale_rewards: Literal["group", "none"] = "group"
    """Advantages A = r − mean of the group, divided by the group's reward std (``group``, GRPO) or not
    (``none``, Dr. GRPO, Liu et al. 2025)."""
    mask_truncated_completions: bool = False
    """Leave out of the loss the rollouts whose last turn hit ``max_completion_length``
    (``finish_reason: length``; DAPO's overlong filtering, Yu et al. 2025, §3.4); they still count in their
    group's mean and std. Counted in ``rollout/truncated_masked_count``."""
    overlong_buffer_len: int | Literal["auto"] | None = Field(default=None)
    """DAPO's soft overlong punishment (Yu et al. 2025, §3.4, eq. 13): the last this many tokens before
    ``max_completion_length`` (L_cache) are a buffer; a rollout of |y| generated tokens (all turns) gains
    ``overlong_penalty_factor`` × (0 when |y| ≤ L_max − L_cache, ((L_max − L_cache) − |y|) / L_cache inside the buffer,
    −1 beyond L_max), L_max = ``max_completion_length``, added to its reward. ``auto`` = L_max / 5 (the paper's 4096
    of 20480); None = off."""
    overlong_penalty_factor: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    """Scale of the soft overlong punishment (``overlong_buffer_len``): its reward ranges over [−factor, 0]."""
    dataset: str | None = None
    """A data file (``.jsonl``/``.json``, ``.parquet``, ``.csv``/``.tsv``, ``.arrow``, or with the prefix
    ``json:``, ``parquet:``, ``csv:``, ``arrow:``), a folder saved with ``save_to_disk`` (``disk:FOLDER``), a Hub
    dataset from the local cache (``hf:owner/name``), ``reasoning_gym:TASK`` or ``module:callable`` giving a Dataset;
    None = ``datasets``, or the environment's ``reset()`` makes each prompt (``rollout.environment_factory``)."""
    dataset_size: int = Field(default=1000, ge=1)
    """Prompts of a ``reasoning_gym:`` dataset, or of an epoch when an environment's reset() makes the prompts."""
    dataset_seed: int = Field(default=0, ge=0)
    """Seed of a generated (``reasoning_gym:``) dataset."""
    dataset_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of a ``module:callable`` dataset, or the task config of a ``reasoning_gym:`` one."""
    dataset_split: str = "train"
    """Split of an ``hf:`` dataset or of a ``DatasetDict`` saved with ``save_to_disk``."""
    prompt_column: str = "prompt"
    """Column holding each row's prompt: chat messages (a list of ``{"role", "content"}``) or a plain string (one
    user message). The rollout reads it as ``prompt``; the column itself stays for the reward functions."""
    system_prompt: str | None = None
    """System message put before each prompt that has none; None = none added."""
    column_types: dict[str, str] = Field(default_factory=dict)
    """Types of CSV columns (``str``, ``int``, ``float``, ``bool``, ``json``); every other CSV column is read as
    strings, as written. JSON lines, Parquet and Arrow keep their own types: set with a dataset not read as CSV
    (``csv:PATH``, a ``.csv``/``.tsv`` path), it is refused."""
    datasets: list[DatasetSource] = Field(default_factory=list)
    """A weighted mixture instead of ``dataset``: a list of sources, each with ``path`` (any form of ``dataset``) and
    ``weight``, and optionally ``name``, ``split``, ``prompt_column``, ``system_prompt``, ``column_types`` and
    ``dataset_kwargs`` of its own. Each prompt's source is drawn by weight from ``shuffle_seed`` (a resume continues
    the order exactly); metrics per source under ``rollout/source/<name>/``."""
    mixture_epoch_size: int | None = Field(default=None, ge=1)
    """Prompts of one epoch of a mixture (``datasets``); None = the sources' rows together."""
    skip_overlong_prompts: bool = False
    """False: preflight refuses a prompt longer than ``server.max_model_len - rollout.max_completion_length``
    tokens, naming its row. True: such prompts are skipped when met (counted in ``rollout/overlong_prompt_count``)."""
    shuffle: bool = True
    """Visit the prompts in a seeded random order, a new one each epoch (the same for a given ``shuffle_seed`` and
    epoch, so a resume continues it exactly); false = the dataset's order. A streaming (iterable) dataset is read
    in its order."""
    shuffle_seed: int = Field(default=0, ge=0)
    """Seed of the prompt order (``shuffle``)."""
    reward_functions: list[str] = Field(default_factory=list)
    """Reward functions as ``module:name``; rewards of all sources are summed (weighted by ``reward_weights``)."""
    reward_weights: list[float] | None = None
    """One weight per entry of ``reward_functions``: a rollout's reward is Σ weight·value over the functions that
    scored it (an environment's ``get_reward()`` and ``Rollout.reward`` weigh 1); ``rewards/<name>/*`` keep each
    function's own values. None = every weight 1."""
    tools: list[str] = Field(default_factory=list)
    """Tool functions as ``module:name`` (typed, Google docstrings), shown to the model through the chat template."""
    environment_factory: str | dict[str, str] | None = None
    """Environment class ``module:Class``, or name -> class routed by the dataset's ``environment`` column."""
    loop_class: str = "grpo_core.rollout.loop:RolloutLoop"
    """Rollout loop class ``module:Class`` (a ``RolloutLoop`` subclass with overridden hooks)."""
    loop_options: dict[str, Any] = Field(default_factory=dict)
    """Extra fields of the loop class's own config subclass (its ``config_class``)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments of ``tokenizer.apply_chat_template`` (e.g. ``enable_thinking``)."""
    response_template: str | dict[str, Any] | None = None
    """How tool calls are read from a reply (transformers' ``parse_response``): a built-in name (``hermes``,
    ``mistral``, ``llama3``) or a response-template dict; None = the tokenizer's own ``response_template``, else
    the Hermes ``<tool_call>`` regex."""
    max_tool_calling_iterations: int | None = Field(default=None, ge=0)
    """Most tool-calling turns per rollout; None = until the model stops calling tools."""
    num_epochs: int | None = Field(default=1, ge=1)
    """Passes over the prompt dataset (a rejected prompt counts as consumed); None = cycle the dataset until the
    trainer stops the run at ``train.max_steps`` (the one owner of the run's length)."""
    seed: int | None = Field(default=0, ge=0)
    """Base of the per-request sampler seeds (each rollout of a group gets its own seed): reproducible sampling for
    debugging. None = unseeded requests, the faster choice on vLLM, which samples seeded rows one by one (9–19% fewer
    generated tokens per second on an H200, docs/benchmarks.md "Engine calibration"); the GPU configs set it."""
    first_step_tokens: int = Field(default=8192, ge=1)
    """Raw sample tokens a step is assumed to consume before the first report (~ budget x ranks x accumulation)."""
    concurrency_poll_s: float = Field(default=5.0, gt=0)
    """Seconds between ``/metrics`` polls of the adaptive concurrency cap."""
    rollout_worker_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds without a heartbeat from the rollout process before the trainer fails the run."""
    flight_host: str = "127.0.0.1"
    """Interface the rollout process's Arrow Flight server binds; loopback unless the trainer is on another host."""
    flight_port: int = Field(default=0, ge=0, le=65535)
    """Port of the Flight server; 0 = a free port, reported at start."""

    def prompts_summary(self) -> str:
        """Where the prompts come from, in one line for a summary: ``dataset``, a mixture's sources by name with
        their weights and shares (``mixture of math (weight 3, 75%), code (weight 1, 25%)``), or the environment."""
        if self.datasets:
            top = max(d.weight for d in self.datasets)  # weights divided by the largest first: no overflow
            total = sum(s.weight / top for s in self.datasets)
            parts = [f"{s.source_name()} (weight {s.weight:g}, {s.weight / top / total:.0%})" for s in self.datasets]
            return "mixture of " + ", ".join(parts)
        if self.dataset is not None:
            return self.dataset
        return "none (the environment's reset() makes the prompts)" if self.environment_factory else "none"

    def reward_weight_by_name(self, names: list[str]) -> dict[str, float] | None:
        """Each reward function's weight by the name its values are logged under (``names``: the source names of
        ``reward_functions``, in order); None when ``reward_weights`` is unset (every weight 1).

        Raises:
            ConfigError: two functions share a name but not a weight (their rewards could not be told apart).
        """
        if self.reward_weights is None:
            return None
        out: dict[str, float] = {}
        for name, weight in zip(names, self.reward_weights, strict=True):
            if out.setdefault(name, weight) != weight:
                raise ConfigError(
                    f"rollout.reward_weights: two reward functions are named {name!r} with different weights; "
                    "give them distinct names"
                )
        return out

    def overlong_buffer_tokens(self) -> int | None:
        """L_cache of the soft overlong punishment in tokens (``overlong_buffer_len``, ``auto`` resolved against
        ``max_completion_length``), or None when it is off."""
        if self.overlong_buffer_len == "auto":
            return max(1, self.max_completion_length // 5)
        return self.overlong_buffer_len

    @model_validator(mode="after")
    def _check_rollout_fields(self) -> RolloutConfig:
        if self.temperature == 0 and self.num_generations > 1:
            logger.warning(
                "rollout.temperature=0 makes the %d rollouts of a group identical: every group has zero "
                "reward std and is dropped; raise rollout.temperature",
                self.num_generations,
            )
        if self.datasets and self.dataset is not None:
            raise ConfigError("rollout.dataset and rollout.datasets are both set; keep one (datasets is a mixture)")
        names = [s.source_name() for s in self.datasets]
        if len(set(names)) < len(names):
            raise ConfigError(f"rollout.datasets: two sources are named alike ({names}); give each its own name")
        if self.mixture_epoch_size is not None and not self.datasets:
            logger.warning("rollout.mixture_epoch_size has no effect without rollout.datasets")
        if self.datasets:
            changed = _changed(self)  # not model_fields_set: a saved config sets every field
            for name in ("dataset_split", "prompt_column", "system_prompt", "column_types"):
                if name in changed:
                    logger.warning("rollout.%s has no effect with rollout.datasets: each source sets its own", name)
        _check_column_types(self.column_types, "rollout.column_types", self.dataset)
        if isinstance(self.environment_factory, dict) and not self.environment_factory:
            raise ConfigError("rollout.environment_factory is an empty dict; name at least one environment or set None")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_functions):
            raise ConfigError(
                f"rollout.reward_weights has {len(self.reward_weights)} weight(s) for "
                f"{len(self.reward_functions)} rollout.reward_functions; give one weight per function, in their "
                "order, or unset it (every weight 1)"
            )
        buffer = self.overlong_buffer_len
        if isinstance(buffer, int) and not 1 <= buffer <= self.max_completion_length:
            raise ConfigError(
                f"rollout.overlong_buffer_len={buffer} must lie in [1, rollout.max_completion_length="
                f"{self.max_completion_length}] (the buffer is the last tokens before the limit); lower it, use "
                "'auto' (a fifth of the limit) or unset it"
            )
        if buffer is None and "overlong_penalty_factor" in _changed(self):
            logger.warning("rollout.overlong_penalty_factor has no effect without rollout.overlong_buffer_len")
        for name in [*self.reward_functions, *self.tools, self.loop_class]:
            if ":" not in name:
                raise ConfigError(f"rollout: {name!r} must be 'module:attribute' (e.g. 'my_rewards:accuracy')")
        if self.max_tool_calling_iterations is not None and not self.tools and self.environment_factory is None:
            logger.warning(
                "rollout.max_tool_calling_iterations has no effect without rollout.tools or rollout.environment_factory"
            )
        return self
