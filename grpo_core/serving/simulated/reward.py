"""A reward for simulated runs whose kept share is a parameter: the share of groups with unequal rewards.

A group is *kept* (its rewards differ, it trains) when a hash of its prompt and a seed falls below the share, and
*tied* (every rollout 0.0, dropped as zero-std, DESIGN.md §5) otherwise; kept groups score rollout ``i`` as ``i``.
The decision depends on the prompt only, so a group's fate is the same whatever the engine generated, and over many
prompts the kept share converges to the parameter (a Bernoulli draw per prompt).

Configs name it as ``grpo_core.serving.simulated.reward:simulated_reward`` (share from ``GRPO_SIM_KEPT_SHARE``,
default 1/3 as in the H200 runs, where about two groups in three tied); code builds :class:`KeptShareReward`.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any

#: Environment variable of :func:`simulated_reward`'s kept share (a number in [0, 1]).
KEPT_SHARE_ENV = "GRPO_SIM_KEPT_SHARE"
DEFAULT_KEPT_SHARE = 1 / 3


def prompt_draw(prompt: Any, seed: int) -> float:
    """A uniform number in [0, 1) from the prompt's ``repr`` and ``seed`` (BLAKE2b, stable across processes)."""
    digest = hashlib.blake2b(f"{seed}\x00{prompt!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class KeptShareReward:
    """Reward function keeping a share ``kept_share`` of groups (picklable: reward worker processes take it).

    Args:
        kept_share: probability that a group's rewards differ, in [0, 1].
        seed: changes which prompts are kept.

    Raises:
        ValueError: ``kept_share`` outside [0, 1].
    """

    def __init__(self, kept_share: float = DEFAULT_KEPT_SHARE, seed: int = 0) -> None:
        if not (isinstance(kept_share, int | float) and math.isfinite(kept_share) and 0 <= kept_share <= 1):
            raise ValueError(f"kept_share must be a number in [0, 1], got {kept_share!r}")
        self.kept_share, self.seed = float(kept_share), seed
        self.__name__ = "simulated_reward"

    def kept(self, prompt: Any) -> bool:
        """Whether the group of ``prompt`` gets unequal rewards."""
        return prompt_draw(prompt, self.seed) < self.kept_share

    def __call__(self, prompts: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
        """Rewards of one group: ``0, 1, ..., G-1`` when kept, all ``0.0`` otherwise."""
        keep = self.kept(prompts[0]) if prompts else False
        return [float(i) if keep else 0.0 for i in range(len(completion_ids))]


def simulated_reward(prompts: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """:class:`KeptShareReward` with the share in ``GRPO_SIM_KEPT_SHARE`` (default 1/3), seed 0.

    Raises:
        ValueError: the variable is not a number in [0, 1] (names it).
    """
    raw = os.environ.get(KEPT_SHARE_ENV, "")
    try:
        share = float(raw) if raw else DEFAULT_KEPT_SHARE
        return KeptShareReward(share)(prompts, completion_ids, **kwargs)
    except ValueError:
        raise ValueError(f"{KEPT_SHARE_ENV}={raw!r}: expected a number in [0, 1] (the share of kept groups)") from None
