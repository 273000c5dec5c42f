"""Tracking of a run: MLflow (the run, params, metrics, checkpoints, resume state), metric windows, the end report.

The only package of grpo-flow that imports ``mlflow`` (STYLE.md, module boundaries). Its modules, by job:

* :mod:`~grpo_core.tracking.store`: the tracking URI and client (the embedded SQLite store made on first use), the
  run tags, whether a store error is passing;
* :mod:`~grpo_core.tracking.runs`: one MLflow run per training run, tagged with the Prefect flow run id
  (``grpo.flow_run_id``) so a retried flow run finds and continues it; ending it, and the runs orphans left;
* :mod:`~grpo_core.tracking.artifacts`: checkpoints (``checkpoints/step-NNNNNNN/``, ``resume/rollout_state.json``)
  and the exported model (``model/``, registered as a version of ``tracking.registered_model_name``);
* :mod:`~grpo_core.tracking.completions`: the completion tables (``completions/steps_NNNNNNN-MMMMMMM.json``);
* :mod:`~grpo_core.tracking.names`: metric names as MLflow accepts them;
* :mod:`~grpo_core.tracking.checks`: the MLflow checks of a run's preflight (the store, ``resume_from``);
* :mod:`~grpo_core.tracking.mlflow_sink`: :class:`MlflowSink`, the trainer's uploads from a background thread;
* :mod:`~grpo_core.tracking.metrics`: logging windows with the aggregation rules of DESIGN.md §7, the sink protocol
  and the JSON-lines sink (no MLflow);
* :mod:`~grpo_core.tracking.report`: the end-of-run summary and reward curve (``plots/reward_curve.png``), read from
  ``metrics.jsonl`` (no MLflow).
* :mod:`~grpo_core.tracking.ui`: ``grpo ui --mlflow``, the MLflow UI on a private Unix socket behind an
  authenticating proxy.

The MLflow API of the modules above is re-exported here (``from grpo_core.tracking import start_run``,
``tracking.MlflowSink``), loaded on first use: importing the package, or its metric windows in a rollout process or
a trainer rank, does not import ``mlflow`` (about 2 s).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo_core.tracking.artifacts import (
        CHECKPOINT_URI_FILE,
        download_latest_checkpoint,
        file_uri_path,
        log_checkpoint,
        log_file,
        log_model,
        register_model,
        uploaded_checkpoint_step,
    )
    from grpo_core.tracking.completions import (
        COMPLETION_TABLE_STEPS,
        LOGGED_ARTIFACTS_TAG,
        MAX_LISTED_TABLES,
        completion_table_path,
        completions_table,
        listed_tables,
    )
    from grpo_core.tracking.mlflow_sink import CLOSE_TIMEOUT_S, MlflowSink
    from grpo_core.tracking.names import MetricNames, mlflow_safe_name
    from grpo_core.tracking.runs import (
        download_resume_config,
        download_run_config,
        end_orphaned_runs,
        end_run,
        find_run,
        flatten,
        last_logged_step,
        run_url,
        start_run,
    )
    from grpo_core.tracking.store import (
        DEPLOYMENT_TAG,
        FLOW_RUN_TAG,
        LATEST_STEP_TAG,
        MODEL_ARTIFACT,
        MODEL_KIND_TAG,
        OWNER_TAG,
        RESUMED_FROM_TAG,
        SYSTEM_METRICS_PREFIX,
        client,
        experiment_id,
        mlflow_uri,
        store_unavailable,
    )

#: The module of this package that defines each re-exported name.
_HOMES = {
    "artifacts": (
        "CHECKPOINT_URI_FILE",
        "download_latest_checkpoint",
        "file_uri_path",
        "log_checkpoint",
        "log_file",
        "log_model",
        "register_model",
        "uploaded_checkpoint_step",
    ),
    "completions": (
        "COMPLETION_TABLE_STEPS",
        "LOGGED_ARTIFACTS_TAG",
        "MAX_LISTED_TABLES",
        "completion_table_path",
        "completions_table",
        "listed_tables",
    ),
    "mlflow_sink": ("CLOSE_TIMEOUT_S", "MlflowSink"),
    "names": ("MetricNames", "mlflow_safe_name"),
    "runs": (
        "download_resume_config",
        "download_run_config",
        "end_orphaned_runs",
        "end_run",
        "find_run",
        "flatten",
        "last_logged_step",
        "run_url",
        "start_run",
    ),
    "store": (
        "DEPLOYMENT_TAG",
        "FLOW_RUN_TAG",
        "LATEST_STEP_TAG",
        "MODEL_ARTIFACT",
        "MODEL_KIND_TAG",
        "OWNER_TAG",
        "RESUMED_FROM_TAG",
        "SYSTEM_METRICS_PREFIX",
        "client",
        "experiment_id",
        "mlflow_uri",
        "store_unavailable",
    ),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "CHECKPOINT_URI_FILE",
    "CLOSE_TIMEOUT_S",
    "COMPLETION_TABLE_STEPS",
    "DEPLOYMENT_TAG",
    "FLOW_RUN_TAG",
    "LATEST_STEP_TAG",
    "LOGGED_ARTIFACTS_TAG",
    "MAX_LISTED_TABLES",
    "MODEL_ARTIFACT",
    "MODEL_KIND_TAG",
    "OWNER_TAG",
    "RESUMED_FROM_TAG",
    "SYSTEM_METRICS_PREFIX",
    "MetricNames",
    "MlflowSink",
    "client",
    "completion_table_path",
    "completions_table",
    "download_latest_checkpoint",
    "download_resume_config",
    "download_run_config",
    "end_orphaned_runs",
    "end_run",
    "experiment_id",
    "file_uri_path",
    "find_run",
    "flatten",
    "last_logged_step",
    "listed_tables",
    "log_checkpoint",
    "log_file",
    "log_model",
    "mlflow_safe_name",
    "mlflow_uri",
    "register_model",
    "run_url",
    "start_run",
    "store_unavailable",
    "uploaded_checkpoint_step",
]


def __getattr__(name: str) -> Any:
    """A re-exported name of the MLflow API, imported from its module on first use (PEP 562).

    Raises:
        AttributeError: ``name`` is not one of :data:`__all__`.
    """
    home = _HOME_OF.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__() -> list[str]:
    """The package's names and the re-exported ones."""
    return sorted({*globals(), *__all__})
