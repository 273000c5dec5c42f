"""Rewards and advantages of a group (DESIGN.md §5; seed manual, "custom reward functions").

Reward functions are called once per group with keyword arguments ``prompts``,
``completions``, ``completion_ids`` (one entry per rollout) and every other dataset column
(repeated per rollout). Sync functions run in worker processes (``rollout.reward_workers``,
:mod:`grpo_core.rollout.reward_pool`: each call in a process's main thread, so signal-based timeouts work) or,
with ``rollout.reward_workers: 0``, in a thread pool; async ones are awaited; all run together. A function
returns one value per rollout: a number (int, float, bool, a NumPy or other 0-d numeric scalar, ``Decimal``),
or None (or NaN) for "does not apply"; ±inf, a string, bytes or any other object is an error naming the function
(DESIGN.md §5) — a string such as ``"0.5"`` is never read as a number. The reward of a rollout is the sum over
its sources (functions, the environment's ``get_reward``, ``Rollout.reward``) that applied; NaN when none did.
"""

from __future__ import annotations

import asyncio
import decimal
import functools
import math
import numbers
import reprlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from grpo_core.errors import RolloutError, UserCodeError, UserCodeTimeout

from .reward_pool import RewardProcessPool, WorkerRaised
from .types import RolloutGroup
from .usercode import call_user, check_arguments, is_async
from .window import MetricWindow


def source_name(func: Callable[..., Any]) -> str:
    """Name a reward source is logged under: ``__name__``, a partial's function, or the class of a callable."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", None) or type(func).__name__


def _check_values(name: str, values: Any, size: int) -> np.ndarray:
    """``float64[size]`` from a function's answer; None -> NaN. Raises RolloutError naming the function."""
    if not isinstance(values, Sequence | np.ndarray) or isinstance(values, str | bytes | bytearray):
        raise RolloutError(
            f"reward function {name!r} returned {type(values).__name__}; it must return a list "
            f"of {size} floats (None where it does not apply)"
        )
    if len(values) != size:
        raise RolloutError(
            f"reward function {name!r} returned {len(values)} rewards for a group of {size} "
            "rollouts; return one value per completion"
        )
    out = np.full(size, np.nan)
    for i, v in enumerate(values):
        if v is None:
            continue
        out[i] = checked_reward(f"reward function {name!r}", v, i)
    return out


def checked_reward(source: str, value: Any, position: int) -> float:
    """One reward as a float: NaN means "does not apply" (as None); ±inf or a non-number is an error.

    Numbers are ``numbers.Real`` (int, float, bool as 1/0, NumPy and SymPy reals, fractions), NumPy's
    ``bool_``, ``decimal.Decimal`` and 0-d numeric arrays or tensors. A string or bytes is refused even when
    it spells a number (``"0.5"``, ``b"1"``), as is any other object: ``float()`` would read some of them.

    Args:
        source: the reward source as the error should name it, e.g. ``"reward function 'accuracy'"``.
        value: what the source returned for one rollout.
        position: the rollout's index in its group.

    Raises:
        RolloutError: ``value`` is not a number (a misconfigured source; names ``source`` and ``position``).
        UserCodeError: ``value`` is ±inf (the group fails; charged to ``rollout.max_failed_groups``).
    """
    reward = _as_number(value)
    if reward is None:
        raise RolloutError(
            f"{source} returned {reprlib.repr(value)} ({type(value).__name__}) at position {position}; rewards "
            "must be numbers (int, float, bool) or None: return float(...) of the score, not a string, bytes or "
            "another object"
        )
    if math.isinf(reward):
        raise UserCodeError(
            f"{source} returned {reward} at position {position}; rewards must be finite: return "
            "None (or NaN) where the reward does not apply, or a large finite penalty"
        )
    return reward


