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


#: Schema-metadata keys of a ``DoGet`` stream (the Flight protocol of ``grpo_core.transport.flight_server``).
META_CONSUMED = b"grpo.consumed"
"""JSON list of the prompts finished without a trainable sample since the last pull."""
META_EXHAUSTED = b"grpo.exhausted"
"""``b"1"`` once every prompt was generated and delivered."""
META_SERVERS_BEHIND = b"grpo.servers_behind"
"""JSON list of the replicas that refused a request for a policy version they do not hold."""
META_DELIVERY = b"grpo.delivery"
"""The stream's delivery id (decimal): the consumer acknowledges it (``ack`` action, and again in its next ticket)
once it read the whole stream; ``0`` = nothing to acknowledge."""

# ``DoAction`` types the rollout's Flight server serves.
ACTION_REPORT = "report"
ACTION_SYNCED = "synced"
ACTION_METRICS = "metrics"
ACTION_COMPLETIONS = "completions"
ACTION_HEARTBEAT = "heartbeat"
ACTION_SHUTDOWN = "shutdown"
ACTION_ACK = "ack"
#: Each action with one line (the server's ``ListActions``).
ACTIONS: dict[str, str] = {
    ACTION_REPORT: "trainer feedback: policy version, tokens consumed by the last step, tokens held",
    ACTION_SYNCED: "the trainer pushed a policy version to the servers outside a step (a resume)",
    ACTION_METRICS: "rollout metric window as JSON",
    ACTION_COMPLETIONS: "the window's sampled completion rows as JSON",
    ACTION_HEARTBEAT: "liveness of the rollout loop",
    ACTION_SHUTDOWN: "stop the rollout process",
    ACTION_ACK: "the consumer holds these deliveries (JSON consumer and delivery ids): they are not sent again",
}


class Allowance(Protocol):
    """The rollout's token allowance as the transport drives it (``grpo_core.rollout.pace.TokenAllowance``).

    Attributes:
        queued_tokens: tokens of the finished groups in the queue.
        held_tokens: tokens the trainer pulled and has not trained yet (its last report).
    """

    queued_tokens: int
    held_tokens: int

    @property
    def limit(self) -> int:
        """Tokens the rollout may hold queued, in flight and held by the trainer."""
        ...

    def report(self, policy_version: int, tokens_consumed: int, held_tokens: int = 0) -> None:
        """The trainer's feedback after a step (see :meth:`SampleSource.report`)."""
        ...

    def synced(self, policy_version: int) -> None:
        """The servers hold ``policy_version`` now."""
        ...


class RolloutQueue(Protocol):
    """The rollout's queue of finished groups as the Flight server serves it (``grpo_core.rollout.queue``).

    Attributes:
        allowance: the token allowance the trainer's reports feed.
        schema: the Sample schema of the batches it hands out.
        last_beat: ``time.monotonic()`` of the rollout loop's last tick.
        failure: the loop's traceback once it failed, else None.
        finished: every prompt was generated.
        running: the loop started.
    """

    allowance: Allowance
    schema: pa.Schema
    last_beat: float
    failure: str | None
    finished: bool
    running: bool

    def deliver(
        self, min_samples: int, wait_s: float, consumer: str, acks: list[int] | tuple[int, ...] = ()
    ) -> Delivery:
        """One pull of ``consumer``: acknowledge ``acks``, queue again what it holds unacknowledged, wait up to
        ``wait_s`` for ``min_samples`` (or the end), then pop everything queued as one delivery that stays in flight
        until :meth:`ack`."""
        ...

    def ack(self, consumer: str, delivery_ids: list[int] | tuple[int, ...]) -> None:
        """``consumer`` holds these deliveries: they are never sent again."""
        ...


@dataclass
class Delivery:
    """What one pull takes off the rollout's queue (``grpo_core.rollout.queue.SampleQueue.deliver``).

    Attributes:
        delivery_id: the id the consumer acknowledges once it holds the delivery (0: nothing to acknowledge).
        batches: Sample-schema record batches, one per group, whole groups only.
        consumed: prompts finished without a trainable sample.
        exhausted: every prompt was generated and nothing is left queued or in flight.
        queued: samples queued before the pop (re-queued ones included).
        waits: seconds each taken sample spent in the queue (one per sample, in row order).
    """

    delivery_id: int
    batches: list[pa.RecordBatch]
    consumed: list[int]
    exhausted: bool
    queued: int
    waits: list[float] = field(default_factory=list)


class MetricDrain(Protocol):
    """The rollout's metric window as the Flight server reads it (``grpo_core.rollout.window.MetricWindow``)."""

    def add(self, name: str, value: float) -> None:
        """Record one value of metric ``name``."""
        ...

    def add_many(self, name: str, values: list[float]) -> None:
        """Record several values of metric ``name``."""
        ...

    def drain(self) -> dict[str, float]:
        """The window's aggregated metrics; the window starts empty again."""
        ...


class CompletionDrain(Protocol):
    """The sampled completion rows of a logging window (``grpo_core.rollout.window.CompletionSample``)."""

    def drain(self) -> list[dict]:
        """The rows sampled since the last call."""
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
        num_tokens: tokens forwarded by the run's optimizer steps so far, every rank's, a prefix that the packing
            shares between samples counted once (the ``num_tokens`` metric, continued by a resume).
    """

    policy_version: int = 0
    step: int = 0
    first_untrained_prompt_index: int = 0
    trained_above: list[int] = field(default_factory=list)
    epoch: int = 0
    num_tokens: int = 0

    @functools.cached_property
    def _trained_above(self) -> frozenset[int]:
        return frozenset(self.trained_above)

    def is_done(self, prompt_index: int) -> bool:
        """Whether the prompt needs no generation on resume."""
        return prompt_index < self.first_untrained_prompt_index or prompt_index in self._trained_above
