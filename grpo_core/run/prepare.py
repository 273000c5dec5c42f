"""Before a run's processes start: check the config, lay out the run folder, open the MLflow run, fetch and check
the checkpoint it resumes from (no Prefect here: ``flows/grpo_train.py``'s ``prepare`` task calls
:func:`prepare_run`).

The run's secret values never reach its files: the run folder's config is written redacted, and the values are kept
in this process (:data:`SECRETS`), handed to children in their environment only (:func:`run_child_env`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.config import RunConfig, TLSConfig
from grpo_core.run import layout
from grpo_core.run.processes import REGISTRY, child_env

logger = logging.getLogger(__name__)

#: Secret values of each run's config by run folder: kept in this process, never in the (redacted) run files.
SECRETS: dict[str, dict[str, str]] = {}


@dataclass
class PreparedRun:
    """What :func:`prepare_run` laid out.

    Attributes:
        run_dir: the run folder (absolute; 0700).
        mlflow_run_id: the MLflow run (None with ``tracking.enabled`` off).
        mlflow_url: its page in the MLflow UI (None without a run).
        resume_state: the checkpoint's resume state file it resumes from (None: a fresh start).
    """

    run_dir: str
    mlflow_run_id: str | None
    mlflow_url: str | None
    resume_state: str | None


def run_config(run_dir: str) -> RunConfig:
    """The run's config as :func:`prepare_run` wrote it to the run folder, its secrets put back."""
    from grpo_core.security.redact import apply_secrets

    data = json.loads((Path(run_dir) / layout.RUN_CONFIG).read_text())
    return RunConfig.model_validate(apply_secrets(data, SECRETS.get(run_dir, {})))


def _run_tls(run_dir: str) -> TLSConfig:
    """The ``tls`` section of the run's saved config (the default, TLS off, when none was saved)."""
    path = Path(run_dir) / layout.RUN_CONFIG
    saved = json.loads(path.read_text()).get("tls") if path.is_file() else None
    return TLSConfig.model_validate(saved or {})