def _as_number(value: Any) -> float | None:
    """``float(value)`` for a numeric reward (see :func:`checked_reward`), None for anything else."""
    if isinstance(value, str | bytes | bytearray):
        return None
    if isinstance(value, numbers.Real | np.bool_ | decimal.Decimal):
        return float(value)
    if hasattr(value, "__array__") and getattr(value, "shape", None) == ():  # a 0-d array or tensor
        try:
            array = np.asarray(value)
        except (RuntimeError, TypeError, ValueError):  # e.g. a tensor that requires grad
            return None
        if array.dtype.kind in "biuf":
            return float(array)
    return None


async def call_reward_functions(
    funcs: list[Callable[..., Any]],
    kwargs: dict[str, Any],
    size: int,
    executor: Executor,
    *,
    timeout_s: float | None = None,
    window: MetricWindow | None = None,
    pool: RewardProcessPool | None = None,
) -> dict[str, np.ndarray]:
    """Run every reward function on one group, concurrently.

    Args:
        funcs: sync or async reward functions.
        kwargs: the keyword arguments (prompts, completions, completion_ids, dataset columns).
        size: rollouts in the group (G).
        executor: thread pool for the sync functions when ``pool`` is None.
        timeout_s: seconds each call may take (``rollout.reward_timeout_s``); None = no limit. A sync
            function past it is interrupted in its thread (``grpo_core.rollout.usercode``), or its worker process
            is killed.
        window: where a timeout is counted as ``rewards/<name>/timeout_count``.
        pool: worker processes for the sync functions (``rollout.reward_workers``); None = ``executor``'s threads.

    Returns:
        name -> ``float64[size]`` rewards, NaN where the function returned None. A NaN the
        function returned itself also stays NaN, so that rollout gets no reward.

    Raises:
        RolloutError: a function does not take these arguments, or returned the wrong type or length, or (with
            ``pool``) it, an argument or its answer cannot be pickled (names it).
        UserCodeError: a function raised, timed out or returned ±inf (names it; the group fails).
    """

    async def one(func: Callable[..., Any]) -> tuple[str, np.ndarray]:
        name = source_name(func)
        check_arguments(f"reward function {name!r}", func, kwargs)
        in_process = pool is not None and not is_async(func)
        try:
            if pool is not None and in_process:
                values = await pool.call(f"reward function {name!r}", func, kwargs, timeout_s)
            else:
                values = await call_user(func, kwargs, executor, timeout_s)
        except RolloutError as exc:
            if in_process:  # the pool's own: a function, argument or answer it cannot send (a misconfiguration)
                raise
            raise UserCodeError(f"reward function {name!r} raised {type(exc).__name__}: {exc}") from exc
        except TimeoutError:
            if window is not None:
                window.add(f"rewards/{name}/timeout_count", 1)
            raise UserCodeTimeout(
                f"reward function {name!r} took longer than rollout.reward_timeout_s={timeout_s:g} s"
            ) from None
        except Exception as exc:  # a user function: report which one failed
            kind = exc.type_name if isinstance(exc, WorkerRaised) else type(exc).__name__
            raise UserCodeError(f"reward function {name!r} raised {kind}: {exc}") from exc
        return name, _check_values(name, values, size)

    results = await asyncio.gather(*(one(f) for f in funcs))
    out: dict[str, np.ndarray] = {}
    for name, values in results:
        out[name if name not in out else f"{name}_{len(out)}"] = values
    return out


def sum_rewards(sources: dict[str, np.ndarray], size: int, weights: Mapping[str, float] | None = None) -> np.ndarray:
    """``float64[size]``: per rollout, the (weighted) sum of the sources that scored it; NaN if none did.

    A source value that is NaN because the source returned NaN (not None) cannot be told
    apart from "did not apply" here; both leave that source out of the sum.

    Args:
        sources: source name -> ``float64[size]`` (NaN = did not apply).
        size: rollouts in the group.
        weights: source name -> weight (``rollout.reward_weights`` by function name); a source it does not name
            weighs 1. None = every weight 1.
    """
    total = np.zeros(size)
    scored = np.zeros(size, dtype=bool)
    for name, values in sources.items():
        ok = ~np.isnan(values)
        weight = 1.0 if weights is None else float(weights.get(name, 1.0))
        total[ok] += weight * values[ok]
        scored |= ok
    total[~scored] = np.nan
    return total


