"""The rollout's sample queue: finished groups waiting for the trainer, and the rollout loop's liveness.

The rollout loop (asyncio thread) puts groups here; the Flight server (``grpo_core.transport.flight_server``, its
own gRPC threads) takes them, through the :class:`~grpo_core.transport.types.RolloutQueue` protocol: the transport
never imports the rollout.

Hand-over with acknowledgement (:meth:`SampleQueue.deliver`, :meth:`SampleQueue.ack`): what a pull takes stays *in
flight* under a delivery id until its consumer acknowledges that id. A delivery goes back to the front of the queue
(groups, settled prompts and tokens, in their order) when the same consumer pulls again without having acknowledged
it (its stream broke: it retries with a fresh pull), or when no acknowledgement came within ``ack_timeout_s`` (the
consumer went away). A re-sent group may reach a consumer that did get it after all (a late acknowledgement): the
consumer drops duplicates by sample id (``grpo_core.transport.flight_client``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.flight as flight

from grpo_core.packing import Sample, sample_schema, samples_to_arrow
from grpo_core.transport.types import Delivery

from .pace import TokenAllowance

#: Seconds a delivery waits for its acknowledgement before it goes back to the queue (the consumer went away).
ACK_TIMEOUT_S = 120.0

_Group = tuple[pa.RecordBatch, int, float]  # (samples, raw tokens, monotonic put time)


@dataclass
class _InFlight:
    """A delivery handed to a consumer and not acknowledged yet."""

    consumer: str
    groups: list[_Group]
    consumed: list[int]
    sent_at: float


class SampleQueue:
    """Finished groups waiting for the trainer, and the loop's liveness (thread-safe).

    Args:
        allowance: told when queued tokens leave (and come back).
        with_topk: whether batches carry the sampler top-k columns.
        ack_timeout_s: seconds a delivery waits for its acknowledgement before it is queued again.
    """

    def __init__(self, allowance: TokenAllowance, with_topk: bool, ack_timeout_s: float = ACK_TIMEOUT_S) -> None:
        self.allowance = allowance
        self.schema = sample_schema(with_topk, False)
        self.ack_timeout_s = ack_timeout_s
        self._groups: deque[_Group] = deque()
        self._in_flight: dict[int, _InFlight] = {}
        self._delivery_ids = itertools.count(1)
        self.num_requeued_groups = 0
        self._consumed: list[int] = []
        self._num_samples = 0
        self._cond = threading.Condition()
        self.finished = False
        self.failure: str | None = None
        self.running = False
        self.last_beat = time.monotonic()

    def put_group(self, prompt_index: int, samples: list[Sample], tokens: int) -> None:  # noqa: ARG002 - the queue's interface
        """Queue one group's samples (encoded to Arrow here, in the loop's thread)."""
        batch = samples_to_arrow(samples)
        with self._cond:
            self._groups.append((batch, tokens, time.monotonic()))
            self._num_samples += batch.num_rows
            self._cond.notify_all()

    def consumed(self, prompt_index: int) -> None:
        """A prompt finished without a trainable sample (rejected, or zero-std group)."""
        with self._cond:
            self._consumed.append(prompt_index)
            self._cond.notify_all()

    def finish(self) -> None:
        """Every prompt was generated; the stream ends once the queue is empty."""
        with self._cond:
            self.finished = True
            self._cond.notify_all()

    def fail(self, traceback_text: str) -> None:
        """The loop failed; every later pull raises with this traceback."""
        with self._cond:
            self.failure = traceback_text
            self._cond.notify_all()

    def beat(self) -> None:
        """The loop is alive (called from its event loop)."""
        self.last_beat = time.monotonic()

    def take(self, min_samples: int, wait_s: float) -> tuple[list[pa.RecordBatch], list[int], bool, int]:
        """Wait up to ``wait_s`` for ``min_samples`` (or the end), then pop everything queued, for good (no
        acknowledgement: a test's or a benchmark's direct reader).

        Returns:
            ``(batches, consumed prompt indices, exhausted, samples queued before the pop)``.
        """
        d = self.deliver(min_samples, wait_s, consumer="")
        self.ack("", [d.delivery_id])
        return d.batches, d.consumed, d.exhausted, d.queued

    def deliver(
        self, min_samples: int, wait_s: float, consumer: str, acks: list[int] | tuple[int, ...] = ()
    ) -> Delivery:
        """One pull of ``consumer``: acknowledge ``acks``, queue again what it holds unacknowledged (and every expired
        delivery), wait up to ``wait_s`` for ``min_samples`` (or the end), then pop everything queued as one
        delivery that stays in flight until :meth:`ack`.

        Args:
            min_samples: samples to wait for.
            wait_s: most seconds to wait.
            consumer: the puller's id (one per trainer-side source); its unacknowledged deliveries were lost.
            acks: delivery ids the consumer holds (acknowledged again here in case the ack action was lost).

        Returns:
            The delivery; ``waits`` are the seconds from each sample's :meth:`put_group` to this pop
            (``sample/time_in_queue_s``).

        Raises:
            FlightServerError: the rollout loop failed.
        """
        deadline = time.monotonic() + wait_s
        with self._cond:
            self._ack_locked(consumer, acks)
            self._requeue_locked(lambda f: f.consumer == consumer)
            while (
                self._num_samples < min_samples
                and not self.finished
                and self.failure is None
                and time.monotonic() < deadline
            ):
                self._cond.wait(timeout=max(deadline - time.monotonic(), 0.0))
                self._requeue_locked(lambda _: False)
            if self.failure is not None:
                raise flight.FlightServerError(f"rollout loop failed:\n{self.failure}")
            queued = self._num_samples
            groups, self._groups = list(self._groups), deque()
            consumed, self._consumed = self._consumed, []
            self._num_samples = 0
            now = time.monotonic()
            delivery_id = 0
            if groups or consumed:
                delivery_id = next(self._delivery_ids)
                self._in_flight[delivery_id] = _InFlight(consumer, groups, consumed, now)
            exhausted = self.finished and all(f.consumer == consumer for f in self._in_flight.values())
        self.allowance.dequeued(sum(t for _, t, _ in groups))
        waits = [now - put for b, _, put in groups for _ in range(b.num_rows)]
        return Delivery(delivery_id, [b for b, _, _ in groups], consumed, exhausted, queued, waits)

    def ack(self, consumer: str, delivery_ids: list[int] | tuple[int, ...]) -> None:
        """``consumer`` holds these deliveries: they leave the in-flight set for good (unknown ids are ignored)."""
        with self._cond:
            self._ack_locked(consumer, delivery_ids)

    @property
    def num_in_flight(self) -> int:
        """Deliveries handed out and not acknowledged yet."""
        with self._cond:
            return len(self._in_flight)

    def _ack_locked(self, consumer: str, delivery_ids: list[int] | tuple[int, ...]) -> None:
        for i in delivery_ids:
            held = self._in_flight.get(i)
            if held is not None and held.consumer == consumer:
                del self._in_flight[i]

    def _requeue_locked(self, lost: Callable[[_InFlight], bool]) -> None:
        """Put back, in front and in their order, the deliveries ``lost`` names and those past ``ack_timeout_s``."""
        now = time.monotonic()
        back = [i for i, f in self._in_flight.items() if lost(f) or now - f.sent_at > self.ack_timeout_s]
        if not back:
            return
        groups = [g for i in sorted(back) for g in self._in_flight[i].groups]
        consumed = [p for i in sorted(back) for p in self._in_flight[i].consumed]
        for i in back:
            del self._in_flight[i]
        self._groups.extendleft(reversed(groups))
        self._consumed[:0] = consumed
        self._num_samples += sum(b.num_rows for b, _, _ in groups)
        self.num_requeued_groups += len(groups)
        self.allowance.requeued(sum(t for _, t, _ in groups))
        self._cond.notify_all()
