"""Which code a run config may name: config entries (not whole modules) and an allow-list of vLLM flags.

A run config names code in these fields (:func:`code_references` lists them): ``rollout.dataset``
(a ``module:callable`` dataset factory, called with ``rollout.dataset_kwargs``),
``rollout.reward_functions``, ``rollout.tools``, ``rollout.environment_factory`` (one class or a dict
of them), ``rollout.loop_class``, and ``eval.dataset`` / ``eval.reward_functions``. Whoever can create a Prefect
flow run chooses those values, so a name resolves only to a **config entry** of its field's kind
(``grpo_core.entries``), never to any other object of a module (a CLI ``main`` taking an argv, a file writer,
``os.system`` re-exported):

* an entry registered with ``@config_entry(kind)`` (``grpo_core.entries``) in a module of the allow-list:
  ``grpo_core`` (always) or a module named in ``GRPO_ALLOWED_MODULES`` (a name also covers its submodules);
* or an entry listed by name in ``GRPO_ALLOWED_MODULES`` (``my_rewards:accuracy``), for code that does not
  import grpo-flow.

Either way the object is checked for its kind (:func:`grpo_core.entries.check_kind`). ``server.extra_args``
may carry the vLLM flags of :data:`VLLM_SAFE_FLAGS` (tuning values that load no code, open no listener and
read no file); any other flag only when listed itself in ``GRPO_ALLOWED_MODULES`` (``--trust-remote-code``),
and the class path a code-loading flag names (:data:`VLLM_CODE_FLAGS`, e.g. ``--worker-extension-cls``) only
when listed exactly as well (``my_ext.Worker``).

``grpo deploy`` adds the entries and flags named in its ``--demo-config`` file to its worker's allow-list;
``grpo train/validate --config FILE`` (and ``grpo resume --config FILE``) add those of the owner's file and
``--set`` overrides (:func:`trust_config`). A config fetched from MLflow by ``grpo resume RUN_ID`` adds
nothing: it is checked like a parameter.

:func:`check_code_references` refuses a name or flag outside the allow-list before anything is imported or
called (``preflight.check_run`` runs it first), naming the field and the setting to change;
:func:`import_object` checks again where the name is resolved (the rollout process), then admits only a
registered or listed entry of the right kind.

Only the standard library, ``grpo_core.config`` and ``grpo_core.entries`` are imported here.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from dataclasses import dataclass
from typing import Any

from grpo_core.config import RunConfig, dataset_form
from grpo_core.entries import check_kind, entries_of, kind_of_field, registered
from grpo_core.errors import ConfigError, did_you_mean

#: Environment variable of the allow-list (comma-separated modules, ``module:name`` entries and vLLM flags).
ALLOWED_MODULES_ENV = "GRPO_ALLOWED_MODULES"
#: Always allowed: the registered entries of grpo-flow's own code.
DEFAULT_ALLOWED: tuple[str, ...] = ("grpo_core",)
#: vLLM flags ``server.extra_args`` may carry without listing: flag -> whether it takes a value. Each sets a
#: number, a switch or a name of vLLM's own choices; none imports code, reads a file, listens, or changes a
#: setting the run owns (host, port, model, middleware, LoRA and log-prob settings come from their config fields).
VLLM_SAFE_FLAGS: dict[str, bool] = {
    "--api-key": True,
    "--hf-token": True,
    "--max-num-seqs": True,
    "--max-num-batched-tokens": True,
    "--max-num-partial-prefills": True,
    "--max-long-partial-prefills": True,
    "--long-prefill-token-threshold": True,
    "--scheduling-policy": True,
    "--block-size": True,
    "--swap-space": True,
    "--cpu-offload-gb": True,
    "--kv-cache-dtype": True,
    "--kv-cache-memory-bytes": True,
    "--num-gpu-blocks-override": True,
    "--gpu-memory-utilization": True,
    "--quantization": True,
    "--seed": True,
    "--max-seq-len-to-capture": True,
    "--max-parallel-loading-workers": True,
    "--tensor-parallel-size": True,
    "--pipeline-parallel-size": True,
    "--data-parallel-size": True,
    "--tokenizer-mode": True,
    "--tool-call-parser": True,
    "--reasoning-parser": True,
    "--max-cpu-loras": True,
    "--lora-dtype": True,
    "--uvicorn-log-level": True,
    "--enforce-eager": False,
    "--enable-prefix-caching": False,
    "--no-enable-prefix-caching": False,
    "--enable-chunked-prefill": False,
    "--no-enable-chunked-prefill": False,
    "--disable-custom-all-reduce": False,
    "--enable-expert-parallel": False,
    "--async-scheduling": False,
    "--enable-auto-tool-choice": False,
    "--disable-log-stats": False,
    "--enable-log-requests": False,
    "--disable-log-requests": False,
}
#: vLLM flags whose value names Python classes or modules vLLM imports: the flag and each value must be listed.
VLLM_CODE_FLAGS = (
    "--worker-cls",
    "--worker-extension-cls",
    "--middleware",
    "--logits-processors",
    "--scheduler-cls",
    "--distributed-executor-backend",
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_HINT = (
    f"register it with @config_entry (grpo_core.entries) in a module listed in {ALLOWED_MODULES_ENV} where the "
    f"worker runs, list the entry itself there (e.g. {ALLOWED_MODULES_ENV}=my_rewards:accuracy), or pass the "
    "config file to `grpo train --config` yourself"
)


@dataclass(frozen=True)
class CodeRef:
    """One name of code in a run config, or one vLLM flag (or class path of a flag) that needs listing.

    Attributes:
        field: the config field, e.g. ``rollout.reward_functions[1]``.
        spec: the value as written, e.g. ``my_rewards:accuracy``, ``--trust-remote-code``, ``my_ext.Worker``.
        module: the module of a ``module:name`` spec, whose listing admits its registered entries; None for a
            vLLM flag or class path, which only an exact listing admits.
    """

    field: str
    spec: str
    module: str | None


def _flag_refs(args: list[Any]) -> list[CodeRef]:
    """The flags of ``server.extra_args`` outside :data:`VLLM_SAFE_FLAGS` and the class paths of code flags.

    Raises:
        ConfigError: a value with no flag before it (vLLM would read it as the model), or a malformed flag.
    """
    refs: list[CodeRef] = []
    i = 0
    while i < len(args):
        arg, field = str(args[i]), f"server.extra_args[{i}]"
        flag, eq, inline = arg.partition("=")
        if not re.fullmatch(r"--?[A-Za-z0-9][A-Za-z0-9-]*", flag):
            raise ConfigError(f"{field}={arg!r} is no vLLM flag (a value must follow its flag); write '--flag value'")
        takes_value = VLLM_SAFE_FLAGS.get(flag)
        if takes_value is None:  # not on the safe list: the flag itself must be listed; a value may follow
            refs.append(CodeRef(field, flag, None))
            nxt = str(args[i + 1]) if i + 1 < len(args) else ""
            takes_value = bool(eq) or (bool(nxt) and not nxt.startswith("-"))
        elif not takes_value and eq:
            raise ConfigError(f"{field}={arg!r}: {flag} takes no value; write it alone")
        value = inline if eq else (str(args[i + 1]) if takes_value and i + 1 < len(args) else "")
        if takes_value and not eq and i + 1 >= len(args):
            raise ConfigError(f"{field}={arg!r} needs a value after it")
        if flag in VLLM_CODE_FLAGS:
            refs += [CodeRef(f"{field} ({flag})", v, None) for v in filter(None, (s.strip() for s in value.split(",")))]
        i += 1 if eq or not takes_value else 2
    return refs


def code_references(cfg: RunConfig) -> list[CodeRef]:
    """Every name of code in ``cfg``, in field order (a dataset's data forms, ``grpo_core.config.dataset_form``, name
    data), then
    the vLLM flags of ``server.extra_args`` that need listing.

    Raises:
        ConfigError: a malformed ``server.extra_args`` (:func:`_flag_refs`).
    """
    r = cfg.rollout
    pairs: list[tuple[str, str]] = []
    if r.dataset is not None and dataset_form(r.dataset)[0] == "module":
        pairs.append(("rollout.dataset", r.dataset))
    pairs += [
        (f"rollout.datasets[{i}].path", d.path) for i, d in enumerate(r.datasets) if dataset_form(d.path)[0] == "module"
    ]
    pairs += [(f"rollout.reward_functions[{i}]", s) for i, s in enumerate(r.reward_functions)]
    pairs += [(f"rollout.tools[{i}]", s) for i, s in enumerate(r.tools)]
    env = r.environment_factory
    if isinstance(env, str):
        pairs.append(("rollout.environment_factory", env))
    elif isinstance(env, dict):
        pairs += [(f"rollout.environment_factory[{k!r}]", s) for k, s in env.items()]
    pairs.append(("rollout.loop_class", r.loop_class))
    ev = cfg.eval
    if ev.dataset is not None and dataset_form(ev.dataset)[0] == "module":
        pairs.append(("eval.dataset", ev.dataset))
    pairs += [(f"eval.reward_functions[{i}]", s) for i, s in enumerate(ev.reward_functions or [])]
    refs = [CodeRef(field, spec, spec.partition(":")[0]) for field, spec in pairs]
    return refs + _flag_refs(cfg.server.extra_args)


def allowed_modules(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The allow-list: :data:`DEFAULT_ALLOWED` plus the entries of ``$GRPO_ALLOWED_MODULES``."""
    env = os.environ if environ is None else environ
    extra = [e.strip() for e in env.get(ALLOWED_MODULES_ENV, "").split(",") if e.strip()]
    return tuple(dict.fromkeys([*DEFAULT_ALLOWED, *extra]))


