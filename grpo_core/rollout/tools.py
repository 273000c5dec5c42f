"""Tools and environments of agent rollouts (seed manual, "agent training").

- A tool is a sync or async function with type hints and a Google-style docstring;
  transformers builds its JSON schema (``get_json_schema``) and the chat template shows it.
- The model calls tools in the ChatML/Qwen form ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``.
- An environment class has ``reset(**row) -> str | None``, optional ``get_reward()`` (sync or
  async) and public methods, which become its tools. Instances are pooled: one per rollout
  in flight, reused after ``reset``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from .window import MetricWindow

RESERVED_ENV_METHODS = frozenset({"reset", "get_reward"})
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed call; ``error`` is set when the JSON could not be read."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Tool calls in a model's reply, in the order it made them."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            data = json.loads(body)
            name, args = data["name"], data.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append(ToolCall(name, args))
        except (ValueError, KeyError, TypeError) as exc:
            calls.append(ToolCall("", {}, error=f"invalid tool call {body[:200]!r}: {exc}"))
    return calls


def tool_name(func: Callable[..., Any]) -> str:
    """Name the model calls a tool by (its ``__name__``)."""
    return func.__name__


def tool_schemas(tools: list[Callable[..., Any]]) -> list[dict[str, Any]]:
    """JSON schemas of the tools, built by transformers from type hints and Google docstrings."""
    from transformers.utils import get_json_schema

    return [get_json_schema(t) for t in tools]


def environment_tools(env: object) -> list[Callable[..., Any]]:
    """Public methods of an environment instance except ``reset``/``get_reward``: its tools."""
    out = []
    for name in dir(type(env)):
        if name.startswith("_") or name in RESERVED_ENV_METHODS:
            continue
        attr = getattr(env, name)
        if inspect.ismethod(attr):
            out.append(attr)
    return out


async def _call(func: Callable[..., Any], kwargs: dict[str, Any], executor: Executor) -> Any:
    if inspect.iscoroutinefunction(func):
        return await func(**kwargs)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, lambda: func(**kwargs))


async def run_tool_calls(calls: list[ToolCall], tools: dict[str, Callable[..., Any]], executor: Executor,
                         window: MetricWindow) -> tuple[list[dict[str, Any]], int]:
    """Run calls in order; failures become tool-error messages to the model, not crashes.

    Returns:
        The tool messages (``{"role": "tool", "name", "content"}``) and the number of failures.
        Counts ``tools/{name}/call_count``, ``tools/{name}/failure_count``,
        ``tools/unknown_name_count``, and times ``tools/latency_s``, ``tools/{name}/latency_s``.
    """
    messages, failures = [], 0
    for call in calls:
        if call.error is not None:
            failures += 1
            window.add("tools/invalid_call_count", 1)
            messages.append({"role": "tool", "name": "error", "content": f"Error: {call.error}"})
            continue
        func = tools.get(call.name)
        if func is None:
            failures += 1
            window.add("tools/unknown_name_count", 1)
            content = f"Error: unknown tool {call.name!r}; available tools: {sorted(tools)}"
            messages.append({"role": "tool", "name": call.name, "content": content})
            continue
        start = time.perf_counter()
        window.add(f"tools/{call.name}/call_count", 1)
        try:
            result = await _call(func, call.arguments, executor)
            content = result if isinstance(result, str) else json.dumps(result, default=str)
        except Exception as exc:  # a user tool failing is reported to the model and counted
            failures += 1
            window.add(f"tools/{call.name}/failure_count", 1)
            content = f"Error: {type(exc).__name__}: {exc}"
        latency = time.perf_counter() - start
        window.add("tools/latency_s", latency)
        window.add(f"tools/{call.name}/latency_s", latency)
        messages.append({"role": "tool", "name": call.name, "content": content})
    return messages, failures


class EnvironmentPool:
    """Reusable environment instances per environment name (one per rollout in flight).

    Args:
        factory: a class (or zero-argument callable), or environment name -> class.
    """

    def __init__(self, factory: Callable[[], object] | dict[str, Callable[[], object]]) -> None:
        self.factories = factory if isinstance(factory, dict) else {"": factory}
        self._free: dict[str, list[object]] = {name: [] for name in self.factories}

    def route(self, row: dict[str, Any]) -> str:
        """Environment name of a row: its ``environment`` column when a dict was given."""
        if set(self.factories) == {""}:
            return ""
        name = row.get("environment")
        if name not in self.factories:
            raise KeyError(f"dataset row has environment={name!r}; rollout.environment_factory names "
                           f"{sorted(self.factories)}; add it or fix the dataset's 'environment' column")
        return name

    def take(self, name: str) -> object:
        """A free instance of environment ``name`` (new if none is free)."""
        free = self._free[name]
        return free.pop() if free else self.factories[name]()

    def give_back(self, name: str, env: object) -> None:
        self._free[name].append(env)
