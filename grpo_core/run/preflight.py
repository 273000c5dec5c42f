"""Checks of a run config that need imports, data or the disk but no server (fail fast before anything starts).

``RunConfig`` validation catches field and cross-field errors; :func:`check_run` first refuses any
name of code outside the allow-list (``grpo_core.security.allowlist``, before anything is imported), then adds
what only importing the named code, reading the dataset or touching the disk can tell: the model name
resolves (a Hub id is downloaded here, once, before any server starts) and its layers can be
packed, the loop class, reward functions and tools import, the dataset has the columns the
rollout needs, the folders and SQLite files the run writes can be created and opened (``grpo_core.run.stores``; the
MLflow store and ``resume_from``: ``grpo_core.tracking.checks``), and a Hub push (``export.push_to_hub``) has a
repository id and a token.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from grpo_core.config import RunConfig
from grpo_core.config.shown_once import show_once
from grpo_core.errors import ConfigError
from grpo_core.models.hub import check_push
from grpo_core.run.stores import ensure_dir
from grpo_core.tracking.checks import check_resume_from, check_tracking

logger = show_once(logging.getLogger(__name__))  # its warnings once per process, as the config's


def check_model(cfg: RunConfig) -> None:
    """Resolve ``model.name`` (find a folder or download a Hub id; registry names need nothing) and
    check that every layer of it can run on packed tree rows (built on the meta device, no weights read), that
    ``train.router_aux_loss_coef`` fits it (a nonzero value needs a mixture-of-experts model), and that each
    ``train.lora.target_modules`` name is a module of it (:func:`check_lora_targets`). A router loss that turns
    ``train.overlap_micro_batches`` off is warned about (:func:`warn_overlap_off`).

    Raises:
        ConfigError: the name does not resolve, a layer cannot be packed (the layer type named), a nonzero
            ``train.router_aux_loss_coef`` is set for a dense model, or a LoRA target names no module.
    """
    from types import SimpleNamespace

    from grpo_core.models import registry_config, registry_names, registry_shape, resolve_model_dir
    from grpo_core.train.moe import resolve_router_aux_loss_coef
    from grpo_core.train.packable import check_model_folder, meta_text_model

    name, coef = cfg.model.name, cfg.train.router_aux_loss_coef
    if name in registry_names() and cfg.model.revision is None:
        # packable architectures of a known shape, built (seconds to a minute) by the first process that needs them
        used = resolve_router_aux_loss_coef(coef, SimpleNamespace(**registry_shape(name)), name)
        if cfg.train.lora.enabled:  # the modules of the architecture, on the meta device (nothing built)
            check_lora_targets(cfg, meta_text_model(registry_config(name), name))
    else:
        path = resolve_model_dir(cfg.model)
        model = check_model_folder(path, name, cfg.token_budget())
        from transformers import AutoConfig

        used = resolve_router_aux_loss_coef(coef, AutoConfig.from_pretrained(path), name)
        check_lora_targets(cfg, model)
    warn_overlap_off(cfg, used)


def check_lora_targets(cfg: RunConfig, model: Any) -> None:
    """Each name of ``train.lora.target_modules`` matches a module of the model as PEFT matches it (the module's
    full name, or its last dotted parts: ``q_proj`` matches ``model.layers.0.self_attn.q_proj``). PEFT refuses a
    list only when no name matches, when the trainer starts, and silently leaves out the names that match nothing.

    Args:
        cfg: the run config (``train.lora``; nothing to check unless it is enabled with a list of names).
        model: the policy's language model (``torch.nn.Module``; the meta device will do).

    Raises:
        ConfigError: names the targets that match no module and the model's linear layers' names.
    """
    import torch

    lora = cfg.train.lora
    if not lora.enabled or lora.target_modules == "all-linear":
        return
    names = [n for n, _ in model.named_modules() if n]
    missing = [t for t in lora.target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and isinstance(m, torch.nn.Linear)}
        )
        raise ConfigError(
            f"train.lora.target_modules: {missing} name no module of model.name={cfg.model.name!r}, so no adapter "
            f"would be trained there; its linear layers are named {', '.join(linear)}: list some of those, or write "
            "train.lora.target_modules: all-linear"
        )


def warn_overlap_off(cfg: RunConfig, router_aux_loss_coef: float) -> None:
    """Warn when ``train.overlap_micro_batches`` is asked for but a mixture-of-experts router loss turns it off.

    Args:
        cfg: the run config.
        router_aux_loss_coef: the router loss weight the trainer will use (``train.router_aux_loss_coef`` resolved
            against the model's config; 0 for a dense model or when off).
    """
    if cfg.train.overlap_micro_batches and router_aux_loss_coef > 0:
        logger.warning(
            "train.overlap_micro_batches has no effect: model.name=%r is a mixture-of-experts model with a router "
            "load-balancing loss (train.router_aux_loss_coef resolves to %g), which is weighted by the step's "
            "micro-batch count, so the trainer pulls each whole step before training it; set "
            "train.overlap_micro_batches: false to say so, or train.router_aux_loss_coef: 0 to train without the "
            "router loss and keep the overlap",
            cfg.model.name,
            router_aux_loss_coef,
        )


def check_trainer_device(cfg: RunConfig, gpu_count: Callable[[], int] | None = None) -> str | None:
    """Whether this host can run the trainer's ranks on the device ``train.device`` names: the flow's torchrun
    (node 0 of a multi-node run too) starts them here, and ``cuda`` on a host torch sees no GPU on failed only once
    the servers were up, in the trainer's ``torch.cuda.set_device``.

    Args:
        cfg: the run config.
        gpu_count: the CUDA devices torch can use here (``CUDA_VISIBLE_DEVICES`` applied); None =
            ``torch.cuda.device_count``.

    Returns:
        What this host lacks, naming the field and the fix; None when it has it (or ``train.device`` is not
        ``cuda``).
    """
    if cfg.train.device != "cuda":
        return None
    if gpu_count is None:
        import torch

        gpu_count = torch.cuda.device_count
    if gpu_count() > 0:
        return None
    return (
        "train.device is 'cuda' but torch sees no CUDA GPU on this host (torch.cuda.device_count() is 0), where the "
        "flow starts the trainer's ranks: run on a GPU host (a CUDA build of torch, CUDA_VISIBLE_DEVICES not empty), "
        "or set train.device to 'auto' (CUDA where there is one, else CPU) or 'cpu'"
    )


def check_packing(cfg: RunConfig) -> None:
    """``packing.backend`` names an installed packer (``rust``, ``python`` or a ``grpo_core.packers`` entry point)
    that loads and follows the :class:`~grpo_core.packing.Packer` protocol (:func:`grpo_core.packing.get_packer`);
    the trainer would otherwise fail only when it starts.

    Raises:
        ConfigError: no such backend (names the installed ones), or it does not implement ``Packer``.
    """
    from grpo_core.packing import get_packer

    get_packer(cfg.packing.backend)


#: Rows of a prompt dataset checked before the run (all of a smaller one; the scan says when it stopped short).
MAX_CHECKED_ROWS = 100_000


def _prompt_problem(prompt: object) -> str | None:
    """Why a row's ``prompt`` cannot be rendered (None when it can): a non-empty string, or a non-empty
    list of ``{"role": str, "content": ...}`` messages with some content."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "an empty string"
    if not isinstance(prompt, list | tuple) or not prompt:
        return "missing" if prompt is None else f"{type(prompt).__name__} {prompt!r}"[:120]
    for j, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            return f"message {j} ({message!r})"[:160] + " is not a {'role', 'content'} message"
    if not any(str(m.get("content") or "").strip() for m in prompt):
        return "messages without any content"
    return None


def _reward_functions(cfg: RunConfig) -> list[tuple[str, Callable[..., Any]]]:
    from grpo_core.rollout.data import default_rewards
    from grpo_core.security.allowlist import import_object

    funcs = [(name, import_object(name, "rollout.reward_functions")) for name in cfg.rollout.reward_functions]
    return funcs + [(f.__name__, f) for f in default_rewards(cfg.rollout)]


def check_reward_pickling(cfg: RunConfig) -> None:
    """With ``rollout.reward_workers > 0`` each sync reward function (of training and of ``eval``) is sent to a
    worker process by pickling it (:mod:`grpo_core.rollout.reward_pool`); one that cannot be pickled (a lambda, a
    nested function, a local class's method) would fail only at the first group, so it is refused here.

    Raises:
        ConfigError: names the function, the pickling error and the three fixes.
    """
    from grpo_core.rollout.reward_pool import pickling_error
    from grpo_core.rollout.usercode import is_async

    workers = cfg.rollout.reward_workers
    if workers == 0:
        return
    funcs = [(f"rollout.reward_functions: {name}", func) for name, func in _reward_functions(cfg)]
    if cfg.eval.enabled and cfg.eval.reward_functions is not None:
        from grpo_core.security.allowlist import import_object

        funcs += [
            (f"eval.reward_functions: {n}", import_object(n, "eval.reward_functions"))
            for n in cfg.eval.reward_functions
        ]
    for what, func in funcs:
        error = None if is_async(func) else pickling_error(what, func)
        if error is not None:
            raise ConfigError(
                f"{error}, make it async, or set rollout.reward_workers: 0 (threads of the rollout process): with "
                f"rollout.reward_workers={workers} sync reward functions are sent to worker processes pickled"
            )


def required_reward_columns(cfg: RunConfig) -> dict[str, str]:
    """Dataset columns the reward functions need: parameter name -> function name.

    Raises:
        ConfigError: a function needs an argument grpo-flow cannot supply (``UNSUPPORTED_REWARD_ARGUMENTS``).
    """
    return _reward_columns(_reward_functions(cfg), "rollout.reward_functions")


def _reward_columns(funcs: Sequence[tuple[str, Callable[..., Any]]], field: str) -> dict[str, str]:
    """Dataset columns the reward functions ``funcs`` (``(name, function)``, named in ``field``) need: parameter
    name -> function name (:func:`required_reward_columns`).

    Raises:
        ConfigError: a function needs an argument grpo-flow cannot supply (names ``field``).
    """
    from grpo_core.rollout.scoring import REWARD_ARGUMENTS, UNSUPPORTED_REWARD_ARGUMENTS

    needed: dict[str, str] = {}
    for name, func in funcs:
        for param in inspect.signature(func).parameters.values():
            required = param.default is inspect.Parameter.empty and param.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                inspect.Parameter.KEYWORD_ONLY,
            )
            if not required or param.name in REWARD_ARGUMENTS:
                continue
            if param.name in UNSUPPORTED_REWARD_ARGUMENTS:
                raise ConfigError(
                    f"{field}: {name} needs {param.name!r}, which grpo-flow does not "
                    f"supply: {UNSUPPORTED_REWARD_ARGUMENTS[param.name]}. Give it a default or remove "
                    f"it (supplied: {', '.join(REWARD_ARGUMENTS)} and the dataset's columns)"
                )
            needed[param.name] = name
    return needed


