"""The rollout's sample queue: finished groups waiting for the trainer, and the rollout loop's liveness.

The rollout loop (asyncio thread) puts groups here; the Flight server (``grpo_core.transport.flight_server``, its
own gRPC threads) takes them, through the :class:`~grpo_core.transport.types.RolloutQueue` protocol: the transport
never imports the rollout.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import pyarrow as pa
import pyarrow.flight as flight

from grpo_core.packing import Sample, sample_schema, samples_to_arrow

from .pace import TokenAllowance


class SampleQueue:
    """Finished groups waiting for the trainer, and the loop's liveness (thread-safe).

    Args:
        allowance: told when queued tokens leave.
        with_topk: whether batches carry the sampler top-k columns.
    """

    def __init__(self, allowance: TokenAllowance, with_topk: bool) -> None:
        self.allowance = allowance
        self.schema = sample_schema(with_topk, False)
        self._groups: deque[tuple[pa.RecordBatch, int, float]] = deque()  # (samples, tokens, monotonic put time)
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
        """Wait up to ``wait_s`` for ``min_samples`` (or the end), then pop everything queued.

        Returns:
            ``(batches, consumed prompt indices, exhausted, samples queued before the pop)``.
        """
        return self.take_timed(min_samples, wait_s)[:4]

    def take_timed(
        self, min_samples: int, wait_s: float
    ) -> tuple[list[pa.RecordBatch], list[int], bool, int, list[float]]:
        """:meth:`take`, and the seconds each popped sample spent in the queue (one entry per sample, in the order
        of the batches' rows, from its group's :meth:`put_group` to the pop: ``sample/time_in_queue_s``)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while (
                self._num_samples < min_samples
                and not self.finished
                and self.failure is None
                and time.monotonic() < deadline
            ):
                self._cond.wait(timeout=max(deadline - time.monotonic(), 0.0))
            if self.failure is not None:
                raise flight.FlightServerError(f"rollout loop failed:\n{self.failure}")
            queued = self._num_samples
            groups, self._groups = list(self._groups), deque()
            consumed, self._consumed = self._consumed, []
            self._num_samples = 0
            exhausted = self.finished
            now = time.monotonic()
        self.allowance.dequeued(sum(t for _, t, _ in groups))
        waits = [now - put for b, _, put in groups for _ in range(b.num_rows)]
        return [b for b, _, _ in groups], consumed, exhausted, queued, waits
