"""From generated rollouts to trainable samples: scores, completion metrics, Sample encoding.

Called once per group after its G rollouts finished; the loop's ``compute_advantages`` hook
sits between :func:`score_group` and :func:`group_samples`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np

from grpo_core.packing import Sample, TokenLists

from .reward_pool import RewardProcessPool
from .rewards import call_reward_functions, checked_reward, sum_rewards
from .types import Rollout, RolloutGroup, TrainingSequence
from .window import MetricWindow

# Sample ids: group_id * SAMPLE_ID_STRIDE + position of the sample in its group.
SAMPLE_ID_STRIDE = 1 << 16

#: The keyword arguments every reward function receives besides the dataset's columns (each column
#: as a list with its row's value repeated G times). The one list: :func:`reward_kwargs` passes
#: exactly these, and ``grpo_core.run.preflight`` accepts exactly these as always supplied.
REWARD_ARGUMENTS: dict[str, str] = {
    "prompts": "list of G prompts (each a list of {'role', 'content'} messages)",
    "completions": "list of G completions (the messages each rollout generated, tool replies included)",
    "completion_ids": "list of G lists of generated token ids",
    "trainer_state": "TrainerState(global_step, max_steps, epoch, num_train_epochs, policy_version) of when the "
    "group started",
    "log_metric": "log_metric(name, value): add a number to the rollout's metric window (mean per logging step)",
    "environments": "list of G environment instances, after the rollout (None entries without environment_factory)",
}
#: Arguments other GRPO trainers pass that grpo-flow cannot; preflight refuses a function that needs one.
UNSUPPORTED_REWARD_ARGUMENTS: dict[str, str] = {
    "log_extra": "grpo-flow keeps no completions table to add columns to; record numbers with log_metric instead",
}


def reward_kwargs(group: RolloutGroup, window: MetricWindow) -> dict[str, Any]:
    """Keyword arguments of the reward functions: the dataset's columns and :data:`REWARD_ARGUMENTS`."""
    size = len(group.rollouts)
    kwargs: dict[str, Any] = {k: [v] * size for k, v in group.row.items() if k != "prompt"}

    def log_metric(name: str, value: float) -> None:
        window.add(str(name), float(value))

    kwargs.update(
        prompts=group.prompts,
        completions=group.completions,
        completion_ids=group.completions_ids,
        trainer_state=group.trainer_state,
        log_metric=log_metric,
        environments=list(group.environments) or [None] * size,
    )
    return kwargs


async def score_group(
    group: RolloutGroup,
    funcs: list[Callable[..., Any]],
    executor: Executor,
    window: MetricWindow,
    timeout_s: float | None = None,
    pool: RewardProcessPool | None = None,
    weights: Mapping[str, float] | None = None,
    overlong: OverlongPenalty | None = None,
) -> None:
    """Set ``group.source_rewards`` and ``group.rewards`` (weighted sum over sources; NaN = unscored).

    Sources: the reward functions, the environments' ``get_reward`` (named after the
    environment class) and ``Rollout.reward`` (named ``rollout``).

    Args:
        timeout_s: seconds each reward function call may take (``rollout.reward_timeout_s``); None = no limit.
        pool: worker processes for the sync reward functions (``rollout.reward_workers``); None = ``executor``.
        weights: source name -> weight in the sum (``rollout.reward_weights``; :func:`sum_rewards`); None = 1 each.
            ``group.source_rewards`` keeps every source's own values.
        overlong: DAPO's soft overlong punishment (``rollout.overlong_buffer_len``), added to each scored rollout's
            reward after the sum (:func:`overlong_penalty`; not a source); None = off.

    Raises:
        RolloutError: a reward function does not take its arguments or returned the wrong type or length.
        UserCodeError: a reward function raised or timed out, or a source returned ±inf.
    """
    size = len(group.rollouts)
    start = time.perf_counter()
    sources = (
        await call_reward_functions(
            funcs, reward_kwargs(group, window), size, executor, timeout_s=timeout_s, window=window, pool=pool
        )
        if funcs
        else {}
    )
    for i, rollout in enumerate(group.rollouts):
        if rollout.env_reward is not None and rollout.env_reward[1] is not None:
            name, value = rollout.env_reward
            sources.setdefault(name, np.full(size, np.nan))[i] = checked_reward(f"{name}.get_reward()", value, i)
        if rollout.reward is not None:
            sources.setdefault("rollout", np.full(size, np.nan))[i] = checked_reward(
                "Rollout.reward", rollout.reward, i
            )
    group.source_rewards = sources
    group.rewards = sum_rewards(sources, size, weights)
    if overlong is not None:  # unscored rollouts stay NaN
        group.rewards = group.rewards + overlong.penalties([len(r.completion_ids) for r in group.rollouts])
    window.add("rollout/score_s", time.perf_counter() - start)


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", §3.4, eq. 13), scaled by ``factor``.

    With L_max = ``max_len`` and L_cache = ``buffer_len``, a completion of |y| generated tokens gains
    ``factor`` × R(y), R(y) = 0 for |y| ≤ L_max − L_cache, ((L_max − L_cache) − |y|) / L_cache for
    L_max − L_cache < |y| ≤ L_max, and −1 for |y| > L_max.

    Attributes:
        max_len: L_max, ``rollout.max_completion_length`` (tokens).
        buffer_len: L_cache, in [1, L_max] (``rollout.overlong_buffer_tokens()``).
        factor: ``rollout.overlong_penalty_factor`` (>= 0).
    """

    max_len: int
    buffer_len: int
    factor: float = 1.0

    def penalties(self, lengths: list[int]) -> np.ndarray:
        """``float64[G]``: each completion's added reward, for ``lengths`` |y| in generated tokens (all turns)."""
        y = np.asarray(lengths, dtype=np.float64)
        expected = self.max_len - self.buffer_len
        r = np.where(y <= expected, 0.0, (expected - y) / self.buffer_len)
        return self.factor * np.where(y > self.max_len, -1.0, r)


