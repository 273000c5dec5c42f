"""Tools and environments of agent rollouts (seed manual, "agent training").

- A tool is a sync or async function with type hints and a Google-style docstring;
  transformers builds its JSON schema (``get_json_schema``) and the chat template shows it.
- A reply's tool calls are read with transformers' response parsing (``tokenizer.parse_response``)
  when the tokenizer has a ``response_template`` (its own, or ``rollout.response_template``: a
  template dict or a built-in name of :data:`RESPONSE_TEMPLATES`: ``hermes`` for Qwen/Hermes
  ``<tool_call>{…}</tool_call>``, ``mistral`` for ``[TOOL_CALLS][{…}]``, ``llama3`` for
  ``<|python_tag|>{"name", "parameters"}``); otherwise with a regex for the Hermes form.
- An environment class has ``reset(**row) -> str | None``, optional ``get_reward()`` (sync or
  async) and public methods, which become its tools. Instances are pooled: one per rollout
  in flight, reused after ``reset``.
"""

from __future__ import annotations

import inspect
import json
import re
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from .usercode import call_user
from .window import MetricWindow

RESERVED_ENV_METHODS = frozenset({"reset", "get_reward"})
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed call; ``error`` is set when the JSON could not be read.

    Attributes:
        name: the function the model called ("" when it could not be read).
        arguments: its arguments as an object.
        error: why the call could not be read, or None.
        id: the call's id in the conversation (:func:`tool_call_id`; set by the rollout when it runs the call), which
            the assistant message's ``tool_calls`` entry and the tool message's ``tool_call_id`` share.
    """

    name: str
    arguments: dict[str, Any]
    error: str | None = None
    id: str = ""


def tool_call_id(n: int) -> str:
    """The id of a rollout's ``n``-th tool call (0-based): ``call`` + 5 digits, 9 alphanumeric characters (Mistral's
    chat templates refuse any other form; the others take any string), the same in every run."""
    return f"call{n % 100000:05d}"


def assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The model's reply as a chat message: its text without the tool-call markup, and its calls as ``tool_calls``.

    Each entry is ``{"id", "type": "function", "function": {"name", "arguments"}}`` with the arguments as an
    object (the form transformers' chat templates render; ``tojson`` of a string would quote it twice). A call
    that could not be read keeps its place with the name read (or ``"invalid_tool_call"``) and empty arguments,
    so its error answer has a call to belong to.
    """
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.name or "invalid_tool_call",
                    "arguments": call.arguments if call.error is None else {},
                },
            }
            for call in calls
        ]
    return message


