"""Reward functions of the ready configs: a lenient numeric check and a format term (demo), a smoke-run reward (tiny).

Reasoning-gym's verifiers score the text inside ``<answer></answer>`` (or the last line) exactly;
a 135M model rarely uses the tags at first, so the demo scores the number it ends on instead and
pays a small bonus for the tag format, which GRPO then teaches quickly.
"""

from __future__ import annotations

import re
from typing import Any

from grpo_core.entries import config_entry

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _text(completion: list[dict[str, Any]]) -> str:
    return "".join(m.get("content") or "" for m in completion if m.get("role") == "assistant").strip()


def final_number(text: str) -> str | None:
    """The number inside the last ``<answer>`` tags, else the last number of the text (None if none)."""
    tagged = _ANSWER.findall(text)
    numbers = _NUMBER.findall(tagged[-1] if tagged else text)
    return numbers[-1] if numbers else None


@config_entry("reward")
def numeric_answer_reward(completions: list[list[dict[str, Any]]], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the completion's final number (see :func:`final_number`) equals the row's ``answer``, else 0."""
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        got = final_number(_text(completion))
        try:
            out.append(float(got is not None and float(got) == float(expected)))
        except ValueError:
            out.append(0.0)
    return out


@config_entry("reward")
def answer_format_reward(completions: list[list[dict[str, Any]]], **_: Any) -> list[float]:
    """0.2 when the completion ends with its only ``<answer>…</answer>`` (the format the system prompt asks for)."""
    out = []
    for completion in completions:
        text = _text(completion)
        found = _ANSWER.findall(text)
        out.append(0.2 if len(found) == 1 and text.endswith("</answer>") and found[0].strip() else 0.0)
    return out


@config_entry("reward")
def even_token_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """Fraction of a completion's token ids that are even (0 for an empty completion).

    A smoke-run reward (``configs/tiny.yaml``): it varies between the rollouts of a group even for a
    randomly initialised model (about Binomial(n, 1/2)/n for n tokens), so every group carries signal,
    and a policy can learn it by moving probability to even ids.
    """
    return [sum(1 for t in ids if t % 2 == 0) / len(ids) if len(ids) else 0.0 for ids in completion_ids]