def log_completions(group: RolloutGroup, window: MetricWindow, with_tools: bool) -> None:
    """completions/*, rollout/turns_*, tools/call_frequency|failure_frequency|loop_exhausted_frac."""
    lengths = [len(r.completion_ids) for r in group.rollouts]
    terminated = [r.turns[-1].finish_reason == "stop" if r.turns else False for r in group.rollouts]
    window.add_many("completions/mean_length", lengths)
    window.add("completions/min_length", min(lengths))
    window.add("completions/max_length", max(lengths))
    term = [n for n, t in zip(lengths, terminated, strict=True) if t]
    if term:
        window.add_many("completions/mean_terminated_length", term)
        window.add("completions/min_terminated_length", min(term))
        window.add("completions/max_terminated_length", max(term))
    window.add_many("completions/clipped_ratio", [float(not t) for t in terminated])
    seen: set[tuple[int, ...]] = set()
    for r in group.rollouts:
        key = tuple(r.completion_ids)
        window.add("completions/duplicate_frac", float(key in seen))
        seen.add(key)
    turns = [len(r.turns) for r in group.rollouts]
    window.add_many("rollout/turns_mean", turns)
    window.add("rollout/turns_max", max(turns))
    if with_tools:
        calls = sum(r.tool_call_count for r in group.rollouts)
        window.add_many("tools/call_frequency", [r.tool_call_count for r in group.rollouts])
        if calls:
            window.add_rate("tools/failure_frequency", sum(r.tool_failure_count for r in group.rollouts), calls)
        window.add_many("tools/loop_exhausted_frac", [float(r.loop_exhausted) for r in group.rollouts])


def _message_text(messages: list[dict[str, Any]]) -> str:
    """A conversation as text: one message's content alone, several as ``role: content`` lines; an assistant
    message's ``tool_calls`` follow its content as ``name(arguments JSON)``."""

    def text(m: dict[str, Any]) -> str:
        calls = [c.get("function", {}) for c in m.get("tool_calls") or []]
        shown = " ".join(f"{c.get('name')}({json.dumps(c.get('arguments'), default=str)})" for c in calls)
        return " ".join(part for part in (str(m.get("content") or ""), shown) if part)

    if len(messages) == 1:
        return text(messages[0])
    return "\n".join(f"{m.get('role', '')}: {text(m)}" for m in messages)


