"""Reading a config file: YAML/TOML/JSON parsing, ``--set`` overrides and one-line validation errors.

An override's value is YAML (``train.max_steps=5``), or, for a secret, read off the command line (where any
user of the host reads it in ``/proc/<pid>/cmdline`` or ``ps`` for as long as the command runs):
``key=@env:NAME`` (the environment variable ``NAME``), ``key=@file:PATH`` (the file's text, one trailing newline
dropped) or ``key=@stdin`` (one line of standard input, for one override of a command at most; a prompt that does
not echo on a terminal), each taken as a string, or as YAML for a list or dict field (an error never shows such
a value). ``@`` cannot start a plain YAML value, so no value meant as YAML reads as one of these. An override
that puts a secret on the command line (a ``SecretStr`` field, a flag of ``server.extra_args`` such as
``--api-key``, a dict key such as ``api_key``) is applied with a warning naming these forms.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_origin

from pydantic import (
    BaseModel,
)

from grpo_core.config.base import _Strict
from grpo_core.config.overrides import (
    _field_annotation,
    _hidden_texts,
    _indirect_structure,
    _masked,
    _section_model,
    _set_dotted,
    _union_members,
    _yaml_load,
    _yaml_where,
)
from grpo_core.config.run import RunConfig
from grpo_core.config.views import TrainerProcessConfig
from grpo_core.errors import ConfigError

logger = logging.getLogger(__name__)

#: Prefixes of an override value read off the command line (see the module docstring).
ENV_VALUE, FILE_VALUE, STDIN_VALUE = "@env:", "@file:", "@stdin"


def _unique_json_keys(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    duplicate = next((k for k in keys if keys.count(k) > 1), None)
    if duplicate is not None:
        raise ValueError(f"the key {duplicate!r} is given twice in one object; keep one")
    return dict(pairs)


def _parse(path: Path, text: str) -> Any:
    """The data of a config file by its suffix (``.toml``, ``.json``, else YAML).

    Raises:
        ConfigError: the text does not parse (names the file, the format, line and column).
    """
    import json
    import tomllib

    import yaml

    try:
        if path.suffix == ".toml":
            return tomllib.loads(text)
        if path.suffix == ".json":
            return json.loads(text, object_pairs_hook=_unique_json_keys)
        return _yaml_load(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path} is not valid JSON: line {e.lineno}, column {e.colno}: {e.msg}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_where(e)}") from None
    except ValueError as e:  # a duplicate key of a JSON object
        raise ConfigError(f"config file {path} is not valid JSON: {e}") from None


def _read_config(path: str | Path) -> dict:
    """The mapping of a config file (YAML, JSON or TOML by suffix).

    Raises:
        ConfigError: unreadable, not UTF-8, empty, unparsable or a key given twice (names the line), or not a
            mapping.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"config file {p}: {e.strerror}; check the --config path") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    data = _parse(p, text) if text.strip() else None
    if data is None:
        raise ConfigError(
            f"config file {p} is empty (or holds only comments); give it the run's sections, e.g. copy "
            "configs/tiny.yaml, or one line `model: {}` to train on the defaults"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _field_path(kind: type[BaseModel], loc: tuple) -> str:
    """``loc`` as the dotted path a user writes: field names and list indices (``extra_args[2]``), without
    pydantic's union-member tags (``list[str]``, ``literal['all-linear']``)."""
    path, model = "", kind
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif model is not None:  # a section: ``part`` is one of its fields (past a leaf field: a union tag)
            path += f".{part}" if path else str(part)
            model = _section_model(model, (part,))
    return path


def _error_lines(kind: type[BaseModel], errors: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per field of a pydantic ValidationError: ``path: message``. An unknown key gets the section's
    closest field names; a ConfigError from a cross-field check is its own message (it names its fields); the
    failed members of a union are joined on one line."""
    from grpo_core.errors import did_you_mean

    lines: dict[str, list[str]] = {}
    for err in errors:
        loc = tuple(err["loc"])
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):
            lines.setdefault(str(cause), [])
            continue
        path = _field_path(kind, loc)
        if err["type"] == "extra_forbidden":
            section = _section_model(kind, loc[:-1])
            names = section.model_fields if section is not None else ()
            prefix = f"{_field_path(kind, loc[:-1])}." if loc[:-1] else ""
            path = f"{prefix}{loc[-1]}"
            # the key of another section first (rollout.temperature for train.temperature), then close spellings
            elsewhere = _keys_elsewhere(kind, str(loc[-1]), _field_path(kind, loc[:-1]))
            close = did_you_mean(str(loc[-1]), names, prefix).removeprefix("; did you mean ").removesuffix("?")
            guesses = [*elsewhere, close] if close else elsewhere
            msg = "unknown key" + (f"; did you mean {' or '.join(guesses)}?" if guesses else "")
        elif err["type"] == "value_error" and cause is not None:
            msg = str(cause)
            if path and msg.startswith(path):  # the validator's message names the field already
                lines.setdefault(msg, [])
                continue
        elif err["type"] == "finite_number":  # every float field of the config (_Strict: allow_inf_nan=False)
            msg = f"must be finite (got {err.get('input')}); write a finite number (nan and inf are refused)"
        elif err["type"] == "model_type" and (section := _section_model(kind, loc)) is not None:
            msg = _section_given_a_value(path, section, err.get("input"))
        elif err["type"] == "dict_type":  # a mapping field (dataset_kwargs, column_types, ...) given one value
            msg = f"{err['msg']} (got {err.get('input')!r}); write a mapping, e.g. {path}={{name: value}}"
        elif err["type"] == "list_type" and isinstance(err.get("input"), str | int | float):  # one value, no list
            msg = f"{err['msg']}; write [{err['input']}] for one item"
        else:
            msg = err["msg"]
        if msg not in lines.setdefault(path or "config", []):
            lines[path or "config"].append(msg)
    return [
        f"{path}: {', or '.join(msgs)} (got {_shown(errors, path, kind)})"
        if len(msgs) > 1
        else f"{path}: {msgs[0]}"
        if msgs
        else path
        for path, msgs in lines.items()
    ]


def _keys_elsewhere(kind: type[BaseModel], name: str, here: str) -> list[str]:
    """The dotted paths of ``name`` in the sections of ``kind`` other than ``here`` (and at the root): a key written
    in the wrong section (``train.temperature``, ``max_steps``) is found where it lives. Sections inside lists
    (``rollout.datasets``) are not searched: their items have no path of their own."""
    found = [name] if here and name in kind.model_fields else []

    def walk(model: type[BaseModel], path: str) -> None:
        for field, info in model.model_fields.items():
            section = _section_model(model, (field,))
            if section is None or get_origin(info.annotation) in (list, tuple):
                continue
            where = f"{path}.{field}" if path else field
            if name in section.model_fields and where != here:
                found.append(f"{where}.{name}")
            walk(section, where)

    walk(kind, "")
    return found


def _section_given_a_value(path: str, section: type[BaseModel], given: Any) -> str:
    """The message for a section (``train.lora``, ``rollout.datasets[0]``) given one value (``train.lora=true``)
    instead of its keys: an example key (``enabled`` for a yes/no), and the section's keys."""
    names = list(section.model_fields)
    switch = isinstance(given, bool) and "enabled" in names
    example = f"{path}.enabled={str(given).lower()}" if switch else f"{path}.{names[0]}=VALUE"
    listed = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
    return (
        f"a section, not one value (got {given!r}): set its keys, e.g. --set {example} (in a file, a mapping "
        f"under it); its keys: {listed}"
    )


def _shown(errors: Sequence[Mapping[str, Any]], path: str, kind: type[BaseModel]) -> str:
    """The input at ``path`` of the first error there, for a union's joined line."""
    for err in errors:
        if _field_path(kind, tuple(err["loc"])) == path:
            return repr(err.get("input"))[:80]
    return "?"


@functools.cache
def _stdin_line(key: str) -> str:
    """One line of standard input (read once per process: ``grpo resume`` applies its overrides twice)."""
    if sys.stdin is None:
        raise ConfigError(f"--set {key}=@stdin: this process has no standard input; use @env:NAME or @file:PATH")
    if sys.stdin.isatty():
        import getpass

        return getpass.getpass(f"{key}: ")
    return sys.stdin.readline().rstrip("\r\n")


def _indirect_value(key: str, value: str) -> str | None:
    """The value of an override written ``@env:NAME``, ``@file:PATH`` or ``@stdin``; None for any other value.

    Raises:
        ConfigError: the variable is unset or empty, the file cannot be read, or the form is unknown.
    """
    if not value.startswith("@"):
        return None
    if value.startswith(ENV_VALUE):
        name = value[len(ENV_VALUE) :]
        if not name:
            raise ConfigError(f"--set {key}={value}: name the environment variable after {ENV_VALUE} ({ENV_VALUE}NAME)")
        if not os.environ.get(name):
            raise ConfigError(f"--set {key}={value}: the environment variable {name!r} is unset or empty; export it")
        return os.environ[name]
    if value.startswith(FILE_VALUE):
        if not value[len(FILE_VALUE) :].strip():
            raise ConfigError(f"--set {key}={value}: name the file after {FILE_VALUE} ({FILE_VALUE}PATH)")
        path = Path(os.path.expandvars(value[len(FILE_VALUE) :])).expanduser()
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"--set {key}={value}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}"
            ) from None
        return text[:-1] if text.endswith("\n") else text
    if value == STDIN_VALUE:
        return _stdin_line(key)
    raise ConfigError(
        f"--set {key}={value}: a value starting with '@' must be {ENV_VALUE}NAME, {FILE_VALUE}PATH or "
        f"{STDIN_VALUE}; quote it for a literal '@' (key=\"'@...'\")"
    )


def _refuse_two_stdin_reads(overrides: list[str]) -> None:
    """Refuse two overrides read from standard input (``key=@stdin``), before either reads it: standard input gives
    one line, so the second would get the next line or an empty string.

    Raises:
        ConfigError: naming both keys and the other forms.
    """
    keys = [item.split("=", 1)[0].strip() for item in overrides if item.partition("=")[2] == STDIN_VALUE]
    if len(keys) > 1:
        raise ConfigError(
            f"--set {keys[0]}={STDIN_VALUE} and --set {keys[1]}={STDIN_VALUE}: standard input gives one value to "
            f"one override; read the other from a file or the environment ({FILE_VALUE}PATH or {ENV_VALUE}NAME)"
        )


def _warn_secrets_on_command_line(config: BaseModel, keys: list[str]) -> None:
    """Warn once per key about each override of ``keys`` (given as ``key=value`` on the command line) that holds a
    secret of ``config``: a ``SecretStr`` field (a URL only with a password), or a secret under it."""
    from grpo_core.security.redact import SecretUrl, secret_fields

    secret = [
        path
        for path, value in secret_fields(config)
        if value.get_secret_value() and not (isinstance(value, SecretUrl) and str(value) == value.get_secret_value())
    ]
    for key in keys:
        dotted = re.sub(r"\[(\d+)\]", r".\1", key)  # ``extra_args[1]`` is the secret path ``extra_args.1``
        inside = [path for path in secret if path == dotted or path.startswith(dotted + ".")]
        if inside:  # once per process (grpo resume loads its overrides twice): grpo_core/config/shown_once.py
            # the field holding the secret alone, when a path can name it (not an item of a list: extra_args)
            target = next((p for p in inside if not any(part.isdigit() for part in p.split("."))), key)
            logger.warning(
                "--set %s=... puts a secret on the command line, readable by any user of this host "
                "(/proc/<pid>/cmdline, ps) while the command runs; use --set %s=@env:NAME, @file:PATH or @stdin",
                key,
                target,
            )


#: How YAML writes null: an override of a text field spelt so still unsets it (``rollout.system_prompt=null``).
_NULL_TEXTS = ("", "~", "null", "Null", "NULL")


def _text_as_written(kind: type[BaseModel], key: str, value: str, parsed: Any) -> Any:
    """An override's value for a field that takes text only (``str`` or ``str | None``): the text as written when
    YAML read it as something else, a mapping (``rollout.system_prompt=Answer: briefly``), a list (``[x]``), a
    number or yes/no (``tracking.experiment_name=2024``), or null through a comment (``# hi``); an explicit null
    spelling stays null. Any other field keeps the YAML value (numbers, lists, yes/no)."""
    members = [m for m in _union_members(_field_annotation(kind, key)) if m is not type(None)]
    if not members or any(m is not str for m in members) or isinstance(parsed, str):
        return parsed
    if parsed is None and value.strip() in _NULL_TEXTS:
        return parsed
    return value


def _validate(
    kind: type[_Strict], data: dict, overrides: list[str] | None, secrets: dict[str, str] | None, hint: str = ""
) -> Any:
    """``kind`` validated from ``data`` after ``secrets`` and ``key.sub=value`` overrides (see :func:`load_config`)."""
    import yaml
    from pydantic import ValidationError

    if secrets:
        from grpo_core.security.redact import apply_secrets

        try:
            apply_secrets(data, secrets)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _refuse_two_stdin_reads(overrides or [])
    plain: list[str] = []  # keys of the overrides whose value is on the command line
    hidden = _hidden_texts(list((secrets or {}).values()))  # values read off the command line: never echoed
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, value = item.split("=", 1)
        if not key.strip():
            raise ConfigError(
                f"override {item!r}: the key before '=' is empty; write key.sub=value, e.g. train.max_steps=5"
            )
        if not all(part.strip() for part in key.split(".")):
            raise ConfigError(
                f"override {item!r}: the key {key!r} has an empty part; write section.field=value, "
                "e.g. train.max_steps=5"
            )
        indirect = _indirect_value(key.strip(), value)
        if indirect is None:
            plain.append(key.strip())
            try:
                parsed = _yaml_load(value)
            except yaml.YAMLError as e:
                raise ConfigError(
                    f"override {item!r}: the value is not a YAML scalar or list ({_yaml_where(e)}); "
                    "quote it, e.g. key='text: with colon'"
                ) from None
            parsed = _text_as_written(kind, key.strip(), value, parsed)
        else:
            hidden |= _hidden_texts(indirect)
            parsed = _indirect_structure(kind, key.strip(), value, indirect)
            hidden |= _hidden_texts(parsed)
        _set_dotted(data, key.strip(), parsed, kind)
    try:
        config = kind.model_validate(data)
        _warn_secrets_on_command_line(config, plain)
        return config
    except ValidationError as e:
        lines = _error_lines(kind, e.errors())
        extra = hint if any(err["type"] == "extra_forbidden" for err in e.errors()) else ""
        what = "trainer sub-config" if kind is TrainerProcessConfig else "run config"
        raise ConfigError(_masked(f"invalid {what}:\n  " + "\n  ".join(lines) + extra, hidden)) from None


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, secrets: dict[str, str] | None = None
) -> RunConfig:
    """Read a run config from YAML, JSON or TOML, apply ``key.sub=value`` overrides, validate.

    Override values are parsed as YAML scalars (``train.max_steps=5``, ``train.lora.enabled=true``); a field that
    takes text only gets the text as written (``rollout.system_prompt=Answer: briefly``, ``tracking.experiment_name=
    2024``), unless it is a null spelling (``null``, ``~``).
    ``secrets`` (``{field path: value}``, what a run's processes get in ``GRPO_RUN_SECRETS``) replace the
    redacted secrets of a config file grpo-flow wrote, before the overrides.

    Raises:
        ConfigError: unreadable or unparsable file (names the line), bad override, or a validation
            error (naming the field).
    """
    return _validate(RunConfig, _read_config(path) if path is not None else {}, overrides, secrets)


def load_trainer_config(
    path: str | Path, overrides: list[str] | None = None, secrets: dict[str, str] | None = None
) -> TrainerProcessConfig:
    """The trainer's sub-config from a config file: a trainer sub-config (the flow's ``train_config.json``,
    ``"process": "trainer"``) as it is, or a whole run config turned into one (:meth:`RunConfig.trainer_process`).

    Overrides and secrets use the fields' paths in the file (``train.max_steps=5``, ``server.api_key``; a sub-config
    holds only what the trainer reads).

    Raises:
        ConfigError: as :func:`load_config`; a sub-config override of a field the trainer does not read says so.
    """
    data = _read_config(path)
    if data.get("process") == "trainer":
        return _validate(
            TrainerProcessConfig,
            data,
            overrides,
            secrets,
            hint=f"\n{path} is a trainer sub-config: it holds only the fields the trainer reads "
            "(TrainerProcessConfig); set other fields in the run config it was made from",
        )
    return _validate(RunConfig, data, overrides, secrets).trainer_process()
