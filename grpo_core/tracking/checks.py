"""The MLflow checks of a run's preflight (``grpo_core.run.preflight.check_run``, ``grpo validate``): the store can be
used and ``resume_from`` names a run of it with a finished checkpoint."""

from __future__ import annotations

from pathlib import Path

from grpo_core.config import RunConfig
from grpo_core.errors import ConfigError
from grpo_core.run.stores import check_sqlite, ensure_dir, sqlite_path
from grpo_core.security.redact import mask_values, redact_text


def check_tracking(cfg: RunConfig, create: bool = True) -> None:
    """The MLflow store can be used: its SQLite file and artifact folder (local), or its server answers
    (``create``: False creates neither; :func:`ensure_dir`).

    Raises:
        ConfigError: a folder or database that cannot be created or opened, or a tracking server that
            does not answer ``/health`` within 10 s (names the path or URL and the cause).
    """
    tc = cfg.tracking
    if not tc.enabled:
        return
    uri = tc.resolved_tracking_uri()
    db = sqlite_path(uri)
    if db is not None:
        # the embedded store's folder (tracking.dir) is its own: 0700; a database URL's folder keeps its mode
        check_sqlite(db, "tracking.dir / tracking.tracking_uri (the MLflow store)", create, tc.tracking_uri is None)
    elif uri.startswith(("http://", "https://")):
        import httpx

        try:
            httpx.get(uri.rstrip("/") + "/health", timeout=10.0).raise_for_status()
        except httpx.HTTPError as exc:
            cause = redact_text(str(exc), mask_values({"uri": uri}))
            raise ConfigError(
                f"tracking.tracking_uri={tc.shown_tracking_uri()}: the MLflow server does not answer "
                f"/health ({type(exc).__name__}: {cause}); start it or fix the URI"
            ) from None
    artifacts = tc.resolved_artifact_location()
    if artifacts and "://" not in artifacts:
        own = tc.artifact_location is None  # tracking.dir/artifacts
        ensure_dir(Path(artifacts), "tracking.artifact_location (MLflow artifacts)", create, own)
    elif artifacts and artifacts.startswith("file://"):
        ensure_dir(Path(artifacts.removeprefix("file://")), "tracking.artifact_location (MLflow artifacts)", create)


def check_resume_from(cfg: RunConfig, create: bool = True) -> None:
    """``resume_from`` names a run of the MLflow store with a completely uploaded checkpoint, before the flow opens
    a run of its own (``create``: False, ``grpo validate``: a local SQLite store is read read-only, MLflow's tables,
    instead of through an MLflow client, which makes its folder and lock file and migrates its schema).

    Raises:
        ConfigError: no such run, a run without a finished checkpoint, or tracking is off; naming the id, the store
            and the fix.
    """
    if not cfg.resume_from:
        return
    tc = cfg.tracking
    if not tc.enabled:
        raise ConfigError(
            f"resume_from={cfg.resume_from!r} needs tracking.enabled: true (the checkpoint is found "
            "through the MLflow run)"
        )
    from grpo_core import tracking

    try:
        step = tracking.uploaded_checkpoint_step(tc, cfg.resume_from, read_only=not create)
    except LookupError:
        raise ConfigError(
            f"resume_from={cfg.resume_from!r}: no such run in the MLflow store "
            f"{tc.shown_tracking_uri()}; copy the id from the MLflow UI (grpo ui --mlflow) or point "
            "tracking.dir / tracking.tracking_uri at the store that holds it"
        ) from None
    if step is None:
        raise ConfigError(
            f"resume_from={cfg.resume_from!r}: MLflow run {cfg.resume_from} has no completely uploaded checkpoint "
            f"(no tag {tracking.LATEST_STEP_TAG}: it stopped before its first train.save_steps); pick a run that "
            "saved one, or drop resume_from to start a new run"
        )
