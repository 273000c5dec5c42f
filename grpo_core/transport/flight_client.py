"""Trainer side of the Flight transport: :class:`FlightSource` pulls samples.

Implements ``grpo_core.transport.types.SampleSource`` against the rollout process's Arrow Flight
server (``grpo_core.transport.flight_server``): ``DoGet`` for samples, ``DoAction`` for the token
allowance report, metrics, heartbeat and shutdown. It lives outside ``grpo_core.rollout`` so
the trainer uses it without importing the rollout engine (STYLE.md: ``rollout`` and
``train`` share only the wire types and a transport); it needs pyarrow only.

Failure detection (the heartbeat): every pull first asks for the loop's heartbeat. The pull
raises ``TransportError`` when the rollout loop failed (with its traceback), when its event
loop has not ticked for ``timeout_s`` (stalled), when the process (if given) has exited, or
when the server has not answered for ``timeout_s`` (dead or unreachable host).

Hand-over (issue 26, item 9): a ``DoGet`` stream broken half-way is retried with a fresh ``DoGet``; the server keeps
what it streamed in flight until this source acknowledges the stream's delivery id, and queues it again when this
source (its ``consumer`` id) pulls without having acknowledged it, so the retry gets those groups again. Each read
stream is acknowledged at once (``ack`` action) and again in the next ticket (the ack itself may be lost); a
group sent twice (an acknowledgement that came after the server's ``ack_timeout_s``) is dropped here by sample id,
as is a settled prompt index seen before.
"""

from __future__ import annotations

import json
import logging
import secrets
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight

from grpo_core.errors import TransportError
from grpo_core.security.auth import ROLE_MEMBER, bearer_headers, role_key, tls_files
from grpo_core.transport.types import (
    ACTION_ACK,
    ACTION_COMPLETIONS,
    ACTION_HEARTBEAT,
    ACTION_METRICS,
    ACTION_REPORT,
    ACTION_SHUTDOWN,
    ACTION_SYNCED,
    META_CONSUMED,
    META_DELIVERY,
    META_EXHAUSTED,
    META_SERVERS_BEHIND,
    PulledBatch,
)

logger = logging.getLogger(__name__)

POLL_S = 1.0
STARTUP_TIMEOUT_S = 600.0


