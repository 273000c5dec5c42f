"""Secrets of a run config: which values are secret, how they are shown, and how they reach child processes.

Secret fields are pydantic ``SecretStr`` (``tracking.tracking_uri`` and ``tracking.artifact_location`` as
:class:`SecretUrl`, the value of a secret flag in ``server.extra_args`` such as ``--api-key``). Everything
that prints, logs or saves a config shows :data:`MASK` instead (``model_dump(mode="json")``,
``model_dump_json``, ``str``/``repr``); a URL keeps its scheme, host and user (``https://me:**********@host``).

The processes of a run get the real values by environment, never by file: the flow passes
``GRPO_RUN_SECRETS`` (:data:`SECRETS_ENV`, JSON ``{field path: value}``, :func:`secret_values`) to the
rollout and trainer processes, which put them back into the redacted config file they read
(:func:`apply_secrets`). :class:`RedactFilter` replaces known secret values in log records as a last guard.

Only pydantic and the standard library are imported here.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, SecretStr

#: What a secret is shown as (pydantic's own mask).
MASK = "**********"
#: Environment variable carrying a run's secret values to its child processes (JSON ``{path: value}``).
SECRETS_ENV = "GRPO_RUN_SECRETS"
# A flag whose value is secret: its name ends in key, token, password or secret (``--api-key``, ``--hf-token``).
_SECRET_FLAG = re.compile(r"--?[\w-]*(key|token|password|passwd|secret)", re.IGNORECASE)


def is_secret_flag(arg: str) -> bool:
    """Whether a command-line flag (without ``=value``) takes a secret value, e.g. ``--api-key``."""
    return bool(_SECRET_FLAG.fullmatch(arg.replace("_", "-")))


def _is_value(arg: Any) -> bool:
    return isinstance(arg, SecretStr) or not str(arg).startswith("-")


def split_secret_flags(args: Iterable[Any]) -> list[Any]:
    """``args`` with each secret flag's value as a ``SecretStr`` (``--api-key=X`` becomes ``--api-key``, ``X``).

    A secret flag followed by another flag (``--hf-token --enforce-eager``) has no value."""
    out: list[Any] = []
    secret_next = False
    for arg in args:
        if secret_next and _is_value(arg):
            out.append(arg if isinstance(arg, SecretStr) else SecretStr(str(arg)))
            secret_next = False
            continue
        flag, eq, value = str(arg).partition("=") if isinstance(arg, str) else (arg, "", "")
        secret_next = isinstance(arg, str) and is_secret_flag(flag) and not eq
        out += [flag, SecretStr(value)] if isinstance(arg, str) and eq and is_secret_flag(flag) else [arg]
    return out


def reveal(args: Iterable[Any]) -> list[str]:
    """Plain strings of a list that may hold ``SecretStr`` (the argv a process is started with)."""
    return [a.get_secret_value() if isinstance(a, SecretStr) else str(a) for a in args]


def redact_argv(argv: Iterable[Any]) -> str:
    """A command line for logs: every ``SecretStr`` and the value of every secret flag shown as :data:`MASK`."""
    shown: list[str] = []
    secret_next = False
    for raw in argv:
        if isinstance(raw, SecretStr) or (secret_next and _is_value(raw)):
            shown.append(MASK)
            secret_next = False
            continue
        flag, eq, _ = str(raw).partition("=")
        secret_next = is_secret_flag(flag) and not eq
        shown.append(f"{flag}={MASK}" if eq and is_secret_flag(flag) else str(raw))
    return " ".join(shown)


def redact_url(url: str, keep_user: bool = True) -> str:
    """``url`` with its password shown as :data:`MASK` (``keep_user=False``: user and password dropped)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK
    if parts.password is None and (keep_user or parts.username is None):
        return url
    host = parts.netloc.rpartition("@")[2]
    if keep_user and parts.username is not None:
        host = f"{parts.username}:{MASK}@{host}" if parts.password is not None else f"{parts.username}@{host}"
    return urlunsplit(parts._replace(netloc=host))


