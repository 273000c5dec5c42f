"""MLflow tracking of a run: the run itself, params, metrics, checkpoints and resume state.

The only module of grpo-flow that imports ``mlflow`` (STYLE.md, module boundaries). One MLflow
run per training run, tagged with the Prefect flow run id (``grpo.flow_run_id``) so a retried
flow run finds and continues it. Artifacts of a run:

* ``config/run_config.json``: the resolved run config;
* ``checkpoints/step-NNNNNNN/``: each checkpoint folder when it is at most
  ``tracking.checkpoint_artifact_max_mib``, else only its ``rollout_state.json`` and a
  ``checkpoint_uri.txt`` naming where the folder lies;
* ``resume/rollout_state.json``: the latest resume state;
* ``completions/steps_NNNNNNN-MMMMMMM.json`` (with ``tracking.log_completions``): one table (MLflow's table
  format, as ``mlflow.log_table`` writes it: step, prompt, completion, reward, advantage, ...) per
  :data:`COMPLETION_TABLE_STEPS` steps, rewritten with each logging window of its steps; the newest
  :data:`MAX_LISTED_TABLES` are listed in the run's ``mlflow.loggedArtifacts`` tag (the UI's table view,
  ``MlflowClient.load_table``), older ones stay in the artifacts as JSON;
* ``plots/reward_curve.png`` and ``model/`` at the end: the exported Hugging Face folder
  (``from_pretrained`` on the downloaded folder loads it), registered as a new version of
  ``tracking.registered_model_name`` with the alias ``tracking.registered_model_alias``.

System metrics of the trainer (``system/*``: CPU, memory, disk, network, and GPU when NVML sees
one) are sampled by MLflow's ``SystemMetricsMonitor`` while the sink is open.

The trainer logs through :class:`MlflowSink` (a ``grpo_core.metrics.MetricsSink``): metrics and
checkpoint uploads go to a background thread, so the training loop never waits on MLflow.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from grpo_core.config import RunConfig, TrackingConfig
from grpo_core.metrics import MetricsSink
from grpo_core.run.layout import (
    CHECKPOINT_DCP,
    CHECKPOINT_DOWNLOAD,
    CHECKPOINT_STATE,
    CHECKPOINTS_DIR,
    checkpoint_dir,
    checkpoint_step,
)
from grpo_core.run.layout import CHECKPOINT_URI as CHECKPOINT_URI_FILE

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor


logger = logging.getLogger(__name__)

FLOW_RUN_TAG = "grpo.flow_run_id"
DEPLOYMENT_TAG = "grpo.deployment"
RESUMED_FROM_TAG = "grpo.resumed_from"
LATEST_STEP_TAG = "grpo.latest_checkpoint_step"
MODEL_KIND_TAG = "grpo.model_kind"
#: The process that opened (or continued) the run and ends it (:func:`grpo_core.run.lifeline.process_tag`).
OWNER_TAG = "grpo.owner"
MODEL_ARTIFACT = "model"
_MAX_BATCH = 1000  # MLflow's log_batch limit on metrics per call
#: Seconds :meth:`MlflowSink.close` waits for an upload to succeed again while the store fails (locked past its busy
#: timeout, unreachable) before it gives the rest up (a call in progress may add its own timeout, 20 s for SQLite).
CLOSE_TIMEOUT_S = 60.0
_RETRY_MAX_S = 10.0  # longest pause between two tries while the store fails


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
_PARAM_MAX_CHARS = 6000


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

    from grpo_core.preflight import PRIVATE_FILE_MODE, make_private_dir

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
    mc.log_text(run_id, cfg.model_dump_json(indent=1), "config/run_config.json")
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


# What MLflow accepts in a metric name (mlflow.utils.validation): letters, digits, "_", "-", ".", " ", "/"
# (":" too, except on Windows servers: replaced here as well), no empty, "." or ".." path segment, no leading
# or trailing "/", at most 250 characters.
_UNSAFE_CHARS = re.compile(r"[^\w.\- /]")
_MAX_METRIC_NAME = 250


def mlflow_safe_name(name: str) -> str:
    """``name`` as MLflow accepts it: unsafe characters become ``_``, bad path segments are dropped or replaced.

    ``rewards/<lambda>/mean`` -> ``rewards/_lambda_/mean``; ``a//b/`` -> ``a/b``; ``x/../y`` -> ``x/_/y``.
    A name MLflow accepts is returned unchanged.
    """
    safe = _UNSAFE_CHARS.sub("_", name)
    segments = ["_" if part in (".", "..") else part for part in safe.split("/") if part]
    return ("/".join(segments) or "_")[:_MAX_METRIC_NAME]


class MetricNames:
    """The one place metric names become MLflow names: :func:`mlflow_safe_name`, kept distinct, warned once.

    Two names that map to the same safe name get suffixes ``_2``, ``_3`` … in the order they are first seen.
    """

    def __init__(self) -> None:
        self._safe: dict[str, str] = {}
        self._taken: set[str] = set()

    def __call__(self, name: str) -> str:
        """The MLflow name of ``name`` (warns the first time a name is renamed)."""
        if name in self._safe:
            return self._safe[name]
        safe = base = mlflow_safe_name(name)
        number = 1
        while safe in self._taken:
            number += 1
            safe = f"{base[: _MAX_METRIC_NAME - len(str(number)) - 1]}_{number}"
        self._safe[name] = safe
        self._taken.add(safe)
        if safe != name:
            logger.warning("metric %r is logged to MLflow as %r (MLflow refuses the name as it is)", name, safe)
        return safe


def _dir_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def file_uri_path(uri: str) -> Path:
    """The local path of a ``file:`` URI as :meth:`Path.as_uri` writes it (``file:///a%20b/c%25d`` ->
    ``/a b/c%d``: percent-decoded, RFC 8089); a bare path is taken as it is."""
    from urllib.parse import unquote, urlsplit

    if not uri.startswith("file:"):
        return Path(uri)
    parts = urlsplit(uri)
    return Path(unquote(parts.path))


def log_checkpoint(tc: TrackingConfig, run_id: str, path: Path) -> None:
    """Log a checkpoint folder (or, when large, its URI) and its ``rollout_state.json`` as artifacts."""
    mc, path = client(tc), Path(path)
    dest = f"{CHECKPOINTS_DIR}/{path.name}"
    if _dir_mib(path) <= tc.checkpoint_artifact_max_mib:
        mc.log_artifacts(run_id, str(path), dest)
    else:
        mc.log_artifact(run_id, str(path / CHECKPOINT_STATE), dest)
        mc.log_text(run_id, path.resolve().as_uri(), f"{dest}/{CHECKPOINT_URI_FILE}")
    mc.log_artifact(run_id, str(path / CHECKPOINT_STATE), "resume")
    mc.set_tag(run_id, LATEST_STEP_TAG, str(checkpoint_step(path.name)))


def download_latest_checkpoint(
    tc: TrackingConfig, run_id: str, output_dir: Path, verify: Callable[[Path], str | None] | None = None
) -> Path | None:
    """Bring the run's latest completely uploaded checkpoint into ``<output_dir>/checkpoints/``.

    The checkpoint is the one named by the tag ``grpo.latest_checkpoint_step``, which :func:`log_checkpoint`
    sets only after the whole folder (or its URI) is uploaded; a newer, partly uploaded folder is ignored.
    A checkpoint folder is downloaded, or copied from the URI in its ``checkpoint_uri.txt``, then checked with
    ``verify`` (returns why a folder is unusable, or None; ``grpo_core.train.checkpoint.verify``) before it is
    renamed into place.

    Returns:
        The local checkpoint folder, or None when the run has no completely uploaded checkpoint.

    Raises:
        CheckpointError: the tagged checkpoint cannot be fetched (artifact missing, URI not reachable from this
            host, download failed, or incomplete after it); the message names the run, the checkpoint and why.
    """
    from grpo_core.errors import CheckpointError

    mc = client(tc)
    tag = mc.get_run(run_id).data.tags.get(LATEST_STEP_TAG)
    if tag is None:
        partial = [a.path for a in mc.list_artifacts(run_id, CHECKPOINTS_DIR)]
        if partial:
            logger.warning(
                "MLflow run %s has checkpoint folders %s but none was completely uploaded (no tag %s)",
                run_id,
                partial,
                LATEST_STEP_TAG,
            )
        return None
    local = checkpoint_dir(output_dir, int(tag))
    name = local.name

    def fail(why: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {name} of MLflow run {run_id} (tracking URI {tc.resolved_tracking_uri()})"
            f" cannot be fetched: {why}"
        )

    try:
        files = {a.path.split("/")[-1] for a in mc.list_artifacts(run_id, f"{CHECKPOINTS_DIR}/{name}")}
        local.parent.mkdir(parents=True, exist_ok=True)
        download = local.parent / CHECKPOINT_DOWNLOAD
        shutil.rmtree(download, ignore_errors=True)
        if CHECKPOINT_DCP in files:
            tmp = Path(mc.download_artifacts(run_id, f"{CHECKPOINTS_DIR}/{name}", str(download)))
        elif CHECKPOINT_URI_FILE in files:
            uri = mc.download_artifacts(run_id, f"{CHECKPOINTS_DIR}/{name}/{CHECKPOINT_URI_FILE}", str(download))
            source = file_uri_path(Path(uri).read_text().strip())
            if not (source / CHECKPOINT_STATE).is_file():
                raise fail(f"it lies at {source} (checkpoint_uri.txt), which is not reachable from this host")
            tmp = download / name
            shutil.copytree(source, tmp)
        else:
            raise fail(
                f"the artifact folder checkpoints/{name} holds neither dcp/ nor {CHECKPOINT_URI_FILE} "
                f"(it holds {sorted(files)})"
            )
    except MlflowException as exc:
        raise fail(f"MLflow: {str(exc).splitlines()[0]}") from exc
    except OSError as exc:
        raise fail(f"{type(exc).__name__}: {exc}") from exc
    from grpo_core.run.durable import fsync_dir, fsync_tree

    problem = verify(tmp) if verify is not None else None
    if problem is not None:
        raise fail(f"the fetched copy is incomplete ({problem})")
    fsync_tree(tmp)
    shutil.rmtree(local, ignore_errors=True)
    tmp.rename(local)
    fsync_dir(local.parent)
    shutil.rmtree(download, ignore_errors=True)
    logger.info("fetched checkpoint %s of MLflow run %s to %s", name, run_id, local)
    return local


def log_file(tc: TrackingConfig, run_id: str, path: Path, artifact_dir: str) -> None:
    """Log one file as an artifact under ``artifact_dir``."""
    client(tc).log_artifact(run_id, str(path), artifact_dir)


def log_model(tc: TrackingConfig, run_id: str, model_dir: Path, adapter: bool = False) -> str:
    """Log the exported Hugging Face folder as the run's ``model/`` artifact.

    ``transformers.AutoModelForCausalLM.from_pretrained`` (or, for a LoRA adapter,
    ``peft.AutoPeftModelForCausalLM.from_pretrained``) on the downloaded folder loads it; the tag
    ``grpo.model_kind`` says which (``full`` or ``lora_adapter``).

    Returns:
        The artifact URI of the folder (the source of a registered model version).
    """
    mc = client(tc)
    mc.log_artifacts(run_id, str(model_dir), MODEL_ARTIFACT)
    mc.set_tag(run_id, MODEL_KIND_TAG, "lora_adapter" if adapter else "full")
    return f"{mc.get_run(run_id).info.artifact_uri.rstrip('/')}/{MODEL_ARTIFACT}"


def register_model(tc: TrackingConfig, run_id: str, source: str, description: str = "") -> ModelVersion:
    """Register ``source`` as a new version of ``tc.registered_model_name`` and move
    ``tc.registered_model_alias`` to it.

    Args:
        tc: tracking settings (registry name and alias).
        run_id: the run that produced the model (linked from the version).
        source: artifact URI of the model folder (:func:`log_model`'s return value).
        description: the version's description (e.g. the run's rewards).

    Returns:
        The new ``mlflow.entities.model_registry.ModelVersion``; ``models:/NAME@ALIAS`` now resolves to it.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

    mc, name = client(tc), tc.registered_model_name
    try:
        mc.create_registered_model(name, description="GRPO-trained policies (grpo-flow)")
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    version = mc.create_model_version(
        name,
        source=source,
        run_id=run_id,
        description=description,
        tags={MODEL_KIND_TAG: mc.get_run(run_id).data.tags.get(MODEL_KIND_TAG, "")},
    )
    mc.set_registered_model_alias(name, tc.registered_model_alias, version.version)
    logger.info("registered %s version %s (alias %r)", name, version.version, tc.registered_model_alias)
    return version


