"""An MLflow store locked past its busy timeout (issue 26, item 13).

Before: each queued step's batch failed after SQLite's busy timeout (20 s, MLflow's ``PRAGMA busy_timeout``), then
every metric of it again one at a time, each warned as "MLflow refuses metric" (it refused nothing), and the steps
were dropped; ``close()`` waited for all of that, which for a real window of metrics never ended in practice. Now
the sink retries the same upload while the store is unavailable, ``close()`` gives up after ``close_timeout_s``
without a successful upload with one warning that says what was not uploaded and where it is kept, and a later
start uploads those steps from the metrics file.

The store is held by another SQLite connection (``BEGIN EXCLUSIVE``), as a second writer would hold it.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path

from grpo_core import tracking
from grpo_core.config import RunConfig
from grpo_core.tracking.metrics import JsonlSink


def _cfg(store: Path) -> RunConfig:
    return RunConfig(
        tracking={"dir": store, "experiment_name": "t", "log_system_metrics": False},
        rollout={"dataset": "reasoning_gym:basic_arithmetic", "dataset_size": 4},
    )


def _wait_for_step(cfg: RunConfig, run_id: str, step: int, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while tracking.last_logged_step(cfg.tracking, run_id) < step:
        assert time.monotonic() < deadline, f"step {step} never reached MLflow"
        time.sleep(0.1)


def test_a_locked_store_keeps_the_steps_and_close_returns(tmp_path, caplog):
    cfg = _cfg(tmp_path / "mlflow")
    run_id, _ = tracking.start_run(cfg, "flow-locked")
    metrics_file = tmp_path / "run" / "metrics.jsonl"
    metrics_file.parent.mkdir()
    sink = tracking.MlflowSink(cfg.tracking, run_id, inner=JsonlSink(metrics_file), close_timeout_s=1.0)
    window = {f"m{i}": float(i) for i in range(20)}  # a window of 20 metrics: 21 tries of 20 s each before
    sink.log(1, {**window, "reward": 0.5})
    _wait_for_step(cfg, run_id, 1)  # the store works: step 1 is in

    locker = sqlite3.connect(cfg.tracking.dir / "mlflow.db", isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")  # another writer holds the store
    try:
        for step in (2, 3, 4):
            sink.log(step, {**window, "reward": step / 10})
        closer = threading.Thread(target=sink.close, daemon=True)
        with caplog.at_level(logging.INFO, logger="grpo_core.tracking"):
            closer.start()
            closer.join(timeout=300)  # liveness bound only: it returns after one busy timeout (20 s) and 1 s
            assert not closer.is_alive(), "close() did not return while the store was locked"
    finally:
        locker.rollback()
        locker.close()

    # one warning of ours (MLflow's store logs its own SQLAlchemy error lines)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("grpo")]
    assert len(warnings) == 1, warnings
    assert "database is locked" in warnings[0] and "the metrics of 3 steps (2-4)" in warnings[0]
    assert str(metrics_file) in warnings[0] and "refuses" not in warnings[0]
    assert tracking.last_logged_step(cfg.tracking, run_id) == 1  # set-up check: the lock kept steps 2-4 out
    assert [r["step"] for r in JsonlSink.read(metrics_file)] == [1, 2, 3, 4]  # ...and the file has them

    # The next start (a retry or resume) uploads what the run lacks from the metrics file.
    again = tracking.MlflowSink(cfg.tracking, run_id, trained=JsonlSink.read(metrics_file))
    again.close()
    history = tracking.client(cfg.tracking).get_metric_history(run_id, "reward")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.2), (3, 0.3), (4, 0.4)]


def test_store_unavailable_tells_a_lock_from_a_refusal():
    from mlflow.exceptions import MlflowException

    locked = MlflowException("(sqlite3.OperationalError) database is locked", error_code="INTERNAL_ERROR")
    refused = MlflowException("Invalid metric name: 'a//b'", error_code="INVALID_PARAMETER_VALUE")
    assert tracking.store_unavailable(locked) and not tracking.store_unavailable(refused)
    assert tracking.store_unavailable(ConnectionError("connection refused"))
    try:
        try:
            raise sqlite3.OperationalError("database is locked")
        except sqlite3.OperationalError as cause:
            raise MlflowException("could not log batch") from cause
    except MlflowException as wrapped:
        assert tracking.store_unavailable(wrapped)