def is_allowed(module: str, allowed: tuple[str, ...] | None = None) -> bool:
    """Whether ``module`` is a module of ``allowed`` or a submodule of one (its registered entries may be named)."""
    allowed = allowed_modules() if allowed is None else allowed
    return any(
        module == entry or module.startswith(entry + ".")
        for entry in allowed
        if not entry.startswith("-") and ":" not in entry
    )


def _refuse(ref: CodeRef, allowed: tuple[str, ...]) -> ConfigError:
    shown = ", ".join(allowed)
    if ref.spec.startswith("-"):
        return ConfigError(
            f"{ref.field}={ref.spec!r} is not a vLLM flag a run may set (allowed without listing: "
            f"{', '.join(VLLM_SAFE_FLAGS)}); add {ref.spec} to {ALLOWED_MODULES_ENV} where the worker runs, or pass "
            f"the config file to `grpo train --config` yourself (allowed now: {shown})"
        )
    if ref.module is None:
        return ConfigError(
            f"{ref.field}: {ref.spec!r} names code vLLM imports; add {ref.spec} itself to {ALLOWED_MODULES_ENV} "
            f"where the worker runs, or pass the config file to `grpo train --config` yourself (allowed now: {shown})"
        )
    return ConfigError(
        f"{ref.field}={ref.spec!r}: module {ref.module!r} is not in the allow-list of code a run may name "
        f"({shown}); {_HINT}"
    )