def run_url(tc: TrackingConfig, run_id: str) -> str:
    """The run's page in the MLflow UI (``tc.resolved_ui_url()``)."""
    experiment = client(tc).get_run(run_id).info.experiment_id
    return f"{tc.resolved_ui_url()}/#/experiments/{experiment}/runs/{run_id}"


def completions_table(rows: list[dict[str, Any]], max_chars: int) -> dict[str, list[Any]]:
    """Rows (dicts) as the columns ``mlflow.log_table`` takes; text cells cut to ``max_chars`` (marked ``…``)."""
    columns: dict[str, list[Any]] = {}
    for row in rows:
        for key in row:
            columns.setdefault(key, [])
    for row in rows:
        for key, values in columns.items():
            value = row.get(key)
            if isinstance(value, str) and len(value) > max_chars:
                value = value[: max_chars - 1] + "…"
            values.append(value)
    return columns


#: Steps whose completion rows share one table artifact (``completions/steps_NNNNNNN-MMMMMMM.json``).
COMPLETION_TABLE_STEPS = 10
#: Completion tables listed in the run's ``mlflow.loggedArtifacts`` tag (the newest ones).
MAX_LISTED_TABLES = 100
#: MLflow's tag that lists a run's tables (``mlflow.utils.mlflow_tags.MLFLOW_LOGGED_ARTIFACTS``).
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"


