"""Which code a run config may name: the allow-list of modules for ``module:callable`` settings.

A run config names code in these fields (:func:`code_references` lists them): ``rollout.dataset``
(a ``module:callable`` dataset factory, called with ``rollout.dataset_kwargs``),
``rollout.reward_functions``, ``rollout.tools``, ``rollout.environment_factory`` (one class or a dict
of them), ``rollout.loop_class``, and the vLLM flags of ``server.extra_args`` that load code
(:data:`VLLM_CODE_FLAGS`). Whoever can create a Prefect flow run chooses those values, so they
resolve only inside an allow-list set where the worker runs:

* ``GRPO_ALLOWED_MODULES`` (:data:`ALLOWED_MODULES_ENV`): comma-separated module names (a name also
  allows its submodules: ``my_rewards`` allows ``my_rewards.math``) and vLLM flags that run code
  (``--trust-remote-code``, ``--tool-parser-plugin``, ...). ``grpo_core`` is always allowed.
* ``grpo deploy`` adds the modules named in its ``--demo-config`` file to its worker's allow-list;
  ``grpo train/validate --config FILE`` (and ``grpo resume --config FILE``) add the modules named in
  the owner's file and ``--set`` overrides (:func:`trust_config`). A config fetched from MLflow by
  ``grpo resume RUN_ID`` adds nothing: it is checked like a parameter.

:func:`check_code_references` refuses a name outside the allow-list before anything is imported or
called (``preflight.check_run`` runs it first), naming the field and the setting to change;
:func:`import_object` checks again where the name is resolved (the rollout process), then walks the
attribute path without leaving the allowed modules: an attribute that is a module
(``grpo_core.preflight:os.system``), a dunder, or a function or class defined elsewhere
(``grpo_core.config:Path``) is refused too.

Only the standard library and ``grpo_core.config`` are imported here.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from dataclasses import dataclass
from typing import Any

from grpo_core.config import RunConfig
from grpo_core.errors import ConfigError

#: Environment variable of the allow-list (comma-separated module names and vLLM code flags).
ALLOWED_MODULES_ENV = "GRPO_ALLOWED_MODULES"
#: Always allowed: grpo-flow's own code.
DEFAULT_ALLOWED: tuple[str, ...] = ("grpo_core",)
#: vLLM flags of ``server.extra_args`` whose value names a Python class or module it imports.
VLLM_CODE_FLAGS = (
    "--worker-cls",
    "--worker-extension-cls",
    "--middleware",
    "--logits-processors",
    "--scheduler-cls",
    "--distributed-executor-backend",
)
#: vLLM flags that run code from a file or from the model repository; allowed only when listed themselves.
VLLM_CODE_SWITCHES = (
    "--trust-remote-code",
    "--tool-parser-plugin",
    "--reasoning-parser-plugin",
    "--io-processor-plugin",
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_HINT = (
    f"add the module to {ALLOWED_MODULES_ENV} where the worker runs (comma-separated, e.g. "
    f"{ALLOWED_MODULES_ENV}=grpo_core,my_rewards), or pass the config file to `grpo train --config` yourself"
)


@dataclass(frozen=True)
class CodeRef:
    """One name of code in a run config.

    Attributes:
        field: the config field, e.g. ``rollout.reward_functions[1]``.
        spec: the value as written, e.g. ``my_rewards:accuracy``.
        module: what the allow-list must hold: the module of ``spec``, or a vLLM flag of
            :data:`VLLM_CODE_SWITCHES`.
    """

    field: str
    spec: str
    module: str


def _module_of(spec: str) -> str:
    """``pkg.mod`` of ``pkg.mod:attr`` or of a dotted class path ``pkg.mod.Class``."""
    if ":" in spec:
        return spec.partition(":")[0]
    return spec.rpartition(".")[0] or spec


def _flag_refs(args: list[Any]) -> list[CodeRef]:
    refs: list[CodeRef] = []
    for i, raw in enumerate(args):
        arg = str(raw)
        flag, eq, inline = arg.partition("=")
        if flag in VLLM_CODE_SWITCHES:
            refs.append(CodeRef(f"server.extra_args[{i}]", arg, flag))
        elif flag in VLLM_CODE_FLAGS:
            value = inline if eq else (str(args[i + 1]) if i + 1 < len(args) else "")
            for name in filter(None, (v.strip() for v in value.split(","))):
                refs.append(CodeRef(f"server.extra_args[{i}] ({flag})", name, _module_of(name)))
    return refs


def code_references(cfg: RunConfig) -> list[CodeRef]:
    """Every name of code in ``cfg``, in field order (the forms ``reasoning_gym:`` and ``json:`` name data)."""
    r = cfg.rollout
    refs: list[CodeRef] = []
    if r.dataset is not None and not r.dataset.startswith(("reasoning_gym:", "json:")):
        refs.append(CodeRef("rollout.dataset", r.dataset, _module_of(r.dataset)))
    refs += [CodeRef(f"rollout.reward_functions[{i}]", s, _module_of(s)) for i, s in enumerate(r.reward_functions)]
    refs += [CodeRef(f"rollout.tools[{i}]", s, _module_of(s)) for i, s in enumerate(r.tools)]
    env = r.environment_factory
    if isinstance(env, str):
        refs.append(CodeRef("rollout.environment_factory", env, _module_of(env)))
    elif isinstance(env, dict):
        refs += [CodeRef(f"rollout.environment_factory[{k!r}]", s, _module_of(s)) for k, s in env.items()]
    refs.append(CodeRef("rollout.loop_class", r.loop_class, _module_of(r.loop_class)))
    return refs + _flag_refs(cfg.server.extra_args)


def allowed_modules(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The allow-list: :data:`DEFAULT_ALLOWED` plus the entries of ``$GRPO_ALLOWED_MODULES``."""
    env = os.environ if environ is None else environ
    extra = [e.strip() for e in env.get(ALLOWED_MODULES_ENV, "").split(",") if e.strip()]
    return tuple(dict.fromkeys([*DEFAULT_ALLOWED, *extra]))


