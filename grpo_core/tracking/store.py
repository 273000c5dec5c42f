"""The MLflow store of a run: its URI and client, the run tags grpo-flow sets, and whether a failure is passing.

The embedded SQLite store (``tracking.dir``) is created, migrated and made private on first use
(:func:`client`); the other modules of ``grpo_core.tracking`` open their clients through it.
"""

from __future__ import annotations

import os

import mlflow
from mlflow.tracking import MlflowClient

from grpo_core.config import TrackingConfig

FLOW_RUN_TAG = "grpo.flow_run_id"
DEPLOYMENT_TAG = "grpo.deployment"
RESUMED_FROM_TAG = "grpo.resumed_from"
LATEST_STEP_TAG = "grpo.latest_checkpoint_step"
MODEL_KIND_TAG = "grpo.model_kind"
#: The process that opened (or continued) the run and ends it (:func:`grpo_core.run.lifeline.process_tag`).
OWNER_TAG = "grpo.owner"
MODEL_ARTIFACT = "model"


def store_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the store is out of reach for now rather than that it refused the request.

    A SQLite store locked by another writer past its busy timeout (``database is locked``), a file it cannot open,
    a connection error or timeout, or an HTTP store's 429/5xx (``TEMPORARILY_UNAVAILABLE``, ``INTERNAL_ERROR``,
    ``REQUEST_LIMIT_EXCEEDED``) are; a refused name or value (``INVALID_PARAMETER_VALUE``) is not.
    """
    text = str(exc).lower()
    if "database is locked" in text or "unable to open database" in text or "database is busy" in text:
        return True
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    code = getattr(exc, "error_code", "")
    if code in ("TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "INTERNAL_ERROR"):
        return "invalid" not in text
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and store_unavailable(cause)


#: Prefix of MLflow's system-metrics sampler (``SystemMetricsMonitor``): its steps count samples, not optimizer steps.
SYSTEM_METRICS_PREFIX = "system/"

_READY_STORES: set[str] = set()


def mlflow_uri(tc: TrackingConfig) -> str:
    """The tracking URI as MLflow gets it: an http(s) URI's credentials (``https://user:password@host``) move to
    ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD`` of this process (and its children), so that
    nothing MLflow prints or logs (its "View run at" line) holds them; other URIs as they are."""
    from urllib.parse import urlsplit, urlunsplit

    uri = tc.resolved_tracking_uri()
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or (parts.username is None and parts.password is None):
        return uri
    from urllib.parse import unquote

    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(parts.username or "")
    os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(parts.password or "")
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def client(tc: TrackingConfig) -> MlflowClient:
    """An MLflow client on the configured tracking URI (credentials by environment, :func:`mlflow_uri`).

    The embedded SQLite store is created (or migrated) on first use under a file lock beside it:
    two runs starting at once on a fresh store (the nightly run and a UI run) would otherwise both
    run MLflow's schema migrations and one would fail.
    """
    uri = mlflow_uri(tc)
    # Process-wide too: MLflow's internal clients (artifact repositories) otherwise open ./mlflow.db.
    mlflow.set_tracking_uri(uri)
    if tc.tracking_uri is not None or uri in _READY_STORES:
        return MlflowClient(tracking_uri=uri)
    from filelock import FileLock

    from grpo_core.run.stores import PRIVATE_FILE_MODE, make_private_dir

    make_private_dir(tc.dir)  # the store holds checkpoints, configs and logs: its owner's only
    with FileLock(str(tc.dir / "mlflow.db.lock")):
        mc = MlflowClient(tracking_uri=uri)
        mc.search_experiments(max_results=1)  # opens the tracking store: creates and migrates its tables
        mc.search_registered_models(max_results=1)  # and the model registry's store on the same database
        (tc.dir / "mlflow.db").chmod(PRIVATE_FILE_MODE)
        _READY_STORES.add(uri)
    return mc


def experiment_id(tc: TrackingConfig, mc: MlflowClient) -> str:
    """Id of ``tc.experiment_name``, created (with the artifact location) when missing."""
    exp = mc.get_experiment_by_name(tc.experiment_name)
    if exp is not None:
        return exp.experiment_id
    return mc.create_experiment(tc.experiment_name, artifact_location=tc.resolved_artifact_location())