def run_child_env(run_dir: str, secrets: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the run's rollout and trainer processes (:func:`grpo_core.run.processes.child_env`: owned by
    this process): the keys of the rollout's and trainer's roles, derived from the run's token — control (their
    generation clients, the weight sync) and trainer membership (the Flight server and client, the ranks' check) —
    never the token itself nor the inference key (``grpo_core.security.auth.role_env``), and the config's secrets
    (``GRPO_RUN_SECRETS``; ``secrets``: those of a process's sub-config, else the run config's) travel here, never on
    a command line; so do the ``tls`` files (:func:`grpo_core.security.auth.tls_env`)."""
    from grpo_core.security.auth import ROLE_CONTROL, ROLE_MEMBER, role_env, tls_env, without_keys
    from grpo_core.security.redact import SECRETS_ENV

    extra = {**role_env(REGISTRY[run_dir].token, ROLE_CONTROL, ROLE_MEMBER), **tls_env(_run_tls(run_dir))}
    secrets = SECRETS.get(run_dir) if secrets is None else secrets
    if secrets:
        extra[SECRETS_ENV] = json.dumps(secrets)
    return {**without_keys(child_env()), **extra}


def prepare_run(
    config: RunConfig,
    flow_run_id: str,
    deployment: str | None,
    run_name: str | None,
    log: Any = logger,
    on_mlflow_run: Callable[[str, str], None] | None = None,
) -> PreparedRun:
    """Check the config (code it names inside the allow-list ``GRPO_ALLOWED_MODULES`` before any import, then
    imports, dataset columns, Hub push), lay out the run folder (0700; the config file 0600 with its secrets
    redacted, kept in this process), open the MLflow run, fetch a checkpoint and check it against its manifest.

    Args:
        config: the run's config.
        flow_run_id: names the run folder ``<train.output_dir>/<flow_run_id>`` and the MLflow run's tag.
        deployment: the Prefect deployment that started the run (None: started by hand), an MLflow tag.
        run_name: the MLflow run's name.
        log: where the lines for the user go (the Prefect run logger).
        on_mlflow_run: called with the MLflow run's URL and id once it is open, before the checkpoint checks (the
            flow publishes the link as an artifact, so a run refused there still links to its MLflow run).

    Raises:
        ConfigError: the config fails a check (names the field and the fix).
        RunLockedError: an orphaned trainer of a killed attempt still holds the run folder past
            ``train.run_lock_timeout_s``.
        CheckpointError: the checkpoint to resume from cannot be fetched, fails its manifest, or belongs to another
            run.
    """
    from grpo_core.run import preflight
    from grpo_core.run.run_lock import RunLock
    from grpo_core.security.redact import mask_values, redact_logs, secret_values, write_private
    from grpo_core.train.checkpoint import STATE_FILE, latest_checkpoint
    from grpo_core.train.fingerprint import check_resume
    from grpo_core.train.manifest import verify_manifest

    secrets = secret_values(config)
    redact_logs(mask_values(secrets))
    preflight.check_run(config)
    run_dir = (config.train.output_dir / flow_run_id).resolve()
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    run_dir.chmod(0o700)  # the run's files (logs, configs, checkpoints) are its owner's only
    SECRETS[str(run_dir)] = secrets
    # an orphaned trainer of a killed attempt may still write the folder: wait for it, or fail naming its pid
    with RunLock(run_dir, "prepare", config.train.run_lock_timeout_s):
        pass
    cfg = config.model_copy(deep=True)
    cfg.train.output_dir = run_dir
    cfg.server.log_dir = run_dir / layout.SERVERS_DIR
    mlflow_run_id = mlflow_url = None
    if cfg.tracking.enabled:
        from grpo_core import tracking

        mlflow_run_id, continued = tracking.start_run(cfg, flow_run_id, deployment, run_name=run_name)
        cfg.tracking.run_id = mlflow_run_id
        mlflow_url = tracking.run_url(cfg.tracking, mlflow_run_id)
        if latest_checkpoint(run_dir) is None:  # a retry on a host without the run folder, or resume_from
            fetch_checkpoint(cfg, run_dir, continued)
    write_private(run_dir / layout.RUN_CONFIG, cfg.model_dump_json(indent=1))  # secrets redacted
    if mlflow_run_id and mlflow_url and on_mlflow_run is not None:
        on_mlflow_run(mlflow_url, mlflow_run_id)
    latest = latest_checkpoint(run_dir)
    if latest is not None:
        verify_manifest(latest)  # a downloaded checkpoint is refused here, naming its tampered or missing file
        check_resume(cfg.trainer_process(), latest)  # a different run refuses here, before any server starts
        log.info("resuming from checkpoint %s", latest)
    log.info("run folder %s, MLflow run %s", run_dir, mlflow_run_id)
    return PreparedRun(
        str(run_dir), mlflow_run_id, mlflow_url, str(latest / STATE_FILE) if latest is not None else None
    )


def fetch_checkpoint(cfg: RunConfig, run_dir: Path, continued: bool) -> Path | None:
    """Fetch the checkpoint a run without a local one resumes from: its own MLflow run's (a retry on a host
    where the run folder is gone), else ``resume_from``'s; each the latest completely uploaded one.

    Returns:
        The local checkpoint folder, or None (a fresh start: neither run completed a checkpoint upload, and
        ``resume_from`` is unset).

    Raises:
        CheckpointError: a checkpoint exists but cannot be fetched (names the run, the checkpoint and why), or
            ``resume_from`` names a run without a completely uploaded checkpoint.
    """
    from grpo_core import tracking
    from grpo_core.errors import CheckpointError
    from grpo_core.train.checkpoint import verify

    fetched = None
    if continued:
        assert cfg.tracking.run_id is not None  # a continued run: prepare set it to the MLflow run it continues
        fetched = tracking.download_latest_checkpoint(cfg.tracking, cfg.tracking.run_id, run_dir, verify=verify)
    source = cfg.resume_from
    if fetched is None and source:
        fetched = tracking.download_latest_checkpoint(cfg.tracking, source, run_dir, verify=verify)
        if fetched is None:
            raise CheckpointError(
                f"resume_from={source}: MLflow run {source} has no completely uploaded checkpoint "
                f"(no tag {tracking.LATEST_STEP_TAG}); pick a run that saved one, or drop "
                "resume_from to start a new run"
            )
    return fetched
