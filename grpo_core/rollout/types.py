"""Data of the rollout loop: turns, rollouts, groups, and turn reconciliation into samples.

Follows the seed manual's description of the rollout loop's records (``TurnRecord``,
``Rollout``, ``RolloutGroup``) and of multi-turn reconciliation ("multi-turn rollouts"):
a turn whose prompt starts with the tokens kept so far extends the current sample; any
other turn starts a new one; every generated token is trained in exactly one sample.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class TurnRecord:
    """One sampling request: the prompt sent and the tokens the sampler produced.

    Attributes:
        prompt_ids: full prompt token ids of this turn (earlier turns included).
        output_ids: sampled token ids (EOS included when it ended the turn).
        output_log_probs: ``[len(output_ids)]`` sampler log-prob per output token (natural log).
        output_mask: ``[len(output_ids)]`` 1 = train the token, 0 = context only; None = all trained.
        output_sampling_mask: per output token, the candidate ids of top-k/top-p/min-p; None = full vocabulary.
        output_sampler_logprobs: per output token, ``{token_id: logprob}`` of the sampler's top tokens.
        finish_reason: ``"stop"`` or ``"length"`` (a turn the server aborted is resubmitted, never recorded).
        text: decoded output (special tokens skipped).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None
    output_sampling_mask: list[list[int]] | None = None
    output_sampler_logprobs: list[dict[int, float]] | None = None
    finish_reason: str = "stop"
    text: str = ""


@dataclass
class Rollout:
    """One finished conversation for a prompt, as ``generate_one`` returns it.

    Attributes:
        completion: messages generated after the prompt (assistant and tool messages); reward functions get it.
        completion_ids: generated token ids of all turns, concatenated; reward functions get it.
        turns: the sampling requests, in order; training samples are built from them.
        tool_call_count: tool calls made.
        tool_failure_count: tool calls that failed (unknown name, bad arguments, raised).
        reward: a rollout-level reward (e.g. a judge inside ``generate_one``); None = no such source.
        loop_exhausted: stopped at ``max_tool_calling_iterations`` while still calling tools.
        env_reward: ``(environment class name, what get_reward() returned)`` when the environment has
            ``get_reward``, else None (a returned None or NaN: the environment does not score this rollout).
        rollout_id: random hex id, for debugging.
    """

    completion: list[dict[str, Any]]
    completion_ids: list[int]
    turns: list[TurnRecord]
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    loop_exhausted: bool = False
    env_reward: tuple[str, Any] | None = None
    rollout_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class TrainingSequence:
    """One training sample before its advantage is known (built by :func:`reconcile_turns`).

    Attributes:
        input_ids: ``int32[num_tokens]``.
        completion_mask: ``int8[num_tokens]``, 1 = generated and trained.
        sampler_logprobs: ``float32[num_tokens]``, 0 where not trained.
        topk: per token, ``{token_id: logprob}`` (empty for context tokens); None when not requested.
        candidates: per token, the sampler's candidate ids (top-k/top-p/min-p; empty for context
            tokens); None unless every turn carried ``output_sampling_mask``.
    """

    input_ids: list[int]
    completion_mask: list[int]
    sampler_logprobs: list[float]
    topk: list[dict[int, float]] | None = None
    candidates: list[list[int]] | None = None

    @property
    def num_trained(self) -> int:
        """Trained tokens in the sequence."""
        return sum(self.completion_mask)


@dataclass
class ReconcileStats:
    """Turn transitions of one rollout: how many forked and how many kept tokens each fork re-rendered."""

    transitions: int = 0
    forks: int = 0
    drift_tokens: list[int] = field(default_factory=list)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reconcile_turns(turns: list[TurnRecord]) -> tuple[list[TrainingSequence], ReconcileStats]:
    """Turn a rollout's turns into training sequences (seed manual, "multi-turn rollouts").

    Args:
        turns: the rollout's sampling requests, in order.

    Returns:
        The sequences (those without a trained token are left out) and the transition stats;
        ``drift_tokens`` has one entry per transition (0 when it did not fork).
    """
    stats = ReconcileStats()
    sequences: list[TrainingSequence] = []
    with_topk = any(t.output_sampler_logprobs is not None for t in turns)
    with_mask = bool(turns) and all(t.output_sampling_mask is not None for t in turns)
    current: TrainingSequence | None = None
    for turn in turns:
        if current is not None:
            stats.transitions += 1
            kept = current.input_ids
            if turn.prompt_ids[: len(kept)] == kept:
                stats.drift_tokens.append(0)
                _append(current, turn.prompt_ids[len(kept) :], None, trained=False)
            else:
                stats.forks += 1
                stats.drift_tokens.append(len(kept) - _common_prefix(kept, turn.prompt_ids))
                sequences.append(current)
                current = None
        if current is None:
            current = TrainingSequence([], [], [], [] if with_topk else None, [] if with_mask else None)
            _append(current, turn.prompt_ids, None, trained=False)
        _append(current, turn.output_ids, turn, trained=True)
    if current is not None:
        sequences.append(current)
    return [s for s in sequences if s.num_trained > 0], stats


