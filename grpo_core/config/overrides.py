"""``--set`` override keys and values: a key's path into the config tree (dotted names and list indices,
``rollout.datasets[0].path``), the type of the field it names, the shape of a value read off the command line
(YAML for a list or dict field) and the masking of such values in error messages; YAML parsing that refuses a key
given twice. :mod:`grpo_core.config.loading` applies them.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from pydantic import BaseModel

from grpo_core.errors import ConfigError

#: One part of an override's key: a name and the list indices after it (``datasets[0]``).
_KEY_PART = re.compile(r"([^\[\]]+)((?:\[\d+\])*)")


def _set_dotted(data: dict, key: str, value: object, kind: type[BaseModel] | None = None) -> None:
    """Set ``value`` at an override's ``key`` in the raw config ``data`` (in place): dotted names, and list indices
    into list fields (``rollout.datasets[0].path``). A list the data does not hold yet starts from the field's
    default in ``kind`` (``train.lora.target_modules[0]``).

    Raises:
        ConfigError: a part that is no section (a plain value), an index past the end (names the key and the length),
            or an index into a value that is not a list.
    """
    node: Any = data
    model: Any = kind
    path = _key_path(key)
    written = ""  # the key up to the part at hand, as the user wrote it
    for depth, (name, indices) in enumerate(path):
        last = depth == len(path) - 1
        written += f".{name}" if written else name
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {written.rsplit('.', 1)[0]} is not a section")
        if not indices:
            if last:
                node[name] = value
            else:
                node = node.setdefault(name, {})
            model = _section_model(model, (name,)) if model is not None else None
            continue
        if name not in node:
            node[name] = _list_default(model, name)
            if node[name] is None:
                raise ConfigError(f"--set {key}: {written} is not a list; drop the [{indices[0]}]")
        holder: Any = node
        slot: Any = name
        for n, index in enumerate(indices):
            items = holder[slot]
            if not isinstance(items, list | tuple):
                raise ConfigError(f"--set {key}: {written} is not a list; drop the [{index}]")
            if isinstance(items, tuple):
                holder[slot] = items = list(items)
            if index >= len(items):
                has = f"has {len(items)} item(s), so [{index}] is past its end" if items else "is empty"
                below = f"use an index below {len(items)}, or " if items else ""
                raise ConfigError(f"--set {key}: {written} {has}; {below}set the whole list ({written}=[...])")
            written += f"[{index}]"
            holder, slot = items, index
            if last and n == len(indices) - 1:
                items[index] = value
        node = holder[slot]
        model = _section_model(model, (name,)) if model is not None else None


def _list_default(model: Any, name: str) -> list | None:
    """The default of the list field ``name`` of the section ``model`` as a new list (empty when the field is unknown
    or its default is None); None when the field takes no list."""
    field = (getattr(model, "model_fields", None) or {}).get(name)
    if field is None:
        return []
    if not any(_is_list_type(a) for a in _union_members(field.annotation)):
        return None
    default = field.get_default(call_default_factory=True)
    return list(default) if isinstance(default, list | tuple) else []


def _yaml_where(e: Exception) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def _yaml_load(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the last silently).

    Raises:
        yaml.YAMLError: malformed YAML, or a duplicate key (its ``problem_mark`` is the second key's line).
    """
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base``: explicit keys may override it
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, typing.Hashable) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"the key {key!r} is given twice (first on line {seen[key]}); keep one",
                        key_node.start_mark,
                    )
                if isinstance(key, typing.Hashable):
                    seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _section_model(kind: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model of the section at ``loc`` (field names; list indices and union tags are stepped over), or None."""
    model: Any = kind
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            continue
        model = next(
            (
                t
                for t in (fields[part].annotation, *getattr(fields[part].annotation, "__args__", ()))
                if isinstance(t, type) and issubclass(t, BaseModel)
            ),
            None,
        )
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _key_path(key: str) -> list[tuple[str, list[int]]]:
    """The parts of an override's key: each a field name (or a dict key) and the list indices after it
    (``rollout.datasets[0].path`` -> ``[("rollout", []), ("datasets", [0]), ("path", [])]``).

    Raises:
        ConfigError: a part that is neither ``name`` nor ``name[INDEX]...`` (INDEX a whole number from 0).
    """
    parts = []
    for part in key.split("."):
        match = _KEY_PART.fullmatch(part.strip())
        if match is None:
            raise ConfigError(
                f"--set {key}: {part!r} is not a field name or name[INDEX] (INDEX a whole number from 0); "
                "e.g. rollout.datasets[0].path=data.jsonl"
            )
        parts.append((match[1], [int(i) for i in re.findall(r"\d+", match[2])]))
    return parts


def _field_annotation(kind: type[BaseModel], key: str) -> Any:
    """The type of the config field an override's key names (an item's type after ``[INDEX]``); None for a key
    inside a dict field or one that names no field (pydantic refuses the latter, naming it)."""
    model: Any = kind
    path = _key_path(key)
    for i, (name, indices) in enumerate(path):
        fields = getattr(model, "model_fields", None)
        if fields is None or name not in fields:
            return None
        if i == len(path) - 1:
            annotation = fields[name].annotation
            for _ in indices:  # ``name[i]``: the item type of the list
                annotation = next((a for a in _union_members(annotation) if _is_list_type(a)), None)
                annotation = (typing.get_args(annotation) or (None,))[0]
            return annotation
        model = _section_model(model, (name,))
    return None


def _union_members(annotation: Any) -> tuple[Any, ...]:
    """The members of a union type (``X | Y``, ``Optional[X]``), or ``(annotation,)``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _is_list_type(annotation: Any) -> bool:
    return (typing.get_origin(annotation) or annotation) in (list, tuple, set, frozenset)