def is_allowed(module: str, allowed: tuple[str, ...] | None = None) -> bool:
    """Whether ``module`` (or a vLLM code flag) is an entry of ``allowed`` or a submodule of one."""
    allowed = allowed_modules() if allowed is None else allowed
    return any(module == entry or (not entry.startswith("-") and module.startswith(entry + ".")) for entry in allowed)


def _refuse(ref: CodeRef, allowed: tuple[str, ...]) -> ConfigError:
    if ref.module.startswith("-"):
        return ConfigError(
            f"{ref.field}={ref.spec!r} runs code that run parameters may not choose; add "
            f"{ref.module} to {ALLOWED_MODULES_ENV} where the worker runs, or pass the config file "
            f"to `grpo train --config` yourself (allowed now: {', '.join(allowed)})"
        )
    return ConfigError(
        f"{ref.field}={ref.spec!r}: module {ref.module!r} is not in the allow-list of code a run "
        f"may name ({', '.join(allowed)}); {_HINT}"
    )


def check_code_references(cfg: RunConfig, allowed: tuple[str, ...] | None = None) -> None:
    """Refuse any name of code in ``cfg`` outside the allow-list; imports and calls nothing.

    Raises:
        ConfigError: the first name outside the allow-list (names the field, the module and
            ``GRPO_ALLOWED_MODULES``), or a malformed name.
    """
    allowed = allowed_modules() if allowed is None else allowed
    for ref in code_references(cfg):
        if not ref.module.startswith("-") and not _NAME.fullmatch(ref.module):
            raise ConfigError(f"{ref.field}={ref.spec!r}: {ref.module!r} is not a module name")
        if not is_allowed(ref.module, allowed):
            raise _refuse(ref, allowed)


def trust_config(cfg: RunConfig) -> tuple[str, ...]:
    """Add the modules (and vLLM code flags) ``cfg`` names to ``$GRPO_ALLOWED_MODULES`` of this process and
    its children: for a config file its owner passed on the command line. Returns the new allow-list."""
    names = allowed_modules() + tuple(ref.module for ref in code_references(cfg))
    merged = tuple(dict.fromkeys(names))
    os.environ[ALLOWED_MODULES_ENV] = ",".join(merged)
    return merged


def _defined_in(obj: Any) -> str | None:
    """The module a function, method or class was defined in (None for other objects)."""
    target = getattr(obj, "__func__", obj)
    if inspect.isclass(target) or inspect.isroutine(target):
        return getattr(target, "__module__", None) or "<unknown>"
    return None


def import_object(path: str, field: str, allowed: tuple[str, ...] | None = None) -> Any:
    """Import ``module:attribute`` (attribute may be dotted: ``Class.method``) from an allowed module.

    The module is checked against the allow-list before it is imported; each attribute on the way must be
    a class of an allowed module (never a module, never a dunder), and a function or class found must be
    defined in an allowed module.

    Raises:
        ConfigError: a malformed name, a module outside the allow-list (names ``field`` and
            ``GRPO_ALLOWED_MODULES``), an attribute path leaving it, or a module or attribute that does
            not exist.
    """
    allowed = allowed_modules() if allowed is None else allowed
    module_name, _, attr = path.partition(":")
    if not _NAME.fullmatch(module_name) or not _NAME.fullmatch(attr or "-"):
        raise ConfigError(f"{field}={path!r} must be 'module:attribute' (e.g. 'my_rewards:accuracy')")
    if not is_allowed(module_name, allowed):
        raise _refuse(CodeRef(field, path, module_name), allowed)
    parts = attr.split(".")
    if any(p.startswith("__") for p in parts):
        raise ConfigError(f"{field}={path!r}: a name with '__' is refused; name the function or class itself")
    try:
        obj: Any = importlib.import_module(module_name)
        for i, part in enumerate(parts):
            if i and not (inspect.isclass(obj) and is_allowed(obj.__module__, allowed)):
                raise ConfigError(
                    f"{field}={path!r}: {'.'.join(parts[:i])} is no class of an allowed module; "
                    "name a function or class of the module itself"
                )
            obj = getattr(obj, part)
            if inspect.ismodule(obj):
                raise ConfigError(
                    f"{field}={path!r}: {'.'.join(parts[: i + 1])} is the module {obj.__name__}; "
                    f"write it as '{obj.__name__}:NAME' (it must be allowed itself)"
                )
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{field}={path!r} cannot be imported: {exc}") from exc
    home = _defined_in(obj)
    if home is not None and not is_allowed(home, allowed):
        raise ConfigError(
            f"{field}={path!r} is defined in {home!r}, not in an allowed module ({', '.join(allowed)}); {_HINT}"
        )
    return obj