def dataset_rows(cfg: RunConfig) -> Iterator[tuple[str, int, dict]]:
    """``(where, index, row)`` of every row the run's prompts come from, up to :data:`MAX_CHECKED_ROWS` of each
    dataset (a warning says when one is longer): ``where`` names the setting (``rollout.dataset='...'``, or
    ``rollout.datasets[i].path='...'`` for each source of a mixture), ``index`` the row in that dataset.

    Raises:
        ConfigError: a dataset that cannot be read (:func:`grpo_core.rollout.data.load_dataset`).
    """
    from grpo_core.rollout.data import iter_rows, load_dataset

    rollout = cfg.rollout
    data = load_dataset(rollout)
    if rollout.datasets:
        parts = [
            (f"rollout.datasets[{i}].path={d.path!r}", source.rows)
            for i, (d, source) in enumerate(zip(rollout.datasets, data.sources, strict=True))
        ]
    else:
        parts = [(f"rollout.dataset={rollout.dataset!r}", data)]
    for where, rows in parts:
        count = 0
        for count, row in enumerate(iter_rows(rows), start=1):
            if count > MAX_CHECKED_ROWS:
                logger.warning("%s: checked its first %d rows only", where, MAX_CHECKED_ROWS)
                break
            yield where, count - 1, row
        if count == 0:
            raise ConfigError(f"{where} has no rows")


