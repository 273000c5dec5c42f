"""The rollout side of the transport: the sample queue and an Arrow Flight server over it.

The rollout loop (asyncio thread) pushes finished groups into :class:`SampleQueue`; the
Flight server (its own gRPC threads) serves them to the trainer:

- ``DoGet`` ticket ``{"policy_version", "min_samples", "wait_s"}`` (JSON): waits up to
  ``wait_s`` for ``min_samples`` queued samples (or the end), then streams every queued
  group as one Sample-schema batch (whole groups only). The schema metadata carries
  ``grpo.consumed`` (JSON list of prompts finished without a sample), ``grpo.exhausted`` and
  ``grpo.servers_behind`` (JSON list of the replicas that refused a request for a policy version they do not
  hold, e.g. restarted with the base weights: the trainer syncs its weights again).
- ``DoAction``: ``report`` ``{"policy_version", "tokens_consumed", "held_tokens"}`` (token allowance),
  ``metrics`` (JSON metric window), ``completions`` (JSON list of the window's sampled
  completion rows; empty unless ``tracking.log_completions``), ``heartbeat`` (seconds since the
  loop last ticked, the failure traceback if it failed), ``shutdown``.

Every call (``DoGet``, ``DoAction``, ``ListActions``, …) needs the run's bearer token in its
``authorization`` call header (:class:`BearerAuthFactory`); without it the call fails with
``FlightUnauthenticatedError`` before the server does anything (no samples drained, no report, no
shutdown). Nothing but Arrow and JSON crosses the wire (DESIGN.md §3).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.flight as flight

from grpo_core.auth import TOKEN_ENV, authorized, check_port_free, run_token
from grpo_core.errors import TransportError
from grpo_core.packing import Sample, sample_schema, samples_to_arrow
from grpo_core.transport.flight_client import META_CONSUMED, META_EXHAUSTED, META_SERVERS_BEHIND

if TYPE_CHECKING:  # the rollout engine passes these in; the transport never imports it at run time
    from grpo_core.rollout.pace import TokenAllowance
    from grpo_core.rollout.window import CompletionSample, MetricWindow

logger = logging.getLogger(__name__)


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


class BearerAuthFactory(flight.ServerMiddlewareFactory):
    """Flight server middleware: refuses every call whose ``authorization`` header is not ``Bearer <token>``.

    Args:
        token: the run's bearer token (``grpo_core.auth``).
    """

    def __init__(self, token: str) -> None:
        super().__init__()
        self._token = token

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[str]]) -> None:  # noqa: ARG002 - Flight's
        """Check the call's headers (gRPC lower-cases their names).

        Raises:
            FlightUnauthenticatedError: no header, or another token.
        """
        if not any(authorized(value, self._token) for value in headers.get("authorization", [])):
            raise flight.FlightUnauthenticatedError(
                "the rollout Flight server needs the run's bearer token (authorization: Bearer $GRPO_RUN_TOKEN)"
            )
        return None


class RolloutFlightServer(flight.FlightServerBase):
    """Flight server of the rollout process (see the module docstring for the protocol).

    Args:
        location: ``grpc://host:port`` to bind (port 0 = a free port).
        queue: the sample queue.
        window: the rollout metric window (drained by ``metrics``).
        generated_tokens: returns the loop's running count of generated tokens.
        on_shutdown: called when the trainer asks the process to stop.
        completions: the completion-table sample (drained by ``completions``), or None.
        token: the bearer token every call must carry; default ``GRPO_RUN_TOKEN``.
        servers_behind: returns the URLs of the replicas behind the run's policy version (the routing's
            ``ReplicaSet.behind``); None = never any.

    Raises:
        TransportError: no token is given or set (the server must not start unguarded).
        PortInUseError: the fixed port of ``location`` (``rollout.flight_port``) is taken.
    """

    def __init__(
        self,
        location: str,
        queue: SampleQueue,
        window: MetricWindow,
        generated_tokens: Callable[[], int],
        on_shutdown: Callable[[], None],
        completions: CompletionSample | None = None,
        token: str | None = None,
        servers_behind: Callable[[], list[str]] | None = None,
    ) -> None:
        token = token or run_token()
        if not token:
            raise TransportError(f"the rollout Flight server needs the run's bearer token: set {TOKEN_ENV}")
        where = urlsplit(location)
        check_port_free(where.hostname or "", where.port or 0, "rollout.flight_port")
        super().__init__(location, middleware={"auth": BearerAuthFactory(token)})
        self.queue = queue
        self.window = window
        self.completions = completions
        self.generated_tokens = generated_tokens
        self.on_shutdown = on_shutdown
        self.servers_behind = servers_behind or list
        self._rate_mark = (time.monotonic(), 0)

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.RecordBatchStream:  # noqa: ARG002
        """The queued groups the ticket asks for (``min_samples``, waiting up to ``wait_s``), as one stream."""
        request = json.loads(ticket.ticket.decode())
        batches, consumed, exhausted, queued, waits = self.queue.take_timed(
            int(request.get("min_samples", 1)), float(request.get("wait_s", 1.0))
        )
        self.window.add("rollout/queue_size", queued)
        self.window.add_many("sample/time_in_queue_s", waits)  # scored and queued -> pulled by the trainer
        metadata = {
            META_CONSUMED: json.dumps(consumed).encode(),
            META_EXHAUSTED: b"1" if exhausted else b"0",
            META_SERVERS_BEHIND: json.dumps(list(self.servers_behind())).encode(),
        }
        if batches:  # groups may differ in optional columns (sampling masks): missing ones become null
            table = pa.concat_tables([pa.Table.from_batches([b]) for b in batches], promote_options="default")
        else:
            table = self.queue.schema.empty_table()
        return flight.RecordBatchStream(table.replace_schema_metadata(metadata))

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:  # noqa: ARG002
        """The actions ``do_action`` serves, with one line each."""
        return [
            ("report", "trainer feedback: policy version, tokens consumed by the last step"),
            ("synced", "the trainer pushed a policy version to the servers outside a step (a resume)"),
            ("metrics", "rollout metric window as JSON"),
            ("completions", "the window's sampled completion rows as JSON"),
            ("heartbeat", "liveness of the rollout loop"),
            ("shutdown", "stop the rollout process"),
        ]

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> list[flight.Result]:  # noqa: ARG002
        """Serve one of the actions of ``list_actions``."""
        body = json.loads(action.body.to_pybytes().decode() or "{}") if action.body else {}
        if action.type == "report":
            self.queue.allowance.report(
                int(body["policy_version"]), int(body["tokens_consumed"]), int(body.get("held_tokens", 0))
            )
            answer: object = {"ok": True}
        elif action.type == "synced":
            self.queue.allowance.synced(int(body["policy_version"]))
            answer = {"ok": True}
        elif action.type == "metrics":
            answer = self._metrics()
        elif action.type == "completions":
            answer = self.completions.drain() if self.completions is not None else []
        elif action.type == "heartbeat":
            answer = {
                "age_s": time.monotonic() - self.queue.last_beat,
                "failure": self.queue.failure,
                "finished": self.queue.finished,
                "running": self.queue.running,
            }
        elif action.type == "shutdown":
            threading.Thread(target=self.on_shutdown, daemon=True).start()
            answer = {"ok": True}
        else:
            raise flight.FlightServerError(f"unknown action {action.type!r}")
        return [flight.Result(pa.py_buffer(json.dumps(answer).encode()))]

    def _metrics(self) -> dict[str, float]:
        out = self.window.drain()
        now, tokens = time.monotonic(), self.generated_tokens()
        then, before = self._rate_mark
        if now > then:
            out["rollout/generated_tokens_per_s"] = (tokens - before) / (now - then)
        self._rate_mark = (now, tokens)
        allowance = self.queue.allowance
        out["rollout/token_allowance"] = float(allowance.limit)
        out["rollout/queued_tokens"] = float(allowance.queued_tokens)
        out["rollout/trainer_held_tokens"] = float(allowance.held_tokens)
        return out