def completion_rows(group: RolloutGroup, advantages: np.ndarray) -> list[dict[str, Any]]:
    """One table row per rollout of a scored group (seed manual, ``log_completions``).

    Columns, in the order the MLflow UI shows them (what one reads first, first): ``prompt`` and
    ``completion`` (text), ``reward`` (NaN = unscored), ``advantage``, ``reward/<source>`` per reward
    source, ``completion_tokens``, ``finish_reason``, ``prompt_index``, ``policy_version``.
    """
    assert group.rewards is not None
    rows = []
    for i, rollout in enumerate(group.rollouts):
        row: dict[str, Any] = {
            "prompt": _message_text(group.prompts[i]),
            "completion": _message_text(rollout.completion),
            "reward": float(group.rewards[i]),
            "advantage": float(advantages[i]),
        }
        row.update({f"reward/{name}": float(values[i]) for name, values in group.source_rewards.items()})
        row.update(
            {
                "completion_tokens": len(rollout.completion_ids),
                "finish_reason": rollout.turns[-1].finish_reason if rollout.turns else "",
                "prompt_index": group.prompt_index,
                "policy_version": group.policy_version,
            }
        )
        rows.append(row)
    return rows


def token_lists(entries: list[dict[int, float]] | list[list[int]]) -> TokenLists:
    """CSR ``TokenLists`` from one entry per token: ``{id: logprob}`` (top-k) or a list of ids (candidate set)."""
    offsets = np.zeros(len(entries) + 1, dtype=np.int32)
    offsets[1:] = np.cumsum([len(e) for e in entries])
    ids = np.fromiter((k for e in entries for k in e), dtype=np.int32, count=int(offsets[-1]))
    if entries and isinstance(entries[0], dict):
        logprobs = np.fromiter((v for e in entries for v in e.values()), dtype=np.float32, count=int(offsets[-1]))
        return TokenLists(offsets=offsets, ids=ids, logprobs=logprobs)
    return TokenLists(offsets=offsets, ids=ids)


def _sample(seq: TrainingSequence, *, sample_id: int, group: RolloutGroup, advantage: float, with_topk: bool) -> Sample:
    sample = Sample.build(
        seq.input_ids,
        seq.completion_mask,
        seq.sampler_logprobs,
        sample_id=sample_id,
        group_id=group.group_id,
        prompt_index=group.prompt_index,
        advantage=advantage,
        policy_version=group.policy_version,
    )
    if with_topk:
        sample.sampler_topk = token_lists(seq.topk or [{} for _ in seq.input_ids])
    if seq.candidates is not None:
        sample.sampling_mask = token_lists(seq.candidates)
    return sample


def is_truncated(rollout: Rollout) -> bool:
    """Whether a rollout's last turn stopped at the token limit (``finish_reason: length``)."""
    return bool(rollout.turns) and rollout.turns[-1].finish_reason == "length"


def group_samples(
    group: RolloutGroup, advantages: np.ndarray, with_topk: bool, mask_truncated: bool = False
) -> list[Sample]:
    """The group's samples: every sequence of every scored rollout, with its rollout's advantage.

    Unscored rollouts (NaN reward) have advantage 0 and carry no gradient, so they are left out. With
    ``mask_truncated`` (``rollout.mask_truncated_completions``; DAPO's overlong filtering, Yu et al. 2025, §3.4)
    so are the rollouts whose last turn hit the token limit (:func:`is_truncated`): no loss, and no share of
    the step's token normaliser; their rewards still entered the group's advantages.
    """
    assert group.rewards is not None
    samples: list[Sample] = []
    for i, seqs in enumerate(group.sequences):
        if np.isnan(group.rewards[i]) or (mask_truncated and is_truncated(group.rollouts[i])):
            continue
        for seq in seqs:
            samples.append(
                _sample(
                    seq,
                    sample_id=group.group_id * SAMPLE_ID_STRIDE + len(samples),
                    group=group,
                    advantage=float(advantages[i]),
                    with_topk=with_topk,
                )
            )
    return samples


def group_tokens(sequences: list[list[int]] | list[np.ndarray]) -> int:
    """Tokens a group holds in the queue: the sum of its sequence lengths (raw, unpacked tokens).

    The trainer reports the raw tokens of the samples each step consumed (``batch/raw_tokens_per_step``),
    so queue and allowance count the same unit.
    """
    return int(sum(len(s) for s in sequences))