def check_dataset(cfg: RunConfig) -> None:
    """Check the dataset's rows: each has a usable ``prompt`` and a value (not null) in every column the reward
    functions need. Every row is read, up to :data:`MAX_CHECKED_ROWS` of each dataset (:func:`dataset_rows`).

    Raises:
        ConfigError: no dataset, an empty one, a row without a usable ``prompt`` (without an environment),
            a reward function argument that is no column of a row or null there, or one grpo-flow cannot supply;
            the message names the dataset, the row and the column.
    """
    rollout = cfg.rollout
    needed = required_reward_columns(cfg)
    if rollout.dataset is None and not rollout.datasets:
        if rollout.environment_factory is None:
            raise ConfigError(
                "rollout.dataset is unset and there is no rollout.environment_factory: set "
                "rollout.dataset to a data file (.jsonl, .parquet, .csv, .arrow), 'hf:owner/name', "
                "'reasoning_gym:TASK', 'json:PATH' or 'module:callable' (or rollout.datasets to a mixture)"
            )
        if needed:  # the environment makes the prompts: there are no columns
            column, name = next(iter(needed.items()))
            raise ConfigError(
                f"rollout.reward_functions: {name} needs the dataset column {column!r}, but "
                "rollout.dataset is unset (the environment makes the prompts)"
            )
        return
    for where, index, row in dataset_rows(cfg):
        _check_row(cfg, where, index, row, needed)


