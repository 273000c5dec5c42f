"""The trainer's MLflow sink: metrics, checkpoints and completion tables uploaded from a background thread.

:class:`MlflowSink` is a :class:`grpo_core.tracking.metrics.MetricsSink`: the training loop hands it a step's
metrics, a saved checkpoint or a window's completions and goes on; one thread uploads them in order, retrying while
the store is out of reach for now, so the loop never waits on MLflow. System metrics of the trainer (``system/*``:
CPU, memory, disk, network, and GPU when NVML sees one) are sampled by MLflow's ``SystemMetricsMonitor`` while the
sink is open.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from grpo_core.config import TrackingConfig
from grpo_core.tracking.artifacts import log_checkpoint
from grpo_core.tracking.completions import (
    LOGGED_ARTIFACTS_TAG,
    MAX_LISTED_TABLES,
    completion_table_path,
    completions_table,
    listed_tables,
)
from grpo_core.tracking.metrics import MetricsSink
from grpo_core.tracking.names import MetricNames
from grpo_core.tracking.runs import last_logged_step
from grpo_core.tracking.store import client, mlflow_uri, store_unavailable

if TYPE_CHECKING:
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

logger = logging.getLogger(__name__)

_MAX_BATCH = 1000  # MLflow's log_batch limit on metrics per call
#: Seconds :meth:`MlflowSink.close` waits for an upload to succeed again while the store fails (locked past its busy
#: timeout, unreachable) before it gives the rest up (a call in progress may add its own timeout, 20 s for SQLite).
CLOSE_TIMEOUT_S = 60.0
_RETRY_MAX_S = 10.0  # longest pause between two tries while the store fails


class MlflowSink:
    """Metrics sink logging to an MLflow run from a background thread (batched, off the hot path).

    Args:
        tc: tracking settings (URI, checkpoint size limit).
        run_id: the MLflow run to log into.
        inner: a sink fed synchronously as well (the JSON-lines file).
        trained: the records of the steps trained before this start (``{"step": N, ...metrics}``: the metrics
            file, cut back to the checkpoint the trainer resumes from).
        close_timeout_s: seconds :meth:`close` waits, while the store fails, for an upload to succeed again.

    Steps at or below the highest step already in the run are skipped: a resumed trainer
    replays the steps after its checkpoint, and MLflow keeps no duplicate steps. Steps of ``trained`` above it
    are logged first: a kill can stop the upload queue behind the checkpoint write, and the resumed trainer
    does not replay the steps up to its checkpoint, so they would be missing from MLflow for good.

    A store that cannot be written for now (:func:`store_unavailable`: locked past its busy timeout, unreachable) is
    retried with the same upload, so steps reach MLflow in order and the steps it holds stay a prefix of the metrics
    file; :meth:`close` waits for it at most ``close_timeout_s`` without a successful upload, then gives up what is
    left with one warning that names it (the metrics stay in the inner sink's file, from which the next start
    uploads the steps the run lacks).
    """

    def __init__(
        self,
        tc: TrackingConfig,
        run_id: str,
        inner: MetricsSink | None = None,
        trained: list[Mapping[str, Any]] = (),
        close_timeout_s: float = CLOSE_TIMEOUT_S,
    ):
        self.tc, self.run_id, self.inner = tc, run_id, inner
        self.close_timeout_s = close_timeout_s
        self.skip_through = last_logged_step(tc, run_id)
        if self.skip_through:
            logger.info(
                "MLflow run %s already has steps up to %d; replayed steps are not logged again",
                run_id,
                self.skip_through,
            )
        self.num_errors = 0
        self.names = MetricNames()
        self._refused: set[str] = set()
        self._queue: queue.Queue = queue.Queue()
        self._held_lock = threading.Lock()
        self._pending: dict[Path, int] = {}  # checkpoint folder → uploads queued or running
        self._uploaded: Path | None = None  # the last checkpoint uploaded completely
        self._table: tuple[str, list[dict[str, Any]]] | None = None  # (artifact path, rows) of the open table
        self._closing_at: float | None = None  # monotonic time close() was called
        self._last_success = time.monotonic()
        self._give_up = threading.Event()  # set: the store failed past close_timeout_s; what is left is not sent
        self._unavailable: BaseException | None = None  # the store's last "not now" error
        self._unsent: list[tuple[str, int]] = []  # (kind, step) of what was given up
        missing = [r for r in trained if r["step"] > self.skip_through]
        if missing:
            logger.info(
                "MLflow run %s lacks trained steps %d-%d (a killed attempt's upload): logging them from "
                "the metrics file",
                run_id,
                missing[0]["step"],
                missing[-1]["step"],
            )
        for record in missing:
            self._queue.put(("metrics", record["step"], {k: v for k, v in record.items() if k != "step"}))
        self._thread = threading.Thread(target=self._work, name="mlflow-sink", daemon=True)
        self._thread.start()
        self._monitor = self._start_system_metrics() if tc.log_system_metrics else None

    def _start_system_metrics(self) -> SystemMetricsMonitor:
        """MLflow's sampler of ``system/*`` metrics (steps continue those already in the run)."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        client(self.tc)
        monitor = SystemMetricsMonitor(
            self.run_id,
            sampling_interval=self.tc.system_metrics_interval_s,
            resume_logging=True,
            tracking_uri=mlflow_uri(self.tc),
        )
        monitor.start()
        return monitor

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Feed the inner sink and queue the step for MLflow."""
        if self.inner is not None:
            self.inner.log(step, metrics)
        if step > self.skip_through:
            self._queue.put(("metrics", step, dict(metrics)))

    def on_checkpoint(self, path: Path, step: int) -> None:
        """Queue a checkpoint folder for upload (called by the trainer after each save)."""
        with self._held_lock:
            self._pending[Path(path)] = self._pending.get(Path(path), 0) + 1
        self._queue.put(("checkpoint", step, Path(path)))

    def held_checkpoints(self) -> set[Path]:
        """Checkpoint folders that ``train.save_total_limit`` must not delete yet: those queued or being uploaded,
        and the last one uploaded (the tag ``grpo.latest_checkpoint_step`` names it; a checkpoint logged as its
        URI only is read from that folder)."""
        with self._held_lock:
            return set(self._pending) | ({self._uploaded} if self._uploaded is not None else set())

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Queue one logging window's completion sample for its table (:func:`completion_table_path`)."""
        if rows and step > self.skip_through:
            self._queue.put(("completions", step, rows))

    def close(self) -> None:
        """Stop the system metrics sampler, wait for queued uploads, then close the inner sink.

        Bounded: while the store fails, at most ``close_timeout_s`` after the last successful upload (or the call),
        plus one call's own timeout; what is left then is given up with one warning (:meth:`_report_unsent`).
        """
        if self._monitor is not None:
            self._monitor.finish()
        self._closing_at = time.monotonic()
        self._queue.put(None)
        while self._thread.is_alive():
            self._thread.join(timeout=1.0)
            if self._thread.is_alive() and self._stalled_s() > self.close_timeout_s:
                self._give_up.set()
                if self._stalled_s() > self.close_timeout_s + 3 * _RETRY_MAX_S + 30.0:  # a call that never returns
                    self._unsent.append(("uploads still queued", -1))
                    break
        self._report_unsent()
        if self.inner is not None:
            self.inner.close()

    def _stalled_s(self) -> float:
        """Seconds since the last successful upload or the close() call, whichever is later."""
        return time.monotonic() - max(self._last_success, self._closing_at or 0.0)

    def _report_unsent(self) -> None:
        """One warning naming what was not uploaded, why, and where the metrics are kept."""
        if not self._unsent:
            return
        steps = sorted(step for kind, step in self._unsent if kind == "metrics")
        others = sorted({f"{kind} of step {step}" for kind, step in self._unsent if kind != "metrics" and step >= 0})
        kept = getattr(self.inner, "path", None)
        what = [f"the metrics of {len(steps)} steps ({steps[0]}-{steps[-1]})"] if steps else []
        what += others
        if any(step < 0 for _, step in self._unsent):
            what.append("whatever was still queued behind a call that did not return")
        reason = str(self._unavailable).splitlines()[0] if self._unavailable is not None else "no answer"
        where = (
            f"the metrics are kept in {kept}; a retried or resumed run uploads the steps the MLflow run lacks from it"
            if kept is not None
            else "they are not kept elsewhere"
        )
        logger.warning(
            "MLflow store %s could not be written for %.0f s (%s): %s not uploaded to run %s; %s",
            mlflow_uri(self.tc),
            self.close_timeout_s,
            reason,
            ", ".join(what),
            self.run_id,
            where,
        )

    def _work(self) -> None:
        mc = client(self.tc)
        while (item := self._queue.get()) is not None:
            kind, step, payload = item
            try:
                self._upload(mc, kind, step, payload)
            finally:
                if kind == "checkpoint":
                    with self._held_lock:
                        self._pending[payload] -= 1
                        if not self._pending[payload]:
                            del self._pending[payload]

    def _upload(self, mc: MlflowClient, kind: str, step: int, payload: Any) -> None:
        """One queued upload, tried again while the store is unavailable until it works or the sink gives up."""
        pause = 0.5
        while not self._give_up.is_set():
            try:
                if kind == "metrics":
                    self._log_metrics(mc, step, payload)
                elif kind == "completions":
                    self._log_completions(mc, step, payload)
                else:
                    log_checkpoint(self.tc, self.run_id, payload)
                    self._uploaded = payload
                self._last_success = time.monotonic()
                return
            except Exception as exc:  # noqa: BLE001 - tracking must not stop training; counted and logged
                if not store_unavailable(exc):
                    self.num_errors += 1
                    logger.warning("MLflow %s upload of step %d failed: %s", kind, step, exc)
                    return
                if self._unavailable is None:
                    logger.info("MLflow store unavailable (%s); retrying", str(exc).splitlines()[0])
                self._unavailable = exc
                if self._closing_at is not None and self._stalled_s() > self.close_timeout_s:
                    self._give_up.set()
                else:
                    self._give_up.wait(pause)
                    pause = min(2 * pause, _RETRY_MAX_S)
        self.num_errors += 1
        self._unsent.append((kind, step))

    def _log_completions(self, mc: MlflowClient, step: int, rows: list[dict[str, Any]]) -> None:
        """Add one window's rows (with their ``step``) to its step range's table, write the table again, list it."""
        import tempfile

        path = completion_table_path(step)
        if self._table is None or self._table[0] != path:  # a new table, or one a killed attempt began
            self._table = (path, [r for r in self._logged_rows(mc, path) if r.get("step", 0) <= self.skip_through])
        self._table[1].extend({"step": step, **row} for row in rows)
        table = completions_table(self._table[1], self.tc.completion_max_chars)
        body = {"columns": list(table), "data": [list(r) for r in zip(*table.values(), strict=True)]}
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / Path(path).name
            local.write_text(json.dumps(body, ensure_ascii=False))
            mc.log_artifact(self.run_id, str(local), str(Path(path).parent))
        tags = mc.get_run(self.run_id).data.tags
        value = listed_tables(tags.get(LOGGED_ARTIFACTS_TAG), path, MAX_LISTED_TABLES)
        if value != tags.get(LOGGED_ARTIFACTS_TAG):
            mc.set_tag(self.run_id, LOGGED_ARTIFACTS_TAG, value)

    def _logged_rows(self, mc: MlflowClient, path: str) -> list[dict[str, Any]]:
        """The rows of table ``path`` already in the run (an earlier attempt's), or none."""
        import tempfile

        if path not in {a.path for a in mc.list_artifacts(self.run_id, str(Path(path).parent))}:
            return []
        with tempfile.TemporaryDirectory() as tmp:
            body = json.loads(Path(mc.download_artifacts(self.run_id, path, tmp)).read_text())
        return [dict(zip(body["columns"], row, strict=True)) for row in body["data"]]

    def _log_metrics(self, mc: MlflowClient, step: int, payload: Mapping[str, float]) -> None:
        """Log one step's finite metrics under MLflow-safe names, in batches.

        A batch MLflow refuses (a name or value it rejects) is retried one metric at a time, so only
        the refused metrics are lost; each refused name is warned about once.
        """
        now = int(time.time() * 1000)
        ms = [Metric(self.names(k), float(v), now, step) for k, v in payload.items() if math.isfinite(float(v))]
        for i in range(0, len(ms), _MAX_BATCH):
            try:
                mc.log_batch(self.run_id, metrics=ms[i : i + _MAX_BATCH])
            except MlflowException as exc:
                if store_unavailable(exc):
                    raise
                for metric in ms[i : i + _MAX_BATCH]:
                    try:
                        mc.log_batch(self.run_id, metrics=[metric])
                    except MlflowException as exc:
                        if store_unavailable(exc):
                            raise
                        self.num_errors += 1
                        if metric.key not in self._refused:
                            self._refused.add(metric.key)
                            logger.warning(
                                "MLflow refuses metric %r (%s); it is not logged, the others are",
                                metric.key,
                                str(exc).splitlines()[0],
                            )