def completion_table_path(step: int) -> str:
    """The table artifact holding ``step``'s completion rows (``COMPLETION_TABLE_STEPS`` steps per table)."""
    first = (step - 1) // COMPLETION_TABLE_STEPS * COMPLETION_TABLE_STEPS + 1
    return f"completions/steps_{first:07d}-{first + COMPLETION_TABLE_STEPS - 1:07d}.json"


def listed_tables(tag_value: str | None, path: str, limit: int) -> str:
    """The ``mlflow.loggedArtifacts`` tag value listing ``path`` as a table, kept within MLflow's tag length.

    ``mlflow.log_table`` appends one entry per new table file to this tag and MLflow cuts a tag value at
    ``MAX_TAG_VAL_LENGTH`` (8000) characters: after about 130 tables the cut value is no JSON, and every later
    ``log_table`` fails while parsing it. Here the completion tables listed are the newest ``limit`` (older ones
    leave the list, never the artifacts), other entries are kept, and the value always parses and fits.

    Args:
        tag_value: the tag's current value; None, or a value that does not parse (cut by an older version), =
            an empty list.
        path: the table artifact to list.
        limit: most completion tables listed.

    Returns:
        The JSON value to set.
    """
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    try:
        entries = json.loads(tag_value or "[]")
        entries = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    except json.JSONDecodeError:
        entries = []
    entry = {"path": path, "type": "table"}
    entries = [e for e in entries if e != entry] + [entry]
    ours = [e for e in entries if str(e.get("path", "")).startswith("completions/")]
    dropped = {json.dumps(e, sort_keys=True) for e in ours[: max(len(ours) - limit, 0)]}
    entries = [e for e in entries if json.dumps(e, sort_keys=True) not in dropped]
    while len(value := json.dumps(entries)) > MAX_TAG_VAL_LENGTH and len(entries) > 1:
        entries.pop(0)
    return value


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