def _check_row(cfg: RunConfig, where: str, index: int, row: dict, needed: dict[str, str]) -> None:
    if cfg.rollout.environment_factory is None:
        if "prompt" not in row:
            raise ConfigError(
                f"{where} row {index} has no 'prompt' column (columns: {sorted(row)}); "
                "add a 'prompt' column (a list of {'role', 'content'} messages), name the column holding the "
                "prompt (rollout.prompt_column), or set rollout.environment_factory"
            )
        problem = _prompt_problem(row["prompt"])
        if problem is not None:
            raise ConfigError(
                f"{where} row {index}: its 'prompt' is {problem}; every row needs a "
                "prompt (a non-empty list of {'role', 'content'} messages, or a string): fix or drop "
                "the row"
            )
    _check_reward_columns(where, index, row, needed, "rollout.reward_functions")


def _check_reward_columns(where: str, index: int, row: dict, needed: dict[str, str], field: str) -> None:
    for column, name in needed.items():
        if row.get(column) is None:
            state = "no such column" if column not in row else "null or missing there"
            raise ConfigError(
                f"{field}: {name} needs the dataset column {column!r}, which "
                f"{where} lacks in row {index} ({state}; columns: {sorted(row)}); fill it in that row, drop the row, "
                f"or give the function's {column!r} a default if it can score without it"
            )


def check_eval(cfg: RunConfig) -> None:
    """The held-out evaluation (``eval``, docs/evaluation.md), checked as the training data is: its dataset loads
    with a prompt in every row, its reward functions import, and every row holds (not null) each column they need
    (up to :data:`MAX_CHECKED_ROWS` rows). Prompt lengths: :func:`check_eval_prompt_lengths`.

    Raises:
        ConfigError: naming ``eval.dataset`` and the row, and ``eval.reward_functions`` (or
            ``rollout.reward_functions`` when they score the eval samples) (``grpo_core.rollout.evaluate.eval_rows``).
    """
    if not cfg.eval.enabled:
        return
    from grpo_core.rollout.evaluate import eval_dataset_config, eval_rewards, eval_rows

    ev = cfg.eval
    rows = eval_rows(ev, cfg.rollout)
    funcs = eval_rewards(ev, cfg.rollout, eval_dataset_config(ev, cfg.rollout))
    field = "eval.reward_functions" if ev.reward_functions is not None else "rollout.reward_functions (eval's)"
    named = [(f"{getattr(f, '__module__', '?')}:{getattr(f, '__qualname__', f)}", f) for f in funcs]
    needed = _reward_columns(named, field)
    for index, row in enumerate(rows[:MAX_CHECKED_ROWS]):
        _check_reward_columns(f"eval.dataset={ev.dataset!r}", index, row, needed, field)


#: Tokens a tokenizer may add to a text beyond one per byte (SentencePiece word-start markers), in the fast check.
_LENGTH_MARGIN = 32


