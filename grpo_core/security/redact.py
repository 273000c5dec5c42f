"""Secrets of a run config: which values are secret, how they are shown, and how they reach child processes.

Secret fields are pydantic ``SecretStr`` (``tracking.tracking_uri`` and ``tracking.artifact_location`` as
:class:`SecretUrl`, the value of a secret flag in ``server.extra_args`` such as ``--api-key``). Everything
that prints, logs or saves a config shows :data:`MASK` instead (``model_dump(mode="json")``,
``model_dump_json``, ``str``/``repr``); a URL keeps its scheme, host and user (``https://me:**********@host``).

The processes of a run get the real values by environment, never by file: the flow passes
``GRPO_RUN_SECRETS`` (:data:`SECRETS_ENV`, JSON ``{field path: value}``, :func:`secret_values`) to the
rollout and trainer processes, which put them back into the redacted config file they read
(:func:`apply_secrets`). :class:`RedactFilter` replaces known secret values in log records as a last guard.

Free-form dict fields (``rollout.dataset_kwargs``, ``rollout.chat_template_kwargs``, ``rollout.loop_options``,
any dict-valued field) are masked by key name: the string and number values under a key whose name says secret
(:func:`is_secret_key`: ``api_key``, ``hf_token``, ``password``, ``auth``, ``credentials``, ..., at any depth, and
everything nested under such a key) are shown as :data:`MASK` in every JSON form of a config
(:func:`mask_secret_keys`) and travel to the run's processes in :data:`SECRETS_ENV` like the ``SecretStr`` fields;
the code that reads the dict (a dataset factory, the chat template, a loop class) gets the real values.

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


# Words of a dict key that say its value is secret (``hf_token``, ``apiKey``, ``db-password``, ``auth``).
_SECRET_WORDS = frozenset(
    [
        "token",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "secret",
        "secrets",
        "credential",
        "credentials",
        "creds",
        "auth",
        "authorization",
        "apikey",
        "cookie",
        "cookies",
        "bearer",
        "jwt",
        "signature",
    ]
)


def _key_words(key: str) -> list[str]:
    """``key`` split into lower-case words at ``_``, ``-``, ``.``, spaces and camelCase (``hfToken`` -> hf, token)."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", key)
    return [w for w in re.split(r"[\W_]+", spaced.lower()) if w]


# A ``…_token`` key after one of these words names a vocabulary token, not a credential (``eos_token``).
_VOCAB_TOKEN_WORDS = frozenset(["bos", "eos", "pad", "unk", "sep", "cls", "mask", "add", "special", "stop", "end"])
# A ``…_key`` key after one of these words names a credential (``api_key``); any other (``prompt_key``,
# ``sort_key``, ``cache_key``) names a column or a lookup.
_KEY_QUALIFIERS = frozenset(
    ["api", "access", "secret", "private", "openai", "anthropic", "hf", "aws", "auth", "client", "signing",
     "encryption", "master", "service", "license", "session", "ssh", "gpg", "deploy", "app", "account"]
)  # fmt: skip


def is_secret_key(key: Any) -> bool:
    """Whether a dict key names a secret value, by its last word (``hf_token``, ``db-password``, ``apiKey``): one of
    :data:`_SECRET_WORDS` (token, password, secret, credential(s), auth, apikey, cookie, ...) — but not a vocabulary
    token (``eos_token``, ``pad_token``, ``add_bos_token``) —, or ``key`` after a word that makes it a credential
    (``api_key``, ``OPENAI_API_KEY``, ``access-key``; not ``prompt_key`` or ``sort_key``). ``tokenizer``,
    ``max_tokens``, ``token_limit`` or a bare ``key`` are not secret, nor is a key holding a ``.`` (a config path
    cannot name it, so its value could not be handed to the run's processes apart from the config)."""
    if not isinstance(key, str) or "." in key:
        return False
    words = _key_words(key)
    if not words:
        return False
    last, before = words[-1], words[-2] if len(words) > 1 else ""
    if last in ("key", "keys"):
        return before in _KEY_QUALIFIERS
    if last in ("token", "tokens"):
        return last == "token" and before not in _VOCAB_TOKEN_WORDS and not any(w in _VOCAB_TOKEN_WORDS for w in words)
    return last in _SECRET_WORDS


def _is_secret_leaf(value: Any) -> bool:
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def mask_secret_keys(value: Any, secret: bool = False) -> Any:
    """A copy of ``value`` (dicts and lists of JSON values) with every string or number under a secret key
    (:func:`is_secret_key`, at any depth, and everything nested under one) shown as :data:`MASK`."""
    if isinstance(value, dict):
        return {k: mask_secret_keys(v, secret or is_secret_key(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [mask_secret_keys(v, secret) for v in value]
    return MASK if secret and _is_secret_leaf(value) else value


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


def _walk(value: Any, path: str, secret: bool = False) -> Iterable[tuple[str, SecretStr, Any]]:
    """``(path, value as SecretStr, real value)`` of every secret under ``value``; ``secret``: under a dict key
    that names a secret."""
    if isinstance(value, SecretStr):
        yield path, value, value.get_secret_value()
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _walk(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}.{i}", secret)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}.{key}", secret or is_secret_key(key))
    elif secret and _is_secret_leaf(value):
        yield path, SecretStr(str(value)), value


def secret_fields(model: BaseModel) -> list[tuple[str, SecretStr]]:
    """Every secret of ``model`` with its path (``tracking.tracking_uri``, ``server.extra_args.3``, and a value under
    a secret key of a dict field, ``rollout.dataset_kwargs.api_key``)."""
    return [(path, s) for path, s, _ in _walk(model, "")]


def secret_values(model: BaseModel) -> dict[str, Any]:
    """``{path: real value}`` of every non-empty secret of ``model`` (what :data:`SECRETS_ENV` carries): a string,
    or the number a secret dict key holds (``pin: 1234`` stays a number)."""
    return {path: real for path, s, real in _walk(model, "") if s.get_secret_value()}


def apply_secrets(data: dict[str, Any], secrets: dict[str, Any]) -> dict[str, Any]:
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


def secrets_from_env(environ: dict[str, str]) -> dict[str, Any]:
    """The secret values a parent process passed in :data:`SECRETS_ENV` (empty when unset)."""
    text = environ.get(SECRETS_ENV)
    return json.loads(text) if text else {}


def mask_values(secrets: dict[str, Any]) -> list[str]:
    """The strings to mask in text for ``secrets`` (:func:`secret_values`): each value, and a URL's password."""
    out = [str(v) for v in secrets.values() if v]
    for value in secrets.values():
        if not isinstance(value, str):
            continue
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
    (:func:`grpo_core.run.durable.atomic_write_text`)."""
    from grpo_core.run.durable import atomic_write_text

    return atomic_write_text(path, text, mode=0o600)