class SecretUrl(SecretStr):
    """A URL that may hold credentials (``scheme://user:password@host``): shown with the password masked."""

    def _display(self) -> str:
        return redact_url(self.get_secret_value())


def _walk(value: Any, path: str) -> Iterable[tuple[str, SecretStr]]:
    if isinstance(value, SecretStr):
        yield path, value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _walk(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}.{i}")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}.{key}")


def secret_fields(model: BaseModel) -> list[tuple[str, SecretStr]]:
    """Every secret of ``model`` with its path (``tracking.tracking_uri``, ``server.extra_args.3``)."""
    return list(_walk(model, ""))


def secret_values(model: BaseModel) -> dict[str, str]:
    """``{path: real value}`` of every non-empty secret of ``model`` (what :data:`SECRETS_ENV` carries)."""
    return {path: s.get_secret_value() for path, s in secret_fields(model) if s.get_secret_value()}


def apply_secrets(data: dict[str, Any], secrets: dict[str, str]) -> dict[str, Any]:
    """Put ``secrets`` (``{path: value}``) into the raw config ``data`` (dicts and lists, in place); returns it.

    Raises:
        ValueError: a path that does not exist in ``data``.
    """
    for path, value in secrets.items():
        *parents, last = path.split(".")
        node: Any = data
        try:
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            if isinstance(node, list):
                node[int(last)] = value
            else:
                node[last] = value
        except (KeyError, IndexError, ValueError, TypeError):
            raise ValueError(f"{SECRETS_ENV}: the config has no field {path}") from None
    return data


def secrets_from_env(environ: dict[str, str]) -> dict[str, str]:
    """The secret values a parent process passed in :data:`SECRETS_ENV` (empty when unset)."""
    text = environ.get(SECRETS_ENV)
    return json.loads(text) if text else {}


def mask_values(secrets: dict[str, str]) -> list[str]:
    """The strings to mask in text for ``secrets`` (:func:`secret_values`): each value, and a URL's password."""
    out = [v for v in secrets.values() if v]
    for value in secrets.values():
        try:
            password = urlsplit(value).password
        except ValueError:
            password = None
        if password:
            out.append(password)
    return out


def redact_text(text: str, values: Iterable[str]) -> str:
    """``text`` with every occurrence of a secret value replaced by :data:`MASK` (values under 4 characters are
    left alone: they would mask ordinary words)."""
    for value in sorted((v for v in values if len(v) >= 4), key=len, reverse=True):
        text = text.replace(value, MASK)
    return text


class RedactFilter(logging.Filter):
    """A logging filter that masks the given secret values in each record's message (a last guard for lines
    forwarded from child processes)."""

    def __init__(self, values: Iterable[str]):
        super().__init__()
        self.values = [v for v in values if v]

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102 - logging.Filter
        message = record.getMessage()
        masked = redact_text(message, self.values)
        if masked != message:
            record.msg, record.args = masked, None
        return True


_FILTER = RedactFilter([])


def redact_logs(values: Iterable[str], loggers: Iterable[str] = ("prefect.flow_runs", "prefect.task_runs")) -> None:
    """Mask ``values`` in every record logged through ``loggers`` (a run's Prefect loggers: the flow's own lines
    and those it forwards from the servers, the rollout and the trainer) and through every handler of the root,
    ``grpo_core`` and ``prefect`` loggers. Values add up over the process's runs."""
    _FILTER.values = list(dict.fromkeys([*_FILTER.values, *(v for v in values if v)]))
    targets: list[logging.Filterer] = [logging.getLogger(name) for name in loggers]
    for name in ("", "grpo_core", "prefect"):
        targets += logging.getLogger(name).handlers
    for target in targets:
        if _FILTER not in target.filters:
            target.addFilter(_FILTER)


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by its owner only (mode 0600, also when the file existed), atomically
    (:func:`grpo_core.durable.atomic_write_text`)."""
    from grpo_core.durable import atomic_write_text

    return atomic_write_text(path, text, mode=0o600)
