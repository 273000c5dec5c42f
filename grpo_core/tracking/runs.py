"""The MLflow run of a training run: open or continue it, end it (and the runs orphans left), read it back.

One MLflow run per training run, tagged with the Prefect flow run id (``grpo.flow_run_id``) so a retried flow run
finds and continues it; its params are the flattened config and ``config/run_config.json`` the resolved config.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Param
from mlflow.exceptions import MlflowException

from grpo_core.config import RunConfig, TrackingConfig
from grpo_core.tracking.store import (
    DEPLOYMENT_TAG,
    FLOW_RUN_TAG,
    OWNER_TAG,
    RESUMED_FROM_TAG,
    SYSTEM_METRICS_PREFIX,
    client,
    experiment_id,
)

logger = logging.getLogger(__name__)

#: The MLflow artifact holding a run's resolved config (``grpo resume`` reads it back).
RUN_CONFIG_ARTIFACT = "config/run_config.json"

_PARAM_MAX_CHARS = 6000


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config dict -> ``{"train.learning_rate": "1e-06", ...}`` (values as strings, clipped to 6000 chars)."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = (json.dumps(value) if isinstance(value, (list, dict)) else str(value))[:_PARAM_MAX_CHARS]
    return out


def find_run(tc: TrackingConfig, flow_run_id: str) -> str | None:
    """The MLflow run tagged with this Prefect flow run id, or None."""
    mc = client(tc)
    runs = mc.search_runs(
        [experiment_id(tc, mc)], filter_string=f"tags.`{FLOW_RUN_TAG}` = '{flow_run_id}'", max_results=1
    )
    return runs[0].info.run_id if runs else None


def start_run(
    cfg: RunConfig, flow_run_id: str | None, deployment: str | None = None, run_name: str | None = None
) -> tuple[str, bool]:
    """Find the run of this flow run (a retry) or create one with tags, params and the config artifact.

    Args:
        cfg: the resolved run config.
        flow_run_id: Prefect flow run id (None outside Prefect: always a new run).
        deployment: ``flow/deployment`` name, tagged when set.
        run_name: MLflow run name of a new run.

    Returns:
        ``(run_id, continued)``; ``continued`` is True when an existing run was found and reopened.
    """
    from grpo_core.run.lifeline import process_tag

    tc, mc = cfg.tracking, client(cfg.tracking)
    end_orphaned_runs(tc)
    existing = find_run(tc, flow_run_id) if flow_run_id else None
    if existing is not None:  # the owner first: a run RUNNING under its dead owner would look orphaned
        mc.set_tag(existing, OWNER_TAG, process_tag())
        mc.update_run(existing, status="RUNNING")
        logger.info("continuing MLflow run %s of flow run %s", existing, flow_run_id)
        return existing, True
    tags = {
        OWNER_TAG: process_tag(),
        FLOW_RUN_TAG: flow_run_id or "",
        DEPLOYMENT_TAG: deployment or "",
        RESUMED_FROM_TAG: cfg.resume_from or "",
        "mlflow.runName": run_name or "",
    }
    run = mc.create_run(experiment_id(tc, mc), tags={k: v for k, v in tags.items() if v}, run_name=run_name)
    run_id = run.info.run_id
    params = [Param(k, v) for k, v in flatten(cfg.model_dump(mode="json")).items()]  # secrets as **********
    for i in range(0, len(params), 100):
        mc.log_batch(run_id, params=params[i : i + 100])
    mc.log_text(run_id, cfg.model_dump_json(indent=1), RUN_CONFIG_ARTIFACT)
    logger.info("MLflow run %s created in experiment %r (%s)", run_id, tc.experiment_name, tc.shown_tracking_uri())
    return run_id, False


def end_orphaned_runs(tc: TrackingConfig) -> list[str]:
    """End as ``KILLED`` the runs of the store left ``RUNNING`` by a process that is gone (a SIGKILLed
    ``grpo train``, an OOM kill, a reboot): the runs whose owner (tag ``grpo.owner``, set by
    :func:`start_run`) ran on this machine, in this PID namespace, and has ended
    (:func:`grpo_core.run.lifeline.process_gone` is True). Runs of other hosts, machines or containers, of a live
    owner (another user's process whose ``/proc`` entry is hidden counts as live), or without the tag (made by other
    tools) are left as they are; a run the store refuses to end (another user's, on a server with authentication) is
    logged and skipped.

    Returns:
        The ids of the runs ended.
    """
    from grpo_core.run.lifeline import process_gone

    mc = client(tc)
    experiments = [e.experiment_id for e in mc.search_experiments()]
    if not experiments:
        return []
    ended = []
    for run in mc.search_runs(experiments, "attributes.status = 'RUNNING'", max_results=1000):
        tag = run.data.tags.get(OWNER_TAG)
        if tag is None or process_gone(tag) is not True:
            continue
        try:
            mc.set_terminated(run.info.run_id, status="KILLED")
        except MlflowException as exc:
            logger.warning("MLflow run %s looks orphaned (%s) but could not be ended: %s", run.info.run_id, tag, exc)
            continue
        ended.append(run.info.run_id)
        logger.warning(
            "MLflow run %s was left RUNNING by a process that is gone (%s): ended as KILLED", run.info.run_id, tag
        )
    return ended


def end_run(tc: TrackingConfig, run_id: str, status: str = "FINISHED") -> None:
    """Mark the run ``FINISHED``, ``FAILED`` or ``KILLED``."""
    client(tc).set_terminated(run_id, status=status)


def last_logged_step(tc: TrackingConfig, run_id: str) -> int:
    """Highest optimizer step of any training metric already logged to the run (0 if none); a resumed trainer
    skips steps up to it.

    Read from the run's latest value of each metric (MLflow keeps the one with the highest step), so a
    metric missing from the last steps (refused, or not logged every step) cannot make it too low. MLflow's
    ``system/*`` metrics are left out: their steps count the sampler's samples, which every attempt continues
    (``resume_logging``), so they run ahead of the optimizer steps and would skip steps never logged.
    """
    latest = client(tc).get_run(run_id).data.to_proto().metrics
    return max((int(m.step) for m in latest if not m.key.startswith(SYSTEM_METRICS_PREFIX)), default=0)


def run_url(tc: TrackingConfig, run_id: str) -> str:
    """The run's page in the MLflow UI (``tc.resolved_ui_url()``)."""
    experiment = client(tc).get_run(run_id).info.experiment_id
    return f"{tc.resolved_ui_url()}/#/experiments/{experiment}/runs/{run_id}"


def download_run_config(tc: TrackingConfig, run_id: str) -> Path:
    """Download ``config/run_config.json`` of MLflow run ``run_id`` into a new temporary folder; returns its path.

    Raises:
        ConfigError: the run or its config cannot be read from the store (names the id, the store and the fix).
    """
    import tempfile

    from grpo_core.errors import ConfigError

    try:
        return Path(client(tc).download_artifacts(run_id, RUN_CONFIG_ARTIFACT, tempfile.mkdtemp()))
    except (MlflowException, OSError) as exc:
        raise ConfigError(
            f"run {run_id!r}: its config ({RUN_CONFIG_ARTIFACT}) cannot be read from the MLflow store "
            f"{tc.shown_tracking_uri()} ({type(exc).__name__}); check the id (grpo ui --mlflow lists the "
            "runs) or the tracking settings (--set tracking.dir=... / tracking.tracking_uri=...)"
        ) from None


def download_resume_config(tc: TrackingConfig, run_id: str) -> Path:
    """The config of MLflow run ``run_id`` as a new run resuming from it takes it (``grpo resume RUN_ID`` without
    ``--config``): downloaded
    (:func:`download_run_config`), with what belonged to that run alone cleared (``tracking.run_id``,
    ``resume_from``, ``train.rollout_location``), the run folder's parent as ``train.output_dir`` and the servers'
    default log folder.

    Returns:
        The rewritten JSON file, in a new temporary folder.

    Raises:
        ConfigError: the run or its config cannot be read from the store.
    """
    path = download_run_config(tc, run_id)
    data = json.loads(path.read_text())
    data["tracking"]["run_id"] = None
    data["resume_from"] = None
    for key in ("rollout_location",):
        data["train"][key] = None
    data["train"]["output_dir"] = str(Path(data["train"]["output_dir"]).parent)
    data["server"]["log_dir"] = "runs/servers"
    path.write_text(json.dumps(data))
    return path
