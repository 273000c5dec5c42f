"""The ``tracking`` (MLflow) and ``flow`` (Prefect) sections."""

from __future__ import annotations

from pathlib import Path

from pydantic import (
    Field,
    field_serializer,
    field_validator,
)

from grpo_core.config.base import _Strict
from grpo_core.security.redact import SecretUrl, redact_url


class TrackingConfig(_Strict):
    """MLflow tracking of a run (``grpo_core.tracking``): metrics, params, checkpoints, resume state."""

    enabled: bool = True
    """Log the run to MLflow; off = metrics only in ``metrics.jsonl``."""
    dir: Path = Path("runs/mlflow")
    """Folder of the embedded store: ``mlflow.db`` (SQLite) and ``artifacts/``."""
    tracking_uri: SecretUrl | None = None
    """MLflow tracking URI (``http://host:5000``, a database URL); None = SQLite file ``<dir>/mlflow.db``. A
    password in it (``https://user:password@host``) is secret: shown as ``**********`` in logs, params and files
    (or leave it out and set ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``)."""
    artifact_location: SecretUrl | None = None
    """Artifact root of a new experiment; None = ``<dir>/artifacts`` (the server's default with a tracking server).
    A password in it is secret like ``tracking_uri``'s."""
    experiment_name: str = "grpo-flow"
    """MLflow experiment the run is logged under."""
    run_id: str | None = None
    """MLflow run to log into; set by the flow for the trainer process (leave unset)."""
    checkpoint_artifact_max_mib: float = Field(default=256.0, ge=0)
    """Checkpoints up to this size (MiB) are copied as artifacts; larger ones are logged as a URI (their path)."""
    log_model: bool = True
    """At the end, log the exported model (or LoRA adapter) folder as the run's ``model`` artifact
    (``from_pretrained`` on the downloaded folder loads it)."""
    registered_model_name: str | None = None
    """Model registry name the final model (or adapter) is registered under as a new version; None = not
    registered."""
    registered_model_alias: str = "candidate"
    """Alias moved to each newly registered version (promote a version by moving another alias, e.g.
    ``champion``, to it)."""
    log_system_metrics: bool = True
    """Log the trainer's system metrics (CPU, memory, disk, network; GPU utilisation and memory when an NVIDIA
    GPU is visible) as ``system/*`` metrics of the run."""
    system_metrics_interval_s: float = Field(default=10.0, ge=1.0)
    """Seconds between system metric samples."""
    log_completions: bool = False
    """Log a sample of prompts, completions, rewards and advantages of each logging window to an MLflow table
    (``completions/steps_NNNNNNN-MMMMMMM.json``, one per 10 steps)."""
    num_completions_to_print: int | None = Field(default=16, ge=1)
    """Rows of each window's completion table (a uniform sample of the window's scored completions);
    None = every completion of the window."""
    completion_max_chars: int = Field(default=2000, ge=16)
    """Longest prompt or completion text kept in a table cell (longer ones are cut, marked with ``…``)."""
    ui_url: str | None = None
    """Base URL of the MLflow UI that links point to; None = ``tracking_uri`` when it is an http(s) server, else
    ``http://127.0.0.1:5000`` (what ``grpo ui --mlflow`` serves)."""

    @field_validator("dir")
    @classmethod
    def _check_dir(cls, folder: Path) -> Path:
        shown = folder.expanduser().resolve()
        if "?" in str(shown) or "%" in str(shown):  # SQLAlchemy cuts the URL at '?' and decodes '%XX'
            raise ValueError(
                f"tracking.dir: {shown} holds a '?' or '%', which the SQLite URL MLflow opens "
                "(sqlite:///<dir>/mlflow.db) cannot carry; choose a folder without them"
            )
        return folder

    @field_serializer("tracking_uri", "artifact_location", when_used="json")
    def _shown_url(self, url: SecretUrl | None) -> str | None:
        return None if url is None else str(url)

    def resolved_tracking_uri(self) -> str:
        """The tracking URI actually used (``tracking_uri`` or the SQLite file under ``dir``), with its
        credentials: for MLflow only; show :meth:`shown_tracking_uri`."""
        if self.tracking_uri is not None:
            return self.tracking_uri.get_secret_value()
        return f"sqlite:///{self.dir.resolve() / 'mlflow.db'}"

    def shown_tracking_uri(self) -> str:
        """The tracking URI for logs and messages (a password shown as ``**********``)."""
        return redact_url(self.resolved_tracking_uri())

    def resolved_ui_url(self) -> str:
        """Base URL of the MLflow UI (``ui_url``, the http tracking server without its credentials, or the local
        ``grpo ui --mlflow``)."""
        if self.ui_url:
            return self.ui_url.rstrip("/")
        uri = self.tracking_uri.get_secret_value() if self.tracking_uri is not None else ""
        if uri.startswith(("http://", "https://")):
            return redact_url(uri, keep_user=False).rstrip("/")
        return "http://127.0.0.1:5000"

    def resolved_artifact_location(self) -> str | None:
        """Artifact root for a new experiment (None = the tracking server decides), with its credentials."""
        if self.artifact_location is not None:
            return self.artifact_location.get_secret_value()
        return None if self.tracking_uri else str(self.dir.resolve() / "artifacts")


class FlowConfig(_Strict):
    """Scheduling of a run by the Prefect flow ``grpo-train``."""

    concurrency_limit: str | None = "gpu"
    """Prefect global concurrency limit the run holds slots of from provisioning to the end of training (``grpo
    deploy`` creates ``gpu`` with one slot per GPU); a limit missing on the server is not waited for; None = none."""
    concurrency_slots: int | None = Field(default=None, ge=1)
    """Slots the run holds; None = the GPUs it uses with vLLM (the servers' and the trainer's, counted once), or 1
    on the embedded server."""