def check_code_references(cfg: RunConfig, allowed: tuple[str, ...] | None = None) -> None:
    """Refuse any name of code or vLLM flag in ``cfg`` outside the allow-list; imports and calls nothing.

    A ``module:name`` passes when listed exactly or when its module is allowed (whether ``name`` is a registered
    entry of its kind is checked where it is imported, :func:`import_object`).

    Raises:
        ConfigError: the first name outside the allow-list (names the field, the module and
            ``GRPO_ALLOWED_MODULES``), a malformed name, or a vLLM flag neither safe nor listed.
    """
    allowed = allowed_modules() if allowed is None else allowed
    for ref in code_references(cfg):
        if ref.spec in allowed:
            continue
        if ref.module is not None:
            _check_form(ref.spec, ref.field)
        if ref.module is None or not is_allowed(ref.module, allowed):
            raise _refuse(ref, allowed)


def check_vllm_args(args: list[Any], allowed: tuple[str, ...] | None = None) -> None:
    """Refuse ``server.extra_args`` carrying a vLLM flag outside :data:`VLLM_SAFE_FLAGS` that the allow-list does not
    list, or a code flag's class path it does not list; where vLLM is launched (``serving.launch.vllm_command``), with
    that worker's allow-list, since a servers' flow run takes its config as a parameter too.

    Raises:
        ConfigError: the first such flag or class path, naming the field and ``GRPO_ALLOWED_MODULES``.
    """
    allowed = allowed_modules() if allowed is None else allowed
    for ref in _flag_refs(args):
        if ref.spec not in allowed:
            raise _refuse(ref, allowed)


def trust_config(cfg: RunConfig) -> tuple[str, ...]:
    """Add the entries (``module:name``) and vLLM flags ``cfg`` names to ``$GRPO_ALLOWED_MODULES`` of this process
    and its children: for a config file its owner passed on the command line. Returns the new allow-list."""
    names = allowed_modules() + tuple(ref.spec for ref in code_references(cfg))
    merged = tuple(dict.fromkeys(names))
    os.environ[ALLOWED_MODULES_ENV] = ",".join(merged)
    return merged


def _check_form(path: str, field: str) -> tuple[str, str]:
    module_name, _, attr = path.partition(":")
    if not _NAME.fullmatch(module_name) or not _NAME.fullmatch(attr or "-"):
        forms = (
            "; a dataset is 'json:PATH' (JSON lines) or 'reasoning_gym:TASK' otherwise, or a data file "
            "(.jsonl, .parquet, .csv, .arrow; 'parquet:PATH', 'csv:PATH', 'arrow:PATH'), 'disk:FOLDER' or "
            "'hf:owner/name'"
        )
        raise ConfigError(
            f"{field}={path!r} must be 'module:attribute' (e.g. 'my_rewards:accuracy')"
            + (forms if field.startswith("rollout.dataset") else "")
        )
    if any(p.startswith("__") for p in attr.split(".")):
        raise ConfigError(f"{field}={path!r}: a name with '__' is refused; name the function or class itself")
    return module_name, attr