class FlightSource:
    """Pulls scored samples from a rollout process.

    Args:
        location: the Flight server, ``grpc://host:port``.
        max_staleness: samples with ``policy_version - sample.policy_version > max_staleness`` are dropped.
        timeout_s: seconds without a heartbeat (or without an answer) before a pull fails
            (``rollout.rollout_worker_timeout_s``).
        process: the local rollout process (``grpo_core.rollout.process.start_rollout_process``), if this side
            started it: checked for exit, and waited for on close.
        error_path: file the rollout process writes its traceback to when it fails.
        token: the trainer membership key, sent with every call; default ``GRPO_MEMBER_KEY``, else derived from
            ``GRPO_RUN_TOKEN`` (``grpo_core.security.auth.role_key``).
        ca_file: PEM CA file a ``grpc+tls://`` server's certificate is verified against; default the run's
            ``tls.ca_file`` (``GRPO_TLS_CA_FILE``), else the system's trusted CAs.
    """

    def __init__(
        self,
        location: str,
        *,
        max_staleness: int,
        timeout_s: float,
        process: subprocess.Popen | None = None,
        error_path: str | Path | None = None,
        token: str | None = None,
        ca_file: str | None = None,
    ) -> None:
        self.location = location
        self._headers = [
            (k.lower().encode(), v.encode()) for k, v in bearer_headers(token or role_key(ROLE_MEMBER)).items()
        ]
        self.max_staleness = max_staleness
        self.timeout_s = timeout_s
        self.process = process
        self.error_path = error_path
        ca_file = ca_file or tls_files()[2]
        if location.startswith("grpc+tls://") and ca_file is not None:
            self._client = flight.connect(location, tls_root_certs=Path(ca_file).read_bytes())
        else:
            self._client = flight.connect(location)
        self._last_contact = time.monotonic()
        self._dropped_since_metrics = 0
        self._closed = False
        self.consumer = secrets.token_hex(8)  # this source's id on the server: its unacknowledged pulls were lost
        self._unacked: list[int] = []  # delivery ids read whose ack the server has not confirmed
        self._seen_samples: set[int] = set()  # sample ids received: a re-sent group is dropped
        self._seen_consumed: set[int] = set()  # settled prompt indices received
        self.num_duplicate_samples = 0

    # ----- failures ---------------------------------------------------------------------------

    def _traceback(self) -> str:
        if self.error_path and Path(self.error_path).is_file():
            return Path(self.error_path).read_text()
        return ""

    def _fail(self, reason: str) -> TransportError:
        tb = self._traceback()
        detail = f"\n--- rollout process traceback ({self.error_path}) ---\n{tb}" if tb else ""
        return TransportError(f"rollout at {self.location}: {reason}{detail}")

    def _check_process(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise self._fail(f"the rollout process (pid {self.process.pid}) exited with code {self.process.returncode}")

    def _rpc(self, call: Callable[..., Any], *args: Any) -> Any:
        """Run a Flight call; connection failures raise TransportError after ``timeout_s`` without contact."""
        while True:
            self._check_process()
            try:
                result = call(*args)
                self._last_contact = time.monotonic()
                return result
            except flight.FlightUnauthenticatedError:
                raise self._fail(
                    "it refused this process's token (GRPO_MEMBER_KEY, or GRPO_RUN_TOKEN, is not the run's)"
                ) from None
            except flight.FlightServerError as exc:
                raise self._fail(str(exc).split("\n. Detail:")[0]) from None
            except (
                flight.FlightUnavailableError,
                flight.FlightTimedOutError,
                flight.FlightInternalError,
                OSError,
            ) as exc:
                silent = time.monotonic() - self._last_contact
                if silent > self.timeout_s:
                    raise self._fail(f"no answer for {silent:.0f} s ({type(exc).__name__}: {exc})") from None
                time.sleep(min(0.5, self.timeout_s / 10))

    def _options(self, timeout_s: float) -> flight.FlightCallOptions:
        """Call options: the timeout in seconds and the run's bearer token."""
        return flight.FlightCallOptions(timeout=timeout_s, headers=self._headers)

    def _action(self, name: str, body: dict | None = None, timeout_s: float = 30.0) -> dict:
        options = self._options(timeout_s)
        action = flight.Action(name, json.dumps(body or {}).encode())
        results = self._rpc(lambda: list(self._client.do_action(action, options=options)))
        return json.loads(results[0].body.to_pybytes().decode()) if results else {}

    def _check_heartbeat(self) -> None:
        beat = self._action(ACTION_HEARTBEAT, timeout_s=min(30.0, self.timeout_s))
        if beat.get("failure"):
            raise TransportError(f"rollout at {self.location}: the rollout loop failed:\n{beat['failure']}")
        # While the loop is being built (tokenizer, dataset) it cannot tick: allow STARTUP_TIMEOUT_S.
        limit = self.timeout_s if beat.get("running", True) else max(self.timeout_s, STARTUP_TIMEOUT_S)
        if beat["age_s"] > limit:
            raise self._fail(
                f"the rollout loop has not ticked for {beat['age_s']:.0f} s "
                f"(rollout.rollout_worker_timeout_s={self.timeout_s}); it is stalled"
            )

    # ----- API -------------------------------------------------------------------------------

    def pull(self, policy_version: int, *, min_samples: int = 1, timeout_s: float | None = None) -> PulledBatch:
        """Block until at least ``min_samples`` fresh samples (or the end of the stream, or ``timeout_s``).

        Args:
            policy_version: the trainer's current version; older samples beyond ``max_staleness`` are dropped.
            min_samples: samples to wait for (after the staleness drop).
            timeout_s: most seconds to wait; None = as long as the rollout is alive. On timeout
                whatever arrived is returned (possibly nothing).

        Returns:
            Whole groups only; ``consumed_prompt_indices`` lists prompts finished without a sample
            since the last pull (rejected, zero-std, or every sample stale).

        Raises:
            TransportError: the rollout failed, stalled, died or is unreachable (with its traceback).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        tables, consumed, dropped, kept, exhausted = [], [], 0, 0, False
        while True:
            self._check_heartbeat()
            wait_s = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            table, more_consumed, exhausted, behind = self._get(policy_version, min_samples - kept, wait_s)
            table, stale_consumed, num_dropped = self._drop_stale(table, policy_version)
            tables.append(table)
            consumed += more_consumed + stale_consumed
            dropped += num_dropped
            kept += table.num_rows
            if kept >= min_samples or exhausted or behind or (deadline is not None and time.monotonic() >= deadline):
                break
        self._dropped_since_metrics += dropped
        merged = pa.concat_tables(tables, promote_options="default").combine_chunks()
        batches = merged.to_batches()
        samples = batches[0] if len(batches) == 1 else pa.RecordBatch.from_pylist([], schema=merged.schema)
        return PulledBatch(
            samples=samples,
            consumed_prompt_indices=consumed,
            dropped_stale_count=dropped,
            exhausted=exhausted,
            servers_behind=behind,
        )

    def _get(self, policy_version: int, min_samples: int, wait_s: float) -> tuple[pa.Table, list[int], bool, list[str]]:
        request = {
            "policy_version": policy_version,
            "min_samples": max(min_samples, 1),
            "wait_s": wait_s,
            "consumer": self.consumer,
            "acks": list(self._unacked),
        }
        ticket = flight.Ticket(json.dumps(request).encode())
        options = self._options(wait_s + 60.0)
        table = self._rpc(lambda: self._client.do_get(ticket, options=options).read_all())
        meta = table.schema.metadata or {}
        self._acknowledge(int(meta.get(META_DELIVERY, b"0")))
        consumed = [p for p in json.loads(meta.get(META_CONSUMED, b"[]")) if p not in self._seen_consumed]
        self._seen_consumed.update(consumed)
        behind = json.loads(meta.get(META_SERVERS_BEHIND, b"[]"))
        table = self._drop_duplicates(table.replace_schema_metadata(None))
        return table, consumed, meta.get(META_EXHAUSTED) == b"1", behind

    def _acknowledge(self, delivery_id: int) -> None:
        """Tell the server this source holds ``delivery_id`` (and every earlier unconfirmed one)."""
        if delivery_id > 0:
            self._unacked.append(delivery_id)
        if self._unacked:
            self._action(ACTION_ACK, {"consumer": self.consumer, "delivery_ids": self._unacked})
            self._unacked = []

    def _drop_duplicates(self, table: pa.Table) -> pa.Table:
        """Drop samples received before (a group the server sent again); remember the rest."""
        if table.num_rows == 0:
            return table
        ids = table["sample_id"].to_pylist()
        fresh = [i not in self._seen_samples for i in ids]
        self._seen_samples.update(ids)
        if all(fresh):
            return table
        self.num_duplicate_samples += fresh.count(False)
        logger.info("dropped %d samples the rollout sent again", fresh.count(False))
        return table.filter(pa.array(fresh))

    def _drop_stale(self, table: pa.Table, policy_version: int) -> tuple[pa.Table, list[int], int]:
        """Drop samples more than ``max_staleness`` versions old; prompts left with no sample count as consumed."""
        if table.num_rows == 0:
            return table, [], 0
        # pyarrow.compute's functions are made at import: its stubs lack them
        fresh = pc.less_equal(  # pyright: ignore[reportAttributeAccessIssue]
            pc.subtract(  # pyright: ignore[reportAttributeAccessIssue]
                pa.scalar(policy_version, pa.int32()), table["policy_version"]
            ),
            pa.scalar(self.max_staleness, pa.int32()),
        )
        kept = table.filter(fresh)
        dropped = table.num_rows - kept.num_rows
        if not dropped:
            return table, [], 0
        before = set(table["prompt_index"].to_pylist())
        after = set(kept["prompt_index"].to_pylist())
        return kept, sorted(before - after), dropped

    def wait_running(self, timeout_s: float = 300.0) -> None:
        """Block until the rollout loop is built and generating (tokenizer and dataset loaded).

        Raises:
            TransportError: it failed or did not start within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            beat = self._action(ACTION_HEARTBEAT)
            if beat.get("failure"):
                raise TransportError(f"rollout at {self.location}: the rollout loop failed:\n{beat['failure']}")
            if beat.get("running", True):
                return
            time.sleep(0.1)
        raise self._fail(f"the rollout loop did not start within {timeout_s} s")

    def report(self, policy_version: int, tokens_consumed: int, held_tokens: int = 0) -> None:
        """Trainer feedback after a step: its policy version, the raw sample tokens it consumed and those it holds.

        ``tokens_consumed`` is ``batch/raw_tokens_per_step`` (sum of the samples' lengths, unpacked);
        ``held_tokens`` the raw tokens of the samples pulled but neither trained nor dropped
        (``Planner.held_tokens``): the rollout's token allowance counts them with its queue.
        """
        self._action(
            ACTION_REPORT,
            {"policy_version": policy_version, "tokens_consumed": tokens_consumed, "held_tokens": held_tokens},
        )

    def synced(self, policy_version: int) -> None:
        """The servers hold ``policy_version`` now (a resumed trainer's first sync): the rollout, which waits for this
        before sampling a full-weight run's resumed version, may start."""
        self._action(ACTION_SYNCED, {"policy_version": policy_version})

    def metrics(self) -> dict[str, float]:
        """The rollout metric window since the last call, plus ``sample/dropped_stale_count``."""
        out = {k: float(v) for k, v in self._action(ACTION_METRICS).items()}
        out["sample/dropped_stale_count"] = float(self._dropped_since_metrics)
        self._dropped_since_metrics = 0
        return out

    def completions(self) -> list[dict]:
        """The rollout's sampled completion rows since the last call (``tracking.log_completions``)."""
        rows = self._action(ACTION_COMPLETIONS)
        return rows if isinstance(rows, list) else []

    def close(self) -> None:
        """Ask the rollout process to stop, close the connection, and wait for the process if it is ours."""
        if self._closed:
            return
        self._closed = True
        try:
            self._client.do_action(flight.Action(ACTION_SHUTDOWN, b"{}"), options=self._options(5.0))
        except (flight.FlightError, OSError) as exc:
            logger.debug("shutdown action failed (process already gone?): %s", exc)
        self._client.close()
        if self.process is not None:
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                from grpo_core.run.children import stop_child

                logger.warning("rollout process %s did not stop in 30 s; stopping it", self.process.pid)
                stop_child(self.process, timeout_s=5)
                self.process.wait(timeout=10)

    def __enter__(self) -> FlightSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
