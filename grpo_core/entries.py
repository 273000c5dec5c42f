"""Config entries: the registry of callables and classes a run config may name, each with its kind.

A run config names code by ``module:name`` (``rollout.dataset``, ``rollout.reward_functions``, ``rollout.tools``,
``rollout.environment_factory``, ``rollout.loop_class``). Only **entries** can be named, never a module's other
objects: a function or class becomes one with :func:`config_entry`, in ``grpo_core`` and in user modules alike::

    from grpo_core.entries import config_entry

    @config_entry("reward")
    def accuracy(completions, answer, **_): ...

Every entry is checked for its kind where it is registered and again where a config resolves it
(:func:`check_kind`): a ``dataset`` factory, ``reward`` or ``tool`` is a function whose parameters can all be
passed by keyword; an ``environment`` is a class with a ``reset`` method; a ``loop_class`` is a subclass of
``grpo_core.rollout.loop.RolloutLoop``. The registry is keyed by ``module:qualname`` and holds the object itself,
so a subclass or a re-export of an entry is no entry (attributes are not inherited from it).

Only the standard library and ``grpo_core.errors`` are imported here (a user module may import it cheaply).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from grpo_core.errors import ConfigError

T = TypeVar("T")

#: The kinds of entry, and what each must be.
KINDS: dict[str, str] = {
    "dataset": "a function whose parameters can all be passed by keyword (called with rollout.dataset_kwargs)",
    "reward": "a function whose parameters can all be passed by keyword (called with the group's columns)",
    "tool": "a function whose parameters can all be passed by keyword (called with the model's arguments)",
    "environment": "a class with a reset method",
    "loop_class": "a subclass of grpo_core.rollout.loop:RolloutLoop",
}

#: ``module:qualname`` -> (the registered object, its kinds).
_REGISTRY: dict[str, tuple[Any, frozenset[str]]] = {}


def kind_of_field(field: str) -> str:
    """The kind of entry a config field names: ``rollout.reward_functions[1]`` -> ``reward`` (the ``eval`` section's
    ``eval.dataset`` and ``eval.reward_functions`` name the same kinds as the rollout's).

    Raises:
        ValueError: ``field`` is no field that names code (a programming error).
    """
    key = field.partition("[")[0].removeprefix("rollout.").removeprefix("eval.")
    kinds = {
        "dataset": "dataset",
        "datasets": "dataset",  # rollout.datasets[i].path, a mixture's module:callable source
        "reward_functions": "reward",
        "tools": "tool",
        "environment_factory": "environment",
        "loop_class": "loop_class",
    }
    if key not in kinds:
        raise ValueError(f"{field!r} names no code; one of rollout.{', rollout.'.join(kinds)}")
    return kinds[key]


def _keyword_callable(obj: Any) -> str | None:
    """Why ``obj`` is not a function callable with keyword arguments only (None if it is)."""
    if not inspect.isfunction(obj):
        return f"is {_what(obj)}, not a function"
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            return f"has the positional-only parameter {p.name!r}, which a keyword call cannot supply"
    return None


def _what(obj: Any) -> str:
    if inspect.isclass(obj):
        return f"the class {obj.__name__}"
    if inspect.ismodule(obj):
        return f"the module {obj.__name__}"
    return f"a {type(obj).__name__} object"


def _kind_problem(obj: Any, kind: str) -> str | None:
    """Why ``obj`` is not an entry of ``kind`` (None if it is one)."""
    if kind in ("dataset", "reward", "tool"):
        return _keyword_callable(obj)
    if kind == "environment":
        if not inspect.isclass(obj):
            return f"is {_what(obj)}, not a class"
        return None if callable(getattr(obj, "reset", None)) else "has no reset method"
    if kind == "loop_class":
        loop = importlib.import_module("grpo_core.rollout.loop").RolloutLoop
        if not (inspect.isclass(obj) and issubclass(obj, loop)):
            return f"is not a RolloutLoop subclass (it is {_what(obj)})"
        return None
    raise ValueError(f"unknown kind of config entry {kind!r}; one of {', '.join(KINDS)}")


def check_kind(obj: Any, kind: str, field: str, spec: str) -> None:
    """Refuse ``obj`` (named ``spec`` by config field ``field``) unless it is an entry of ``kind`` (:data:`KINDS`).

    Raises:
        ConfigError: ``obj`` is not of ``kind``, naming the field, the name and what the kind must be.
    """
    problem = _kind_problem(obj, kind)
    if problem is not None:
        raise ConfigError(f"{field}={spec!r} {problem}; a {kind} entry must be {KINDS[kind]}")


def config_entry(kind: str | Iterable[str]) -> Callable[[T], T]:
    """Decorator: register a function or class as an entry a run config may name as ``module:name``.

    Args:
        kind: one kind of :data:`KINDS` or several (a function that is both a reward and a tool).

    Returns:
        The decorator; it returns the object unchanged.

    Raises:
        ValueError: an unknown kind, or an object that is not of its kind (checked at once, except
            ``loop_class``, whose base class may still be importing; that one is checked where it is named).
    """
    kinds = frozenset([kind] if isinstance(kind, str) else kind)
    unknown = sorted(kinds - KINDS.keys())
    if unknown or not kinds:
        raise ValueError(f"config_entry kind {sorted(kinds) or '(none)'}: one or more of {', '.join(KINDS)}")

    def register(obj: T) -> T:
        for k in kinds - {"loop_class"}:
            problem = _kind_problem(obj, k)
            if problem is not None:
                raise ValueError(f"config_entry({k!r}) on {obj!r}: it {problem}; a {k} entry must be {KINDS[k]}")
        if "loop_class" in kinds and not inspect.isclass(obj):
            raise ValueError(f"config_entry('loop_class') on {obj!r}: it is not a class")
        key = f"{obj.__module__}:{obj.__qualname__}"  # type: ignore[attr-defined]
        _, before = _REGISTRY.get(key, (None, frozenset()))
        _REGISTRY[key] = (obj, before | kinds)
        return obj

    return register


def registered(spec: str) -> tuple[Any, frozenset[str]] | None:
    """The entry registered as ``spec`` (``module:qualname``) and its kinds, or None. Imports nothing."""
    return _REGISTRY.get(spec)


def entries_of(module: str, kind: str) -> list[str]:
    """The names of ``module``'s registered entries of ``kind`` (for error messages)."""
    return sorted(k for k, (_, kinds) in _REGISTRY.items() if kind in kinds and k.partition(":")[0] == module)