def _listed_object(path: str, module: Any, attr: str, field: str) -> Any:
    """The object of an entry listed by name: walk ``attr`` through classes of ``module`` only."""
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if i and not (inspect.isclass(obj) and obj.__module__ == module.__name__):
            raise ConfigError(f"{field}={path!r}: {'.'.join(attr.split('.')[:i])} is no class of {module.__name__}")
        obj = getattr(obj, part)
    home = getattr(getattr(obj, "__func__", obj), "__module__", None)
    if not (inspect.isclass(obj) or inspect.isroutine(obj)) or home != module.__name__:
        raise ConfigError(
            f"{field}={path!r} is no function or class defined in {module.__name__!r} "
            f"({'defined in ' + repr(home) if home else 'a module-level object'}); name one defined there"
        )
    return obj


def _close_names(module: Any, attr: str, kind: str) -> str:
    """``"; did you mean module:a?"`` for the names closest to a misspelt ``attr`` among ``module``'s registered
    entries of ``kind`` and its public functions and classes defined there (an entry listed by name in the
    allow-list need not be registered), else ``""``."""
    name = module.__name__
    names = {entry.partition(":")[2] for entry in entries_of(name, kind)}
    for key, value in vars(module).items():
        home = getattr(getattr(value, "__func__", value), "__module__", None)
        if not key.startswith("_") and (inspect.isclass(value) or inspect.isroutine(value)) and home == name:
            names.add(key)
    return did_you_mean(attr, sorted(names), f"{name}:")


def _close_entries(module_name: str, attr: str, kind: str) -> str:
    """``"; did you mean module:a?"`` for ``module``'s registered entries of ``kind`` closest to a misspelt ``attr``
    (:func:`grpo_core.errors.did_you_mean`), else ``"; its <kind> entries: ..."`` or ``""`` when it has none."""
    names = [name.partition(":")[2] for name in entries_of(module_name, kind)]
    close = did_you_mean(attr, names, f"{module_name}:")
    if close or not names:
        return close
    return f"; its {kind} entries: {', '.join(f'{module_name}:{n}' for n in names)}"


def import_object(path: str, field: str, allowed: tuple[str, ...] | None = None, kind: str | None = None) -> Any:
    """Import the config entry ``module:name`` that config field ``field`` names, checked for its kind.

    The module is checked against the allow-list before it is imported. The object must then be an entry of
    ``kind`` (default: the kind of ``field``, :func:`grpo_core.entries.kind_of_field`): registered with
    ``@config_entry`` as ``module:name``, or listed by name in the allow-list (then a function or class defined in
    ``module``). Any other object of the module — an unregistered function, a module-level object, a re-export —
    is refused.

    Raises:
        ConfigError: a malformed name, a module outside the allow-list (names ``field`` and
            ``GRPO_ALLOWED_MODULES``), an object that is no entry, an entry of another kind, or a module or
            attribute that does not exist.
    """
    allowed = allowed_modules() if allowed is None else allowed
    kind = kind_of_field(field) if kind is None else kind
    module_name, attr = _check_form(path, field)
    listed = path in allowed
    if not listed and not is_allowed(module_name, allowed):
        raise _refuse(CodeRef(field, path, module_name), allowed)
    try:
        module = importlib.import_module(module_name)
        entry = registered(path)
        if entry is not None:
            obj, kinds = entry
            if kind not in kinds:
                check_kind(obj, kind, field, path)  # says what it is, when that is not of the kind
                raise ConfigError(f"{field}={path!r} is registered as a {'/'.join(sorted(kinds))} entry, not a {kind}")
        elif listed:
            if not hasattr(module, attr.split(".")[0]):
                raise ConfigError(
                    f"{field}={path!r} cannot be imported: module {module_name!r} has no attribute "
                    f"{attr.split('.')[0]!r}" + _close_names(module, attr.split(".")[0], kind)
                )
            obj = _listed_object(path, module, attr, field)
        else:
            if not hasattr(module, attr.split(".")[0]):
                raise ConfigError(
                    f"{field}={path!r} cannot be imported: module {module_name!r} has no attribute "
                    f"{attr.split('.')[0]!r}" + _close_entries(module_name, attr, kind)
                )
            names = entries_of(module_name, kind)
            raise ConfigError(
                f"{field}={path!r} is not a registered {kind} entry of {module_name} "
                f"({'its ' + kind + ' entries: ' + ', '.join(names) if names else 'it registers no ' + kind}); "
                f"only config entries can be named: {_HINT}"
            )
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"{field}={path!r} cannot be imported: {exc}; modules are found in the working folder "
            f"({os.getcwd()}) and on PYTHONPATH: run from the folder that holds it or add its folder to PYTHONPATH"
        ) from exc
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{field}={path!r} cannot be imported: {exc}") from exc
    check_kind(obj, kind, field, path)
    return obj