def _prompt_measure(cfg: RunConfig) -> Callable[[Any, Any, int], int | None] | None:
    """A function ``(prompt, tool schemas, limit) -> its length in tokens when above limit, else None`` that renders a
    prompt as ``RolloutLoop.render`` does; None (with a warning) when the loop class renders prompts itself."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from grpo_core.models import tokenizer_dir
    from grpo_core.rollout.build import loop_class_and_config
    from grpo_core.rollout.loop import RolloutLoop

    cls, _ = loop_class_and_config(cfg.rollout)
    if cls.render is not RolloutLoop.render or cls.render_text is not RolloutLoop.render_text:
        logger.warning("rollout.loop_class renders prompts itself: their lengths are judged by the rollout only")
        return None
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(cfg.model))
    loop = SimpleNamespace(tokenizer=tokenizer, config=cfg.rollout)  # what RolloutLoop.render reads

    def measure(prompt: Any, schemas: Any, limit: int) -> int | None:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = RolloutLoop.render_text(loop, messages, schemas)  # type: ignore[arg-type]
        # A token holds at least one byte of the text (a SentencePiece tokenizer may add a word-start marker to a
        # segment: the margin), so a text this short fits without encoding it; the rollout checks every prompt again.
        if len(text.encode()) + _LENGTH_MARGIN <= limit:
            return None
        length = len(tokenizer.encode(text, add_special_tokens=False))  # as RolloutLoop.render
        return length if length > limit else None

    return measure


def check_prompt_lengths(cfg: RunConfig) -> None:
    """Every prompt leaves room for a full completion: rendered with the chat template (and the tools' schemas) as
    the rollout renders it, no longer than ``server.max_model_len - rollout.max_completion_length`` tokens. Rows an
    environment makes, and a loop class with its own ``render``, are not judged (the rollout counts what it skips
    in ``rollout/overlong_prompt_count``).

    Raises:
        ConfigError: without ``rollout.skip_overlong_prompts``, the first prompt over the limit (names the dataset,
            the row, its length and the fixes); with it, a warning counts them instead.
    """
    from grpo_core.rollout.tools import tool_schemas
    from grpo_core.security.allowlist import import_object

    rollout = cfg.rollout
    if rollout.environment_factory is not None or (rollout.dataset is None and not rollout.datasets):
        return
    measure = _prompt_measure(cfg)
    if measure is None:
        return
    tools = [import_object(name, "rollout.tools") for name in rollout.tools]
    schemas = tool_schemas(tools) if tools else None
    limit = cfg.server.max_model_len - rollout.max_completion_length
    over = 0
    for where, index, row in dataset_rows(cfg):
        length = measure(row["prompt"], schemas, limit)
        if length is None:
            continue
        over += 1
        if not rollout.skip_overlong_prompts:
            raise ConfigError(
                f"{where} row {index}: its prompt is {length} tokens (chat template applied), more than "
                f"server.max_model_len ({cfg.server.max_model_len}) - rollout.max_completion_length "
                f"({rollout.max_completion_length}) = {limit}, so it could never be trained; raise "
                "server.max_model_len, lower rollout.max_completion_length, shorten or drop the row, or set "
                "rollout.skip_overlong_prompts: true to skip such prompts (counted in rollout/overlong_prompt_count)"
            )
    if over:
        logger.warning(
            "%d prompts are longer than server.max_model_len - rollout.max_completion_length = %d tokens: the run "
            "skips them (rollout.skip_overlong_prompts), counted in rollout/overlong_prompt_count",
            over,
            limit,
        )


def check_eval_prompt_lengths(cfg: RunConfig) -> None:
    """Every eval prompt leaves room for a full eval completion, as :func:`check_prompt_lengths` judges training's:
    rendered as the evaluation renders it (no tools), no longer than ``server.max_model_len -
    eval.max_completion_length`` (else ``rollout.max_completion_length``) tokens; a longer one would be sampled with
    a shorter budget, or left out when no room is left, and skew ``eval/*``.

    Raises:
        ConfigError: without ``rollout.skip_overlong_prompts``, the first eval prompt over the limit (names
            ``eval.dataset``, the row, its length and the fixes); with it, a warning counts them instead.
    """
    ev = cfg.eval
    if not ev.enabled:
        return
    from grpo_core.rollout.evaluate import eval_rows

    measure = _prompt_measure(cfg)
    if measure is None:
        return
    budget, field = ev.max_completion_length, "eval.max_completion_length"
    if budget is None:
        budget, field = (
            cfg.rollout.max_completion_length,
            "rollout.max_completion_length (eval.max_completion_length unset)",
        )
    limit, over, first, longest = cfg.server.max_model_len - budget, 0, None, 0
    for index, row in enumerate(eval_rows(ev, cfg.rollout)[:MAX_CHECKED_ROWS]):
        length = measure(row["prompt"], None, limit)
        if length is None:
            continue
        over, first, longest = over + 1, first or (index, length), max(longest, length)
    if first is not None and not cfg.rollout.skip_overlong_prompts:  # every row measured: the longest is known
        index, length = first
        fits = cfg.server.max_model_len - longest
        fix = (
            f"set {field.split()[0]} to at most {fits} (fits the longest eval prompt, {longest} tokens) or raise "
            "server.max_model_len"
        )
        if fits < 1:
            fix = f"raise server.max_model_len above {longest} (the longest eval prompt's tokens)"
        raise ConfigError(
            f"eval.dataset={ev.dataset!r} row {index}: its prompt is {length} tokens (chat template applied), more "
            f"than server.max_model_len ({cfg.server.max_model_len}) - {field} ({budget}) = {limit}, so its "
            f"completions would be cut short; {fix}, shorten or drop the row, or set "
            "rollout.skip_overlong_prompts: true to evaluate such prompts with what room is left"
        )
    if over:
        logger.warning(
            "%d eval prompts are longer than server.max_model_len - %s = %d tokens: they are evaluated with a "
            "shorter budget (rollout.skip_overlong_prompts), those leaving no room not at all",
            over,
            field,
            limit,
        )


def check_chat_template(cfg: RunConfig) -> None:
    """The model's tokenizer has a chat template, unless the loop class renders prompts itself.

    The rollout renders every prompt with ``tokenizer.apply_chat_template`` (``RolloutLoop.render``).

    Raises:
        ConfigError: no chat template and ``render`` not overridden (names ``model.name`` and the fixes).
    """
    from transformers import AutoTokenizer

    from grpo_core.models import tokenizer_dir
    from grpo_core.rollout.build import loop_class_and_config
    from grpo_core.rollout.loop import RolloutLoop

    cls, _ = loop_class_and_config(cfg.rollout)
    if cls.render is not RolloutLoop.render:
        return
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(cfg.model))
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"model.name={cfg.model.name!r}: its tokenizer has no chat template, which the rollout "
            "needs to render the conversational prompts; use a chat (instruct) model, add a "
            "chat_template to its tokenizer files, or override render() in rollout.loop_class"
        )


def check_adapter_store(cfg: RunConfig) -> None:
    """``train.adapter_store`` (a LoRA run's shared folder or fsspec URL) is usable from this host before anything
    starts: a known fsspec protocol whose package is installed (not ``memory://``, one process's), not a URL with
    one slash (``s3:/bucket``, else a local folder named ``s3:``), and a folder (not a file) whose parent exists (a
    missing parent is most often a shared mount that is not there: the trainer would fill a local folder no server
    host sees).

    Raises:
        ConfigError: naming ``train.adapter_store``, the problem and the fix.
    """
    import fsspec
    from fsspec.core import split_protocol

    url = cfg.train.adapter_store
    if url is None or not cfg.train.lora.enabled:
        return
    what = f"train.adapter_store={url!r}"
    protocol, path = split_protocol(url)
    if protocol is None and re.match(r"[A-Za-z][\w+.-]+:/(?!/)", url):
        raise ConfigError(f"{what} looks like a URL with one slash; write {url.replace(':/', '://', 1)!r}, or a folder")
    if protocol not in (None, "file", "local"):
        if protocol == "memory":
            raise ConfigError(
                f"{what}: fsspec's memory filesystem lives inside one process, and the servers are "
                "other processes; write a shared folder or an object-store URL ('s3://bucket/run')"
            )
        if protocol not in fsspec.available_protocols():
            raise ConfigError(
                f"{what}: unknown fsspec protocol {protocol!r}; write a shared folder (e.g. "
                "/mnt/grpo-adapters/run) or an fsspec URL such as 's3://bucket/run' or 'gs://bucket/run'"
            )
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as exc:
            raise ConfigError(
                f"{what}: {exc} (fsspec's {protocol!r} protocol needs it installed in this environment)"
            ) from None
        return
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{what} is a file; give a folder every server host sees (a shared mount) or an fsspec URL")
    if not folder.exists() and not folder.absolute().parent.is_dir():
        raise ConfigError(
            f"{what}: {folder.absolute().parent} does not exist on this host; mount the shared store "
            "there (or create it), or fix the path"
        )
    if folder.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{what}: the folder is not writable; point the setting at a writable shared folder")


def check_tokens(cfg: RunConfig, runs_here: bool = True) -> str | None:
    """The bearer tokens this environment gives the run are usable, and several trainer hosts can share one.

    ``GRPO_RUN_TOKEN`` and ``GRPO_SERVER_API_KEY`` travel in HTTP ``Authorization`` headers (printable ASCII, not
    blank: :func:`grpo_core.security.auth.token_problem`). With ``train.nnodes`` > 1 the run's token must come from this
    environment: every trainer rank proves it holds it (:func:`grpo_core.train.distributed.check_members`), a token
    the flow drew at random no other trainer host could know, and a short one would be guessable.

    Args:
        cfg: the run config.
        runs_here: False (``grpo validate``, which may run ahead of deployment on another host than trainer-0): a
            missing or short shared ``GRPO_RUN_TOKEN`` is returned as a note instead of raised.

    Returns:
        The note (``runs_here=False`` only), or None.

    Raises:
        ConfigError: a token that cannot travel in a header, or (``runs_here``) ``train.nnodes`` > 1 without a
            ``GRPO_RUN_TOKEN`` of at least :data:`~grpo_core.security.auth.MIN_SHARED_TOKEN_CHARS` characters here.
    """
    from grpo_core.config import SERVER_API_KEY_ENV
    from grpo_core.security.auth import MIN_SHARED_TOKEN_CHARS, TOKEN_ENV, token_problem

    for name in (TOKEN_ENV, SERVER_API_KEY_ENV):
        value = os.environ.get(name)
        problem = token_problem(value) if value else None  # unset or "": not given
        if problem is not None:
            raise ConfigError(f"{name} (environment): {problem}; every request of the run would fail")
    token = os.environ.get(TOKEN_ENV) or ""
    if cfg.train.nnodes > 1 and len(token) < MIN_SHARED_TOKEN_CHARS:
        given = "is not set" if not token else f"has {len(token)} characters (fewer than {MIN_SHARED_TOKEN_CHARS})"
        problem = (
            f"train.nnodes={cfg.train.nnodes} needs {TOKEN_ENV} in this environment (the worker's, or "
            f"the shell of `grpo train`) and the same value on every trainer host; it {given}. Each "
            "trainer rank proves it holds the run's token before anything is trained, since torchrun's "
            f"rendezvous has no authentication. Export e.g. {TOKEN_ENV}=$(openssl rand -hex 32) on "
            "each host"
        )
        if runs_here:
            raise ConfigError(problem)
        return f"{problem} (needed where the run starts, not by `grpo validate`)"
    return None


def check_rendezvous_host(cfg: RunConfig) -> None:
    """On the flow's host, before torchrun node 0 starts: ``train.rdzv_endpoint``'s host resolves and names this
    host (node 0 serves the rendezvous store there; a typo made torchrun retry its lookup until
    ``train.rdzv_timeout_s``, and another host's name would leave every trainer host waiting). Not part of
    :func:`check_run`, which ``grpo validate`` also runs elsewhere.

    Raises:
        ConfigError: the host does not resolve, or none of its addresses belongs to this host.
    """
    import socket

    if cfg.train.nnodes == 1 or not cfg.train.rdzv_endpoint:
        return
    host = cfg.train.rdzv_endpoint.rpartition(":")[0].strip("[]")
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError as exc:
        raise ConfigError(
            f"train.rdzv_endpoint={cfg.train.rdzv_endpoint}: {host!r} does not resolve on this host "
            f"({exc}); give this host's name as the other trainer hosts reach it"
        ) from None
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0))  # only an address of this host binds
                return
            except OSError:
                continue
    raise ConfigError(
        f"train.rdzv_endpoint={cfg.train.rdzv_endpoint}: {host!r} ({', '.join(sorted(addresses))}) is "
        "not this host, which runs trainer node 0 and its rendezvous store; give this host's name"
    )


def _pem_problem(path: Path, marker: str, what: str) -> str | None:
    """Why ``path`` cannot be used as a PEM ``what`` (missing, a folder, unreadable, no ``-----BEGIN <marker>``),
    else None."""
    if not path.exists():
        return "does not exist"
    if not path.is_file():
        return "is a directory, not a file" if path.is_dir() else "is not a regular file"
    try:
        text = path.read_bytes().decode("ascii", errors="replace")
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not re.search(rf"-----BEGIN [A-Z ]*{marker}-----", text):
        return f"is not a PEM {what} (no '-----BEGIN ...{marker}-----' block)"
    if marker == "PRIVATE KEY" and ("ENCRYPTED" in text):
        return "is an encrypted key; give the key unencrypted (keep it 0600)"
    return None


def check_tls(cfg: RunConfig) -> None:
    """The ``tls`` files: each one set exists, is a readable PEM file of its kind, the key is the certificate's
    (:func:`grpo_core.serving.limits.tls_options`, the servers' own start check) and the CA file loads as trusted
    certificates. Without this, a bad file passed ``grpo validate`` and failed when a server started.

    Raises:
        ConfigError: one line naming ``tls.cert_file``, ``tls.key_file`` or ``tls.ca_file`` and the problem.
    """
    import ssl

    from grpo_core.serving.limits import client_ssl_context, tls_options

    tls = cfg.tls
    files = [
        ("tls.cert_file", tls.cert_file, "CERTIFICATE", "certificate"),
        ("tls.key_file", tls.key_file, "PRIVATE KEY", "private key"),
        ("tls.ca_file", tls.ca_file, "CERTIFICATE", "CA certificate"),
    ]
    for field, path, marker, what in files:
        if path is None:
            continue
        problem = _pem_problem(Path(path), marker, what)
        if problem is not None:
            raise ConfigError(f"{field}={str(path)!r} {problem}; set {field} to a PEM {what} file")
    if tls.cert_file is not None and tls.key_file is not None:
        try:
            tls_options(tls.cert_file, tls.key_file)
        except ValueError as exc:
            if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
                raise ConfigError(
                    f"tls.key_file={str(tls.key_file)!r} is not the key of tls.cert_file={str(tls.cert_file)!r}; "
                    "give the certificate and the key it was issued for"
                ) from None
            raise ConfigError(
                f"tls.cert_file={str(tls.cert_file)!r} and tls.key_file={str(tls.key_file)!r} do not load as a "
                f"certificate and its key ({exc}); give PEM files of a certificate and its unencrypted key"
            ) from None
    if tls.ca_file is not None:
        try:
            client_ssl_context(tls.ca_file)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"tls.ca_file={str(tls.ca_file)!r} does not load as CA certificates ({exc}); give the PEM "
                "certificate(s) of the CA that signed the servers' certificates"
            ) from None


def check_run(cfg: RunConfig, create: bool = True) -> list[str]:
    """Every check that can run before a server starts.

    Args:
        cfg: the run config.
        create: False (``grpo validate``, which may run ahead of deployment, on another host than the run's): create
            no folder and no MLflow store, check that the run could; and what only the run's own hosts must have
            (vLLM where the flow starts vLLM replicas, a CUDA GPU for ``train.device: cuda``, trainer-0's shared
            ``GRPO_RUN_TOKEN`` of a multi-node run) is
            a note when this host lacks it, not an error.

    Returns:
        The notes (``create=False`` only): each says what this host lacks and where the run needs it.

    Raises:
        ConfigError: the first problem found, naming the field and the fix.
    """
    from grpo_core.rollout.build import loop_class_and_config
    from grpo_core.rollout.tools import resolve_response_template
    from grpo_core.security.allowlist import check_code_references, import_object

    check_code_references(cfg)  # before anything is imported or called
    check_adapter_store(cfg)  # before any folder is made
    notes = [note for note in [check_tokens(cfg, runs_here=create)] if note]
    check_tls(cfg)
    ensure_dir(cfg.train.output_dir, "train.output_dir (the run folders)", create)
    check_tracking(cfg, create)
    check_resume_from(cfg, create)
    check_model(cfg)
    check_packing(cfg)
    lacking = check_trainer_device(cfg)
    if lacking is not None:
        if create:
            raise ConfigError(lacking)
        notes.append(f"{lacking} (needed where `grpo train` runs, not by `grpo validate`)")
    if cfg.server.backend == "vllm" and cfg.server.starts_here():
        from grpo_core.serving.launch import check_gpu_layout, choose_backend

        try:
            choose_backend(cfg)  # vLLM must be installed where the flow starts it (not for server.urls / deployment)
        except ConfigError as exc:
            if create:
                raise
            notes.append(f"{exc} (needed where `grpo train` runs, not by `grpo validate`)")
        check_gpu_layout(cfg)  # the config's own GPU layout (as provision checks it), refused before anything starts
    loop_class_and_config(cfg.rollout)
    for name in cfg.rollout.tools:
        import_object(name, "rollout.tools")
    resolve_response_template(cfg.rollout.response_template)
    check_dataset(cfg)
    check_eval(cfg)
    check_reward_pickling(cfg)
    check_chat_template(cfg)
    check_prompt_lengths(cfg)
    check_eval_prompt_lengths(cfg)
    check_push(cfg)
    data = cfg.rollout.dataset or ", ".join(f"{d.path} ({d.weight:g})" for d in cfg.rollout.datasets) or None
    logger.info("run config checked: model %s, dataset %s", cfg.model.name, data)
    return notes
