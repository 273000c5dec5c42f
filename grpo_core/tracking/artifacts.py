"""Checkpoints and models as artifacts of the MLflow run: upload, the resume's download, registration.

* ``checkpoints/step-NNNNNNN/``: each checkpoint folder when it is at most ``tracking.checkpoint_artifact_max_mib``,
  else only its ``rollout_state.json`` and a ``checkpoint_uri.txt`` naming where the folder lies; the tag
  ``grpo.latest_checkpoint_step`` names the latest one uploaded completely;
* ``resume/rollout_state.json``: the latest resume state;
* ``model/`` at the end: the exported Hugging Face folder (``from_pretrained`` on the downloaded folder loads it),
  registered as a new version of ``tracking.registered_model_name`` with the alias ``tracking.registered_model_alias``.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow.exceptions import MlflowException

from grpo_core.config import TrackingConfig
from grpo_core.run.layout import (
    CHECKPOINT_DCP,
    CHECKPOINT_DOWNLOAD,
    CHECKPOINT_STATE,
    CHECKPOINTS_DIR,
    checkpoint_dir,
    checkpoint_step,
)
from grpo_core.run.layout import CHECKPOINT_URI as CHECKPOINT_URI_FILE
from grpo_core.tracking.store import LATEST_STEP_TAG, MODEL_ARTIFACT, MODEL_KIND_TAG, client

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion

logger = logging.getLogger(__name__)


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
    from grpo_core.run.stores import open_sqlite, sqlite_path

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