#: Rewards of a group closer together than this fraction of the group's reward scale (the largest
#: |reward|) count as equal: rounding (``(0.1+0.2)+0.3 != 0.1+(0.2+0.3)``) or float32 noise is not a
#: signal, and normalising it by its tiny std would turn it into advantages of ±1.
ZERO_STD_RTOL = 1e-6


def is_zero_std(rewards: np.ndarray) -> bool:
    """Whether a group carries no signal: fewer than two scored rollouts, or all scored rewards equal.

    Args:
        rewards: ``float64[G]``, NaN = unscored; the scored ones finite.

    Returns:
        True when fewer than two rewards are scored or their range is at most ``ZERO_STD_RTOL``
        times the largest |reward| (so an all-zero group is zero-std, and a group whose rewards
        differ only by rounding is too).
    """
    scored = rewards[~np.isnan(rewards)]
    return len(scored) < 2 or bool(np.ptp(scored) <= ZERO_STD_RTOL * np.max(np.abs(scored)))


def group_advantages(rewards: np.ndarray, scale: str = "group") -> np.ndarray:
    """Group-relative advantages over the scored rollouts (DESIGN.md §5): A = (r - mean) / std with
    ``scale="group"`` (GRPO, Shao et al. 2024, §4.1), A = r - mean with ``scale="none"`` (Dr. GRPO, Liu et al.
    2025, §3.2: no division by the std, which weighs groups of low reward spread up).

    Computed on rewards divided by the group's largest |reward| (so squares cannot overflow; ``none`` multiplies
    it back) with a second centring pass (so the advantages of a kept group sum to 0 up to float32 rounding,
    about ``G * 1e-7``); both leave A unchanged in exact arithmetic.

    Args:
        rewards: ``float64[G]``, NaN = unscored; the scored ones finite.
        scale: ``group`` or ``none`` (``rollout.scale_rewards``).

    Returns:
        ``float32[G]``; 0 for unscored rollouts, and for all when :func:`is_zero_std`. std is the
        population std (ddof=0) of the scored rewards.

    Raises:
        ValueError: an unknown ``scale``.
    """
    if scale not in ("group", "none"):
        raise ValueError(f"rollout.scale_rewards must be 'group' or 'none', got {scale!r}")
    adv = np.zeros(len(rewards), dtype=np.float32)
    if is_zero_std(rewards):
        return adv
    ok = ~np.isnan(rewards)
    largest = np.max(np.abs(rewards[ok]))
    scored = rewards[ok] / largest
    centred = scored - scored.mean()
    centred -= centred.mean()
    if scale == "group":
        adv[ok] = (centred / np.sqrt(np.mean(centred * centred))).astype(np.float32)
    else:
        adv[ok] = (centred * largest).astype(np.float32)
    return adv


def log_group_rewards(window: MetricWindow, group: RolloutGroup, dropped: bool) -> None:
    """Reward metrics of one scored group (seed manual, "logged metrics"): reward, reward_kept|dropped,
    reward_group_std, frac_reward_zero_std, rewards/{name}/mean|group_std."""
    rewards = group.rewards
    assert rewards is not None
    scored = rewards[~np.isnan(rewards)]
    window.add_many("reward", scored.tolist())
    window.add("frac_reward_zero_std", float(dropped))
    num_samples = sum(len(s) for s in group.sequences)
    if dropped:
        window.add_many("reward_dropped", scored.tolist())
    else:
        window.add_many("reward_kept", scored.tolist())
        # Averaged over trained samples: a group weighs by the samples it contributes.
        window.add_many("reward_group_std", [float(scored.std())] * num_samples)
    for name, values in group.source_rewards.items():
        ok = values[~np.isnan(values)]
        window.add_many(f"rewards/{name}/mean", ok.tolist())
        if not dropped and len(ok) > 0:
            window.add_many(f"rewards/{name}/group_std", [float(ok.std())] * num_samples)