def _append(seq: TrainingSequence, ids: list[int], turn: TurnRecord | None, *, trained: bool) -> None:
    n = len(ids)
    seq.input_ids.extend(ids)
    if not trained or turn is None:
        seq.completion_mask.extend([0] * n)
        seq.sampler_logprobs.extend([0.0] * n)
        if seq.topk is not None:
            seq.topk.extend({} for _ in range(n))
        if seq.candidates is not None:
            seq.candidates.extend([] for _ in range(n))
        return
    mask = turn.output_mask if turn.output_mask is not None else [1] * n
    logprobs = turn.output_log_probs or [0.0] * n
    if len(mask) != n or len(logprobs) != n:
        raise ValueError(f"TurnRecord has {n} output_ids but {len(mask)} mask and {len(logprobs)} log-prob entries")
    seq.completion_mask.extend(int(m) for m in mask)
    seq.sampler_logprobs.extend(float(lp) if m else 0.0 for lp, m in zip(logprobs, mask, strict=True))
    if seq.topk is not None:
        tops = turn.output_sampler_logprobs or [{} for _ in range(n)]
        seq.topk.extend(top if m else {} for top, m in zip(tops, mask, strict=True))
    if seq.candidates is not None:
        sets = turn.output_sampling_mask or [[] for _ in range(n)]
        seq.candidates.extend(list(c) if m else [] for c, m in zip(sets, mask, strict=True))


@dataclass(frozen=True)
class TrainerState:
    """What reward functions receive as ``trainer_state``: where training stood when their group started.

    The names transformers' (and TRL's) ``TrainerState`` uses are kept, so a curriculum reward written for TRL
    (``trainer_state.global_step / trainer_state.max_steps``) reads the same values here.

    Attributes:
        step: optimizer steps the trainer had completed (resumed steps included); also ``global_step``.
        policy_version: policy version the group was sampled with (weight syncs done).
        epoch: pass over the prompt dataset the group's prompt belongs to (0-based, whole passes: transformers'
            ``epoch`` is a float that also counts the fraction of the current pass).
        max_steps: the optimizer steps the run trains (``train.max_steps``); None where unknown.
        num_train_epochs: passes over the prompt dataset (``rollout.num_epochs``); None when the prompts cycle
            until ``max_steps`` (``rollout.num_epochs: null``) or where unknown.
    """

    step: int
    policy_version: int
    epoch: int
    max_steps: int | None = None
    num_train_epochs: int | None = None

    @property
    def global_step(self) -> int:
        """``step``, under the name transformers' ``TrainerState`` uses (TRL reward functions read it)."""
        return self.step


@dataclass
class RolloutGroup:
    """The G rollouts of one prompt, scored together (one entry per rollout in every list).

    Attributes:
        prompt_index: position of the prompt in the run (``epoch * num_rows + k``, the k-th of its epoch); the group id.
        row_index: index of the row in the dataset.
        epoch: dataset pass the prompt belongs to.
        row: the dataset row (its columns reach reward functions as keyword arguments).
        prompts: the prompt messages of each rollout.
        rollouts: the rollouts, in seed order.
        sequences: training sequences of each rollout (after reconciliation).
        policy_version: trainer policy version when the group started.
        source_rewards: reward source name -> ``float64[G]`` (NaN where the source did not apply).
        rewards: ``float64[G]`` summed rewards; NaN = no source scored the rollout. Set before
            ``compute_advantages``.
        started_at: ``time.monotonic()`` when the group started.
        trainer_step: optimizer steps the trainer had reported when the group started.
        environments: the environment instance of each rollout (None entries without an environment),
            held until the group is scored so reward functions can read their state.
        max_steps: ``train.max_steps`` of the run (None where unknown), for ``trainer_state``.
        num_train_epochs: ``rollout.num_epochs`` (None: cycling, or unknown), for ``trainer_state``.
    """

    prompt_index: int
    row_index: int
    epoch: int
    row: dict[str, Any]
    prompts: list[list[dict[str, Any]]]
    rollouts: list[Rollout]
    sequences: list[list[TrainingSequence]]
    policy_version: int
    source_rewards: dict[str, np.ndarray] = field(default_factory=dict)
    rewards: np.ndarray | None = None
    started_at: float = 0.0
    trainer_step: int = 0
    environments: list[Any] = field(default_factory=list)
    max_steps: int | None = None
    num_train_epochs: int | None = None

    @property
    def trainer_state(self) -> TrainerState:
        """The ``trainer_state`` reward functions receive."""
        return TrainerState(
            step=self.trainer_step,
            policy_version=self.policy_version,
            epoch=self.epoch,
            max_steps=self.max_steps,
            num_train_epochs=self.num_train_epochs,
        )

    @property
    def group_id(self) -> int:
        """Unique id of the group in the run (its prompt position)."""
        return self.prompt_index

    @property
    def completions(self) -> list[list[dict[str, Any]]]:
        """Completion messages of each rollout."""
        return [r.completion for r in self.rollouts]

    @property
    def completions_ids(self) -> list[list[int]]:
        """Generated token ids of each rollout."""
        return [r.completion_ids for r in self.rollouts]