def _function_call(name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


#: Response templates (transformers' ``response_template`` format, version 1) of common tool-call formats,
#: for tokenizers that ship none; ``rollout.response_template`` names one.
RESPONSE_TEMPLATES: dict[str, dict[str, Any]] = {
    "hermes": {  # Qwen2.5/Qwen3, Hermes, SmolLM3: <tool_call>{"name", "arguments"}</tool_call>, optional <think>
        "start_anchor": "<|im_start|>assistant\n",
        "defaults": {"role": "assistant"},
        "fields": {
            "content": {"content": "text", "close": "<|im_end|>"},
            "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
            "tool_calls": {
                "open": "<tool_call>",
                "close": "</tool_call>",
                "content": "json",
                "repeats": True,
                "transform": _function_call("{content.name}", "{content.arguments}"),
            },
        },
    },
    "mistral": {  # Mistral/Mixtral instruct: [TOOL_CALLS][{"name", "arguments"}, ...] to the end of the reply
        "start_anchor": "[/INST]",
        "defaults": {"role": "assistant"},
        "fields": {
            "content": {"content": "text", "close_pattern": r"</s>"},
            "tool_calls": {
                "open": "[TOOL_CALLS]",
                "close_pattern": r"</s>|\Z",
                "content": "json",
                "transform_each": True,
                "transform": _function_call("{name}", "{arguments}"),
            },
        },
    },
    "llama3": {  # Llama 3.1-3.3 JSON tool calling: <|python_tag|>{"name", "parameters"} up to <|eom_id|>/<|eot_id|>
        "start_anchor": "<|start_header_id|>assistant<|end_header_id|>",
        "defaults": {"role": "assistant"},
        "fields": {
            "content": {"content": "text", "close_pattern": r"<\|eot_id\|>"},
            "tool_calls": {
                "open": "<|python_tag|>",
                "close_pattern": r"<\|eom_id\|>|<\|eot_id\|>|\Z",
                "content": "json",
                "repeats": True,
                "transform": _function_call("{content.name}", "{content.parameters}"),
            },
        },
    },
}


def resolve_response_template(spec: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """``rollout.response_template`` as a template dict (a built-in name, or a dict checked by transformers).

    Raises:
        ConfigError: an unknown name, or a dict transformers rejects (its message says what is wrong).
    """
    from grpo_core.errors import ConfigError

    if spec is None:
        return None
    if isinstance(spec, str):
        if spec not in RESPONSE_TEMPLATES:
            raise ConfigError(
                f"rollout.response_template={spec!r} is not a built-in template "
                f"({', '.join(RESPONSE_TEMPLATES)}); name one or give a template dict"
            )
        return RESPONSE_TEMPLATES[spec]
    from transformers.utils.chat_parsing.response_templates import load_response_template

    try:
        load_response_template(spec)
    except ValueError as exc:
        raise ConfigError(f"rollout.response_template is not a valid transformers response template: {exc}") from None
    return spec


def parse_tool_calls(
    text: str, tokenizer: Any = None, output_ids: list[int] | None = None, prompt_ids: list[int] | None = None
) -> list[ToolCall]:
    """Tool calls in a model's reply, in the order it made them (:func:`parse_reply` without the text)."""
    return parse_reply(text, tokenizer, output_ids, prompt_ids)[1]


def parse_reply(
    text: str, tokenizer: Any = None, output_ids: list[int] | None = None, prompt_ids: list[int] | None = None
) -> tuple[str, list[ToolCall]]:
    """A model's reply as its text content and its tool calls, in the order it made them.

    With a tokenizer that has a ``response_template``, the reply is parsed by ``tokenizer.parse_response``
    (from ``output_ids`` when given, so special tokens such as ``[TOOL_CALLS]`` are seen, with the prompt
    as prefix); otherwise the Hermes ``<tool_call>{json}</tool_call>`` form is read from ``text``.

    Args:
        text: the decoded reply (special tokens skipped).
        tokenizer: the policy's tokenizer (None = the regex).
        output_ids: the reply's token ids.
        prompt_ids: the prompt's token ids (the parser's prefix: templates may pre-write part of the reply).

    Returns:
        The reply's text without its tool calls (all of ``text`` when it has none, or when the parser failed), and
        one :class:`ToolCall` per call; a call that cannot be read has ``error`` set (reported to the model).
    """
    if getattr(tokenizer, "response_template", None) is not None:
        return _parse_with_template(tokenizer, text, text if output_ids is None else output_ids, prompt_ids)
    calls = _parse_hermes(text)
    return (_TOOL_CALL.sub("", text).strip() if calls else text), calls


def _parse_with_template(
    tokenizer: Any, text: str, response: str | list[int], prompt_ids: list[int] | None
) -> tuple[str, list[ToolCall]]:
    try:
        message = tokenizer.parse_response(response, prefix=prompt_ids if prompt_ids is not None else "")
    except (ValueError, KeyError, TypeError) as exc:  # a region that is not valid JSON, a missing key
        return text, [ToolCall("", {}, error=f"invalid tool call: {exc}"[:400])]
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        name, args = function.get("name"), function.get("arguments", {})
        try:
            if isinstance(args, str):
                args = json.loads(args) if args.strip() else {}
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append(ToolCall(name, args))
        except (ValueError, TypeError) as exc:
            calls.append(ToolCall("", {}, error=f"invalid tool call {str(call)[:200]}: {exc}"))
    content = message.get("content")
    return (content.strip() if isinstance(content, str) else "") if calls else text, calls


def _parse_hermes(text: str) -> list[ToolCall]:
    """The regex fallback: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` blocks."""
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


async def run_tool_calls(
    calls: list[ToolCall],
    tools: dict[str, Callable[..., Any]],
    executor: Executor,
    window: MetricWindow,
    timeout_s: float | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Run calls in order; failures (raising, or taking longer than ``timeout_s`` seconds,
    ``rollout.tool_timeout_s``) become tool-error messages to the model, not crashes.

    Returns:
        The tool messages (``{"role": "tool", "tool_call_id", "name", "content"}``, ``tool_call_id`` the call's
        ``id``, in the calls' order) and the number of failures.
        Counts ``tools/{name}/call_count``, ``tools/{name}/failure_count``, ``tools/{name}/timeout_count``,
        ``tools/unknown_name_count``, and times ``tools/latency_s``, ``tools/{name}/latency_s``.
    """
    messages, failures = [], 0
    for call in calls:
        if call.error is not None:
            failures += 1
            window.add("tools/invalid_call_count", 1)
            messages.append(_tool_message(call, call.name or "invalid_tool_call", f"Error: {call.error}"))
            continue
        func = tools.get(call.name)
        if func is None:
            failures += 1
            window.add("tools/unknown_name_count", 1)
            content = f"Error: unknown tool {call.name!r}; available tools: {sorted(tools)}"
            messages.append(_tool_message(call, call.name, content))
            continue
        start = time.perf_counter()
        window.add(f"tools/{call.name}/call_count", 1)
        try:
            result = await call_user(func, call.arguments, executor, timeout_s)
            content = result if isinstance(result, str) else json.dumps(result, default=str)
        except TimeoutError:
            failures += 1
            window.add(f"tools/{call.name}/failure_count", 1)
            window.add(f"tools/{call.name}/timeout_count", 1)
            content = f"Error: the tool took longer than {timeout_s:g} s and was abandoned"
        except Exception as exc:  # noqa: BLE001 - a user tool failing is reported to the model and counted
            failures += 1
            window.add(f"tools/{call.name}/failure_count", 1)
            content = f"Error: {type(exc).__name__}: {exc}"
        latency = time.perf_counter() - start
        window.add("tools/latency_s", latency)
        window.add(f"tools/{call.name}/latency_s", latency)
        messages.append(_tool_message(call, call.name, content))
    return messages, failures


def _tool_message(call: ToolCall, name: str, content: str) -> dict[str, Any]:
    """A tool's answer to ``call``: ``tool_call_id`` names the call (when it has an id), ``name`` the tool."""
    message: dict[str, Any] = {"role": "tool", "name": name, "content": content}
    if call.id:
        message = {"role": "tool", "tool_call_id": call.id, "name": name, "content": content}
    return message


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
            raise KeyError(
                f"dataset row has environment={name!r}; rollout.environment_factory names "
                f"{sorted(self.factories)}; add it or fix the dataset's 'environment' column"
            )
        return name

    def take(self, name: str) -> object:
        """A free instance of environment ``name`` (new if none is free)."""
        free = self._free[name]
        return free.pop() if free else self.factories[name]()

    def give_back(self, name: str, env: object) -> None:
        """Return an instance ``take`` gave out, for the next rollout."""
        self._free[name].append(env)


def with_tool_system_prompt(messages: list[dict[str, Any]], schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tool schemas in the system message, in the ChatML/Qwen form (``<tools>…</tools>``
    and the ``<tool_call>`` syntax), for chat templates that ignore ``tools``."""
    text = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(json.dumps(s) for s in schemas)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
