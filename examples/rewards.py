"""An example reward file for your own data (``examples/capitals.yaml``; README, "Your own data, reward and model").

A reward function is called once per group: every dataset column arrives as a list with one entry per rollout
(here ``answer``), beside ``completions`` (each rollout's generated messages), ``completion_ids``, ``prompts`` and
the rest of ``grpo_core.rollout.scoring.REWARD_ARGUMENTS``; it returns one number (or None: "does not apply") per
rollout. Rewards of several functions are summed.

``@config_entry("reward")`` registers each as an entry a config may name (``grpo_core.entries``): needed where a
worker runs a deployment's parameters with this module in ``GRPO_ALLOWED_MODULES``; ``grpo train --config`` with
your own file admits the names the file gives even without it.
"""

from __future__ import annotations

from typing import Any

from grpo_core.entries import config_entry


@config_entry("reward")
def contains_answer(completions: list[list[dict[str, Any]]], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the rollout's last message names the row's ``answer`` (case-insensitive), else 0.0.

    Args:
        completions: G completions, each a list of ``{"role", "content"}`` messages (the last is the model's reply).
        answer: the row's ``answer`` column, repeated once per rollout.

    Returns:
        G rewards in {0.0, 1.0}.
    """
    return [float(a.lower() in (c[-1].get("content") or "").lower()) for c, a in zip(completions, answer, strict=True)]


@config_entry("reward")
def brevity(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """A small bonus for short replies: ``0.2 * (1 - n / 32)`` for ``n`` generated tokens (at least 0).

    It also varies inside a group where every rollout names the answer (or none does), so such a group still
    carries a learning signal instead of being dropped for zero reward variance.

    Args:
        completion_ids: G lists of generated token ids.

    Returns:
        G rewards in [0.0, 0.2].
    """
    return [0.2 * max(0.0, 1.0 - len(ids) / 32) for ids in completion_ids]
