"""The rollout side of the transport: an Arrow Flight server over the rollout's sample queue.

The rollout loop (asyncio thread) pushes finished groups into its sample queue (``grpo_core.rollout.queue``, seen
here only through the :class:`~grpo_core.transport.types.RolloutQueue` protocol); the Flight server (its own gRPC
threads) serves them to the trainer:

- ``DoGet`` ticket ``{"policy_version", "min_samples", "wait_s", "consumer", "acks"}`` (JSON): waits up to
  ``wait_s`` for ``min_samples`` queued samples (or the end), then streams every queued
  group as one Sample-schema batch (whole groups only). What it streams stays in flight under the delivery id of
  ``grpo.delivery`` until the consumer acknowledges it (``ack`` action, or ``acks`` of its next ticket); a
  ``DoGet`` of the same ``consumer`` first queues again what that consumer left unacknowledged (its last stream
  broke, so it pulls again), and a delivery unacknowledged for ``ack_timeout_s`` goes back too
  (``grpo_core.rollout.queue``). The schema metadata carries
  ``grpo.consumed`` (JSON list of prompts finished without a sample), ``grpo.exhausted`` and
  ``grpo.servers_behind`` (JSON list of the replicas that refused a request for a policy version they do not
  hold, e.g. restarted with the base weights: the trainer syncs its weights again).
- ``DoAction``: ``report`` ``{"policy_version", "tokens_consumed", "held_tokens"}`` (token allowance),
  ``metrics`` (JSON metric window), ``completions`` (JSON list of the window's sampled
  completion rows; empty unless ``tracking.log_completions``), ``heartbeat`` (seconds since the
  loop last ticked, the failure traceback if it failed), ``shutdown``, ``ack`` ``{"consumer", "delivery_ids"}``.

Every call (``DoGet``, ``DoAction``, ``ListActions``, …) needs the run's trainer membership key in its
``authorization`` call header (:class:`BearerAuthFactory`); without it the call fails with
``FlightUnauthenticatedError`` before the server does anything (no samples drained, no report, no
shutdown). Nothing but Arrow and JSON crosses the wire (DESIGN.md §3).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.flight as flight

from grpo_core.errors import TransportError
from grpo_core.security.auth import (
    MEMBER_KEY_ENV,
    ROLE_MEMBER,
    TOKEN_ENV,
    check_port_free,
    member_authorized,
    role_key,
)
from grpo_core.transport.types import (
    ACTION_ACK,
    ACTION_COMPLETIONS,
    ACTION_HEARTBEAT,
    ACTION_METRICS,
    ACTION_REPORT,
    ACTION_SHUTDOWN,
    ACTION_SYNCED,
    ACTIONS,
    META_CONSUMED,
    META_DELIVERY,
    META_EXHAUSTED,
    META_SERVERS_BEHIND,
    CompletionDrain,
    MetricDrain,
    RolloutQueue,
)

logger = logging.getLogger(__name__)


class BearerAuthFactory(flight.ServerMiddlewareFactory):
    """Flight server middleware: refuses every call whose ``authorization`` header is not ``Bearer <key>`` with the
    trainer membership key (``grpo_core.security.auth``): the inference and control keys of the HTTP listeners are
    refused like any other.

    Args:
        token: the membership key, or the run's token (which derives it): both pass
            (``grpo_core.security.auth.member_authorized``).
    """

    def __init__(self, token: str) -> None:
        super().__init__()
        self._key = token

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[str]]) -> None:  # noqa: ARG002 - Flight's
        """Check the call's headers (gRPC lower-cases their names).

        Raises:
            FlightUnauthenticatedError: no header, or another token.
        """
        if not any(member_authorized(value, self._key) for value in headers.get("authorization", [])):
            raise flight.FlightUnauthenticatedError(
                "the rollout Flight server needs the run's trainer membership key (authorization: Bearer "
                f"${MEMBER_KEY_ENV}; the inference and control keys do not open it)"
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
        token: the trainer membership key (or the run's token) every call must carry; default ``GRPO_MEMBER_KEY``,
            else derived from ``GRPO_RUN_TOKEN``.
        servers_behind: returns the URLs of the replicas behind the run's policy version (the routing's
            ``ReplicaSet.behind``); None = never any.
        tls: ``(cert_file, key_file)`` PEM paths (``tls.cert_file``, ``tls.key_file``): serve ``grpc+tls``;
            None = plain ``grpc``.

    Raises:
        TransportError: no token is given or set (the server must not start unguarded).
        PortInUseError: the fixed port of ``location`` (``rollout.flight_port``) is taken.
    """

    def __init__(
        self,
        location: str,
        queue: RolloutQueue,
        window: MetricDrain,
        generated_tokens: Callable[[], int],
        on_shutdown: Callable[[], None],
        completions: CompletionDrain | None = None,
        token: str | None = None,
        servers_behind: Callable[[], list[str]] | None = None,
        tls: tuple[str, str] | None = None,
    ) -> None:
        token = token or role_key(ROLE_MEMBER)
        if not token:
            raise TransportError(
                f"the rollout Flight server needs the run's trainer membership key: set {MEMBER_KEY_ENV} "
                f"(or {TOKEN_ENV})"
            )
        where = urlsplit(location)
        check_port_free(where.hostname or "", where.port or 0, "rollout.flight_port")
        if tls is not None:  # grpc+tls: the certificate chain and key, PEM (``tls.cert_file``, ``tls.key_file``)
            certificate = flight.CertKeyPair(Path(tls[0]).read_bytes(), Path(tls[1]).read_bytes())
            location = location.replace("grpc://", "grpc+tls://", 1)
            super().__init__(location, middleware={"auth": BearerAuthFactory(token)}, tls_certificates=[certificate])
        else:
            super().__init__(location, middleware={"auth": BearerAuthFactory(token)})
        self.tls = tls is not None
        self.queue = queue
        self.window = window
        self.completions = completions
        self.generated_tokens = generated_tokens
        self.on_shutdown = on_shutdown
        self.servers_behind = servers_behind or list
        self._rate_mark = (time.monotonic(), 0)

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.RecordBatchStream:  # noqa: ARG002
        """The queued groups the ticket asks for (``min_samples``, waiting up to ``wait_s``), as one stream."""
        return flight.RecordBatchStream(self.take_table(ticket))

    def take_table(self, ticket: flight.Ticket) -> pa.Table:
        """Take the delivery a ``DoGet`` ticket asks for off the queue (it stays in flight until acknowledged).

        Returns:
            The Sample-schema table, with the stream's schema metadata (``grpo.consumed``, ``grpo.exhausted``,
            ``grpo.servers_behind``, ``grpo.delivery``).
        """
        request = json.loads(ticket.ticket.decode())
        got = self.queue.deliver(
            int(request.get("min_samples", 1)),
            float(request.get("wait_s", 1.0)),
            str(request.get("consumer", "")),
            [int(i) for i in request.get("acks", [])],
        )
        self.window.add("rollout/queue_size", got.queued)
        self.window.add_many("sample/time_in_queue_s", got.waits)  # scored and queued -> pulled by the trainer
        metadata = {
            META_CONSUMED: json.dumps(got.consumed).encode(),
            META_EXHAUSTED: b"1" if got.exhausted else b"0",
            META_SERVERS_BEHIND: json.dumps(list(self.servers_behind())).encode(),
            META_DELIVERY: str(got.delivery_id).encode(),
        }
        if got.batches:  # groups may differ in optional columns (sampling masks): missing ones become null
            table = pa.concat_tables([pa.Table.from_batches([b]) for b in got.batches], promote_options="default")
        else:
            table = self.queue.schema.empty_table()
        return table.replace_schema_metadata(metadata)

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:  # noqa: ARG002
        """The actions ``do_action`` serves, with one line each."""
        return list(ACTIONS.items())

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> list[flight.Result]:  # noqa: ARG002
        """Serve one of the actions of ``list_actions``."""
        body = json.loads(action.body.to_pybytes().decode() or "{}") if action.body else {}
        if action.type == ACTION_REPORT:
            self.queue.allowance.report(
                int(body["policy_version"]), int(body["tokens_consumed"]), int(body.get("held_tokens", 0))
            )
            answer: object = {"ok": True}
        elif action.type == ACTION_SYNCED:
            self.queue.allowance.synced(int(body["policy_version"]))
            answer = {"ok": True}
        elif action.type == ACTION_METRICS:
            answer = self._metrics()
        elif action.type == ACTION_COMPLETIONS:
            answer = self.completions.drain() if self.completions is not None else []
        elif action.type == ACTION_HEARTBEAT:
            answer = {
                "age_s": time.monotonic() - self.queue.last_beat,
                "failure": self.queue.failure,
                "finished": self.queue.finished,
                "running": self.queue.running,
            }
        elif action.type == ACTION_ACK:
            self.queue.ack(str(body.get("consumer", "")), [int(i) for i in body.get("delivery_ids", [])])
            answer = {"ok": True}
        elif action.type == ACTION_SHUTDOWN:
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
