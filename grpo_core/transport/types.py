"""Wire types between the rollout process and the trainer (DESIGN.md §3, §6).

The two sides share only these and the Sample Arrow schema; ``rollout`` and
``train`` never import each other. The Flight implementation of
:class:`SampleSource` is ``grpo_core.transport.flight_client``; the trainer accepts any
object with this shape (an Arrow IPC file source is in ``grpo_core.transport.file_source``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

import pyarrow as pa


@dataclass
class PulledBatch:
    """What one pull from the rollout side returns.

    Attributes:
        samples: Sample-schema record batch; a group's samples arrive together.
        consumed_prompt_indices: prompts finished since the last pull without
            any trainable sample (filtered, zero-std group, all stale).
        dropped_stale_count: samples dropped for staleness in this pull.
        exhausted: the dataset (or max_steps) is done and all was delivered.
        servers_behind: URLs of generation replicas that refused a request for a policy version they do not
            hold (started again with the base weights): the trainer syncs its weights again
            (:meth:`grpo_core.train.trainer.Trainer.sync_servers`).
    """

    samples: pa.RecordBatch
    consumed_prompt_indices: list[int] = field(default_factory=list)
    dropped_stale_count: int = 0
    exhausted: bool = False
    servers_behind: list[str] = field(default_factory=list)


class SampleSource(Protocol):
    """Trainer-side handle on the stream of scored samples."""

    def pull(self, policy_version: int, *, min_samples: int = 1, timeout_s: float | None = None) -> PulledBatch:
        """Block until ``min_samples`` samples (or the end of the stream); drop stale ones."""
        ...

    def report(self, policy_version: int, tokens_consumed: int, held_tokens: int = 0) -> None:
        """Feedback for the token allowance: the policy version, the raw tokens used by the last step, and the raw
        tokens the trainer holds pulled but neither trained nor dropped (they count against the allowance)."""
        ...

    def synced(self, policy_version: int) -> None:
        """The servers hold ``policy_version`` now (the trainer synced it outside a step: a resume)."""
        ...

    def metrics(self) -> dict[str, float]:
        """The rollout side's metrics since the last call."""
        ...

    def close(self) -> None:
        """Release connections (and stop what the source started)."""
        ...


@dataclass
class ResumeState:
    """Where a resumed run restarts (written as ``rollout_state.json`` in checkpoints).

    Attributes:
        policy_version: weight syncs done.
        step: optimizer steps done.
        first_untrained_prompt_index: every prompt below it is trained (or held
            as a pending sample in the checkpoint).
        trained_above: prompts above the watermark that are already trained.
        epoch: dataset epoch of the watermark.
    """

    policy_version: int = 0
    step: int = 0
    first_untrained_prompt_index: int = 0
    trained_above: list[int] = field(default_factory=list)
    epoch: int = 0

    @functools.cached_property
    def _trained_above(self) -> frozenset[int]:
        return frozenset(self.trained_above)

    def is_done(self, prompt_index: int) -> bool:
        """Whether the prompt needs no generation on resume."""
        return prompt_index < self.first_untrained_prompt_index or prompt_index in self._trained_above
