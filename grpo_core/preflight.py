"""Checks of a run config that need imports, data or the disk but no server (fail fast before anything starts).

``RunConfig`` validation catches field and cross-field errors; :func:`check_run` first refuses any
name of code outside the allow-list (``grpo_core.security.allowlist``, before anything is imported), then adds
what only importing the named code, reading the dataset or touching the disk can tell: the model name
resolves (a Hub id is downloaded here, once, before any server starts) and its layers can be
packed, the loop class, reward functions and tools import, the dataset has the columns the
rollout needs, the folders and SQLite files the run writes can be created and opened, and a Hub
push (``export.push_to_hub``) has a repository id and a token.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from grpo_core.config import RunConfig
from grpo_core.errors import ConfigError
from grpo_core.models.hub import check_push
from grpo_core.security.redact import mask_values, redact_text

logger = logging.getLogger(__name__)


#: Mode of a store's folder (the MLflow store, Prefect's home) and of its database file: its owner's only.
PRIVATE_DIR_MODE, PRIVATE_FILE_MODE = 0o700, 0o600


def make_private_dir(path: Path) -> Path:
    """Create ``path`` and the parents it lacks as mode 0700, and make an existing ``path`` of this user 0700: a
    store's folder (checkpoints, configs, every forwarded log line) is its owner's only, whatever the umask.

    Raises:
        OSError: the folder cannot be created or its mode set.
    """
    path = Path(path)
    missing = []
    target = path
    while not target.exists():
        missing.append(target)
        target = target.parent
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    for folder in missing:
        folder.chmod(PRIVATE_DIR_MODE)  # mkdir's mode applies to the leaf only, and through the umask
    if not missing and path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
        path.chmod(PRIVATE_DIR_MODE)
    return path


def ensure_dir(path: Path, what: str, create: bool = True, private: bool = False) -> Path:
    """Create ``path`` with its parents and check that files can be written in it.

    Args:
        path: the folder.
        what: what the folder is for and which setting names it, e.g. ``"tracking.dir (the MLflow store)"``.
        create: False (``grpo validate``): create nothing; a folder that does not exist yet passes when its
            nearest existing parent is a writable folder (the run could create it).
        private: a store's own folder: created 0700 (with the parents it lacks), an existing one of this user
            made 0700 (:func:`make_private_dir`).

    Returns:
        ``path``, resolved.

    Raises:
        ConfigError: the folder cannot be created or written (names ``what``, the path and the cause).
    """
    path = Path(path).expanduser().resolve()
    target = path
    if create:
        try:
            make_private_dir(path) if private else path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"{what}: cannot create the folder {path}: {exc.strerror or exc}; "
                "point the setting at a writable folder"
            ) from None
    else:
        try:
            while not target.exists():
                target = target.parent
        except OSError as exc:  # a parent this user cannot search
            raise ConfigError(
                f"{what}: cannot check the folder {path}: {exc.strerror or exc}; point the setting at a writable folder"
            ) from None
        if not target.is_dir():
            raise ConfigError(
                f"{what}: cannot create the folder {path}: {target} is a file; point the setting at a writable folder"
            )
    if not os.access(target, os.W_OK | os.X_OK):
        where = "" if target == path else f" (it would be made in {target})"
        raise ConfigError(f"{what}: the folder {target} is not writable{where}; point the setting at a writable folder")
    return path


def open_sqlite(path: Path, read_only: bool = False) -> contextlib.closing:
    """A connection to the SQLite file ``path`` (closed on leaving the ``with``); ``read_only``: opened through its
    ``file:`` URI with ``mode=ro`` (``Path.as_uri`` escapes a '?' or '#' of the path), which creates nothing.

    Raises:
        sqlite3.Error: it cannot be opened.
    """
    target = Path(path).expanduser().resolve().as_uri() + "?mode=ro" if read_only else str(path)
    return contextlib.closing(sqlite3.connect(target, timeout=10, uri=read_only))


def check_sqlite(path: Path, what: str, create: bool = True, private: bool = False) -> None:
    """Create ``path``'s folder and open (or create) the SQLite database there once; the database file is made
    0600 (SQLite gives its journal and WAL files the database's mode).

    Args:
        path: the database file.
        what: the setting that names it (for errors).
        create: False (``grpo validate``): create nothing; an existing database is opened read-only, a missing one
            passes when :func:`ensure_dir` ``(create=False)`` passes for its folder.
        private: the folder is the store's own: 0700 (:func:`ensure_dir`).

    Raises:
        ConfigError: the folder or the database cannot be opened (names ``what``, the path and the cause).
    """
    path = Path(path).expanduser()
    ensure_dir(path.parent, what, create, private)
    if not create and not path.exists():
        return
    try:
        with open_sqlite(path, read_only=not create) as db:
            db.execute("PRAGMA schema_version").fetchone()
    except sqlite3.Error as exc:
        raise ConfigError(f"{what}: cannot open the SQLite database {path.resolve()}: {exc}") from None
    if create and path.stat().st_uid == os.getuid():
        path.chmod(PRIVATE_FILE_MODE)


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLAlchemy SQLite URL (``sqlite:///x.db``, ``sqlite+aiosqlite:////abs.db``); None otherwise."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.split("+")[0] != "sqlite" or not rest.startswith("/"):
        return None
    file = rest[1:].split("?")[0]
    return Path(file) if file and file != ":memory:" else None


def check_tracking(cfg: RunConfig, create: bool = True) -> None:
    """The MLflow store can be used: its SQLite file and artifact folder (local), or its server answers
    (``create``: False creates neither; :func:`ensure_dir`).

    Raises:
        ConfigError: a folder or database that cannot be created or opened, or a tracking server that
            does not answer ``/health`` within 10 s (names the path or URL and the cause).
    """
    tc = cfg.tracking
    if not tc.enabled:
        return
    uri = tc.resolved_tracking_uri()
    db = sqlite_path(uri)
    if db is not None:
        # the embedded store's folder (tracking.dir) is its own: 0700; a database URL's folder keeps its mode
        check_sqlite(db, "tracking.dir / tracking.tracking_uri (the MLflow store)", create, tc.tracking_uri is None)
    elif uri.startswith(("http://", "https://")):
        import httpx

        try:
            httpx.get(uri.rstrip("/") + "/health", timeout=10.0).raise_for_status()
        except httpx.HTTPError as exc:
            cause = redact_text(str(exc), mask_values({"uri": uri}))
            raise ConfigError(
                f"tracking.tracking_uri={tc.shown_tracking_uri()}: the MLflow server does not answer "
                f"/health ({type(exc).__name__}: {cause}); start it or fix the URI"
            ) from None
    artifacts = tc.resolved_artifact_location()
    if artifacts and "://" not in artifacts:
        own = tc.artifact_location is None  # tracking.dir/artifacts
        ensure_dir(Path(artifacts), "tracking.artifact_location (MLflow artifacts)", create, own)
    elif artifacts and artifacts.startswith("file://"):
        ensure_dir(Path(artifacts.removeprefix("file://")), "tracking.artifact_location (MLflow artifacts)", create)


def check_resume_from(cfg: RunConfig, create: bool = True) -> None:
    """``resume_from`` names a run of the MLflow store with a completely uploaded checkpoint, before the flow opens
    a run of its own (``create``: False, ``grpo validate``: a local SQLite store is read read-only, MLflow's tables,
    instead of through an MLflow client, which makes its folder and lock file and migrates its schema).

    Raises:
        ConfigError: no such run, a run without a finished checkpoint, or tracking is off; naming the id, the store
            and the fix.
    """
    if not cfg.resume_from:
        return
    tc = cfg.tracking
    if not tc.enabled:
        raise ConfigError(
            f"resume_from={cfg.resume_from!r} needs tracking.enabled: true (the checkpoint is found "
            "through the MLflow run)"
        )
    from grpo_core import tracking

    try:
        step = tracking.uploaded_checkpoint_step(tc, cfg.resume_from, read_only=not create)
    except LookupError:
        raise ConfigError(
            f"resume_from={cfg.resume_from!r}: no such run in the MLflow store "
            f"{tc.shown_tracking_uri()}; copy the id from the MLflow UI (grpo ui --mlflow) or point "
            "tracking.dir / tracking.tracking_uri at the store that holds it"
        ) from None
    if step is None:
        raise ConfigError(
            f"resume_from={cfg.resume_from!r}: MLflow run {cfg.resume_from} has no completely uploaded checkpoint "
            f"(no tag {tracking.LATEST_STEP_TAG}: it stopped before its first train.save_steps); pick a run that "
            "saved one, or drop resume_from to start a new run"
        )


def check_model(cfg: RunConfig) -> None:
    """Resolve ``model.name`` (find a folder or download a Hub id; registry names need nothing) and
    check that every layer of it can run on packed tree rows (built on the meta device, no weights read).

    Raises:
        ConfigError: the name does not resolve, or a layer cannot be packed (the layer type named).
    """
    from grpo_core.models import registry_names, resolve_model_dir
    from grpo_core.train.packable import check_model_folder

    if cfg.model.name in registry_names() and cfg.model.revision is None:
        return  # packable architectures, built (seconds to a minute) by the first process that needs them
    check_model_folder(resolve_model_dir(cfg.model), cfg.model.name, cfg.token_budget())


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


def _reward_functions(cfg: RunConfig) -> list[tuple[str, object]]:
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
    import pickle

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
        if is_async(func):
            continue
        try:
            pickle.dumps(func, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - pickling raises many types; the message names it
            raise ConfigError(
                f"{what} cannot be pickled ({type(exc).__name__}: {exc}), and with rollout.reward_workers={workers} "
                "sync reward functions are sent to worker processes pickled; define it as a top-level function of "
                "an importable module (not a lambda or a nested function), make it async, or set "
                "rollout.reward_workers: 0 (threads of the rollout process)"
            ) from None


def required_reward_columns(cfg: RunConfig) -> dict[str, str]:
    """Dataset columns the reward functions need: parameter name -> function name.

    Raises:
        ConfigError: a function needs an argument grpo-flow cannot supply (``UNSUPPORTED_REWARD_ARGUMENTS``).
    """
    from grpo_core.rollout.scoring import REWARD_ARGUMENTS, UNSUPPORTED_REWARD_ARGUMENTS

    needed: dict[str, str] = {}
    for name, func in _reward_functions(cfg):
        for param in inspect.signature(func).parameters.values():
            required = param.default is inspect.Parameter.empty and param.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                inspect.Parameter.KEYWORD_ONLY,
            )
            if not required or param.name in REWARD_ARGUMENTS:
                continue
            if param.name in UNSUPPORTED_REWARD_ARGUMENTS:
                raise ConfigError(
                    f"rollout.reward_functions: {name} needs {param.name!r}, which grpo-flow does not "
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
    for column, name in needed.items():
        if row.get(column) is None:
            state = "no such column" if column not in row else "null or missing there"
            raise ConfigError(
                f"rollout.reward_functions: {name} needs the dataset column {column!r}, which "
                f"{where} lacks in row {index} ({state}; columns: {sorted(row)}); fill it in that row, drop the row, "
                f"or give the function's {column!r} a default if it can score without it"
            )


def check_eval(cfg: RunConfig) -> None:
    """The held-out evaluation (``eval``, docs/evaluation.md): its dataset loads with a prompt in every row, and its
    reward functions import.

    Raises:
        ConfigError: naming ``eval.dataset`` or ``eval.reward_functions`` (``grpo_core.rollout.evaluate.eval_rows``).
    """
    if not cfg.eval.enabled:
        return
    from grpo_core.rollout.evaluate import eval_dataset_config, eval_rewards, eval_rows

    eval_rows(cfg.eval, cfg.rollout)
    eval_rewards(cfg.eval, cfg.rollout, eval_dataset_config(cfg.eval, cfg.rollout))


#: Tokens a tokenizer may add to a text beyond one per byte (SentencePiece word-start markers), in the fast check.
_LENGTH_MARGIN = 32


def check_prompt_lengths(cfg: RunConfig) -> None:
    """Every prompt leaves room for a full completion: rendered with the chat template (and the tools' schemas) as
    the rollout renders it, no longer than ``server.max_model_len - rollout.max_completion_length`` tokens. Rows an
    environment makes, and a loop class with its own ``render``, are not judged (the rollout counts what it skips
    in ``rollout/overlong_prompt_count``).

    Raises:
        ConfigError: without ``rollout.skip_overlong_prompts``, the first prompt over the limit (names the dataset,
            the row, its length and the fixes); with it, a warning counts them instead.
    """
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from grpo_core.models import tokenizer_dir
    from grpo_core.rollout.build import loop_class_and_config
    from grpo_core.rollout.loop import RolloutLoop
    from grpo_core.rollout.tools import tool_schemas
    from grpo_core.security.allowlist import import_object

    rollout = cfg.rollout
    cls, _ = loop_class_and_config(rollout)
    if rollout.environment_factory is not None or (rollout.dataset is None and not rollout.datasets):
        return
    if cls.render is not RolloutLoop.render or cls.render_text is not RolloutLoop.render_text:
        logger.warning("rollout.loop_class renders prompts itself: their lengths are judged by the rollout only")
        return
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(cfg.model))
    tools = [import_object(name, "rollout.tools") for name in rollout.tools]
    schemas = tool_schemas(tools) if tools else None
    loop = SimpleNamespace(tokenizer=tokenizer, config=rollout)  # what RolloutLoop.render reads
    limit = cfg.server.max_model_len - rollout.max_completion_length
    over = 0
    for where, index, row in dataset_rows(cfg):
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = RolloutLoop.render_text(loop, messages, schemas)  # type: ignore[arg-type]
        # A token holds at least one byte of the text (a SentencePiece tokenizer may add a word-start marker to a
        # segment: the margin), so a text this short fits without encoding it; the rollout checks every prompt again.
        if len(text.encode()) + _LENGTH_MARGIN <= limit:
            continue
        length = len(tokenizer.encode(text, add_special_tokens=False))  # as RolloutLoop.render
        if length <= limit:
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


def check_tokens(cfg: RunConfig) -> None:
    """The bearer tokens this environment gives the run are usable, and several trainer hosts can share one.

    ``GRPO_RUN_TOKEN`` and ``GRPO_SERVER_API_KEY`` travel in HTTP ``Authorization`` headers (printable ASCII, not
    blank: :func:`grpo_core.security.auth.token_problem`). With ``train.nnodes`` > 1 the run's token must come from this
    environment: every trainer rank proves it holds it (:func:`grpo_core.train.distributed.check_members`), a token
    the flow drew at random no other trainer host could know, and a short one would be guessable.

    Raises:
        ConfigError: a token that cannot travel in a header, or ``train.nnodes`` > 1 without a ``GRPO_RUN_TOKEN`` of
            at least :data:`~grpo_core.security.auth.MIN_SHARED_TOKEN_CHARS` characters here.
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
        raise ConfigError(
            f"train.nnodes={cfg.train.nnodes} needs {TOKEN_ENV} in this environment (the worker's, or "
            f"the shell of `grpo train`) and the same value on every trainer host; it {given}. Each "
            "trainer rank proves it holds the run's token before anything is trained, since torchrun's "
            f"rendezvous has no authentication. Export e.g. {TOKEN_ENV}=$(openssl rand -hex 32) on "
            "each host"
        )


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
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
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


def check_run(cfg: RunConfig, create: bool = True) -> None:
    """Every check that can run before a server starts.

    Args:
        cfg: the run config.
        create: False (``grpo validate``): create no folder and no MLflow store; check that the run could.

    Raises:
        ConfigError: the first problem found, naming the field and the fix.
    """
    from grpo_core.rollout.build import loop_class_and_config
    from grpo_core.rollout.tools import resolve_response_template
    from grpo_core.security.allowlist import check_code_references, import_object

    check_code_references(cfg)  # before anything is imported or called
    check_adapter_store(cfg)  # before any folder is made
    check_tokens(cfg)
    check_tls(cfg)
    ensure_dir(cfg.train.output_dir, "train.output_dir (the run folders)", create)
    check_tracking(cfg, create)
    check_resume_from(cfg, create)
    check_model(cfg)
    if cfg.server.backend == "vllm" and cfg.server.starts_here():
        from grpo_core.serving.vllm import choose_backend

        choose_backend(cfg)  # vLLM must be installed where the flow starts it (not for server.urls / deployment)
    loop_class_and_config(cfg.rollout)
    for name in cfg.rollout.tools:
        import_object(name, "rollout.tools")
    resolve_response_template(cfg.rollout.response_template)
    check_dataset(cfg)
    check_eval(cfg)
    check_reward_pickling(cfg)
    check_chat_template(cfg)
    check_prompt_lengths(cfg)
    check_push(cfg)
    data = cfg.rollout.dataset or ", ".join(f"{d.path} ({d.weight:g})" for d in cfg.rollout.datasets) or None
    logger.info("run config checked: model %s, dataset %s", cfg.model.name, data)