def _is_mapping_type(annotation: Any) -> bool:
    origin = typing.get_origin(annotation) or annotation
    return origin is dict or (isinstance(origin, type) and issubclass(origin, BaseModel))


def _indirect_structure(kind: type[BaseModel], key: str, value: str, text: str) -> Any:
    """The value read by ``key=@env:...`` (``@file:``, ``@stdin``) for its field: YAML for a list or dict field
    (``server.extra_args=@env:ARGS`` with ``ARGS='[--api-key, sk-...]'``), the text as it is for any other field,
    and the text too for a field that also takes a string when the YAML is no list or mapping. ``text`` is never
    echoed: it may be a secret.

    Raises:
        ConfigError: a list or dict field whose value is not YAML of that shape (names the key and the form).
    """
    members = _union_members(_field_annotation(kind, key))
    wants_list, wants_mapping = any(map(_is_list_type, members)), any(map(_is_mapping_type, members))
    if not (wants_list or wants_mapping):
        return text
    takes_text = any(not (_is_list_type(m) or _is_mapping_type(m) or m is type(None)) for m in members)
    import yaml

    shape = "a YAML list, e.g. [--api-key, KEY]" if wants_list else "a YAML mapping, e.g. {api_key: KEY}"
    try:
        parsed = _yaml_load(text)
    except yaml.YAMLError as e:
        if takes_text:
            return text
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"--set {key}={value}: the value read is not YAML{where}; {key} takes {shape}") from None
    if (wants_list and isinstance(parsed, list)) or (wants_mapping and isinstance(parsed, dict)):
        return parsed
    if takes_text:
        return text
    raise ConfigError(f"--set {key}={value}: the value read is not {shape.split(',')[0]}; {key} takes {shape}")


def _hidden_texts(value: Any) -> set[str]:
    """The strings of a secret-sourced value to mask in an error message (its string leaves of 4 characters or
    more: shorter ones would mask ordinary words and numbers)."""
    if isinstance(value, dict):
        return set().union(*map(_hidden_texts, value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*map(_hidden_texts, value)) if value else set()
    return {str(value)} if value is not None and len(str(value)) >= 4 else set()


def _masked(message: str, hidden: set[str]) -> str:
    """``message`` with each string of ``hidden`` replaced by ``**********`` (longest first)."""
    for text in sorted(hidden, key=len, reverse=True):
        message = message.replace(text, "**********")
    return message