__all__ = [
    "MetricNames",
    "MlflowSink",
    "completion_table_path",
    "completions_table",
    "download_latest_checkpoint",
    "end_run",
    "find_run",
    "flatten",
    "listed_tables",
    "log_checkpoint",
    "log_file",
    "log_model",
    "mlflow_safe_name",
    "register_model",
    "run_url",
    "start_run",
]


def uploaded_checkpoint_step(tc: TrackingConfig, run_id: str, read_only: bool = False) -> int | None:
    """The step of MLflow run ``run_id``'s latest completely uploaded checkpoint (its ``LATEST_STEP_TAG``).

    Args:
        tc: the tracking settings naming the store.
        run_id: the MLflow run id.
        read_only: a local SQLite store is read directly, read-only (MLflow's ``runs`` and ``tags`` tables), instead
            of through an MLflow client, which makes its folder and lock file and migrates its schema
            (``grpo validate``).

    Returns:
        The step, or None when the run completed no checkpoint upload.

    Raises:
        LookupError: the store holds no run ``run_id`` (or there is no store).
    """
    from grpo_core.preflight import open_sqlite, sqlite_path

    db = sqlite_path(tc.resolved_tracking_uri())
    if db is not None and not db.expanduser().is_file():  # no store holds no run (and opening one creates it)
        raise LookupError(f"no MLflow store at {db}")
    if db is not None and read_only:
        import sqlite3

        try:
            with open_sqlite(db, read_only=True) as store:
                if store.execute("SELECT 1 FROM runs WHERE run_uuid = ?", (run_id,)).fetchone() is None:
                    raise LookupError(f"no run {run_id}")
                tag = store.execute(
                    "SELECT value FROM tags WHERE run_uuid = ? AND key = ?", (run_id, LATEST_STEP_TAG)
                ).fetchone()
        except sqlite3.Error as exc:  # not a database, or no runs table yet
            raise LookupError(str(exc)) from None
        value = tag[0] if tag else None
    else:
        try:
            value = client(tc).get_run(run_id).data.tags.get(LATEST_STEP_TAG)
        except MlflowException as exc:
            raise LookupError(str(exc)) from None
    return int(value) if value is not None else None


def download_run_config(tc: TrackingConfig, run_id: str) -> Path:
    """Download ``config/run_config.json`` of MLflow run ``run_id`` into a new temporary folder; returns its path.

    Raises:
        ConfigError: the run or its config cannot be read from the store (names the id, the store and the fix).
    """
    import tempfile

    from grpo_core.errors import ConfigError

    try:
        return Path(client(tc).download_artifacts(run_id, "config/run_config.json", tempfile.mkdtemp()))
    except (MlflowException, OSError) as exc:
        raise ConfigError(
            f"run {run_id!r}: its config (config/run_config.json) cannot be read from the MLflow store "
            f"{tc.shown_tracking_uri()} ({type(exc).__name__}); check the id (grpo ui --mlflow lists the "
            "runs) or the tracking settings (--set tracking.dir=... / tracking.tracking_uri=...)"
        ) from None
