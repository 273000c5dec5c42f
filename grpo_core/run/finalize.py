"""After training: the reward curve, the summary, the model card, the exported model to MLflow (a registered version
with its alias) and to the Hub, and the MLflow run ended (no Prefect here: ``flows/grpo_train.py``'s ``finalize``
task calls :func:`finalize_run` and publishes the summary as artifacts)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from grpo_core.config import RunConfig
from grpo_core.run import layout

logger = logging.getLogger(__name__)


def finalize_run(
    cfg: RunConfig,
    run_dir: str,
    mlflow_run_id: str | None,
    wall_s: float,
    log: Any = logger,
    resumed_from: str | None = None,
) -> dict:
    """Reward curve, summary, model card; the exported model to MLflow and to the Hub (``export.push_to_hub``); the
    MLflow run ended FINISHED (FAILED when an upload failed).

    Args:
        cfg: the run's config.
        run_dir: the run folder.
        mlflow_run_id: the run's MLflow run (None: not tracked).
        wall_s: seconds from the servers' start to the end of training, for the summary's rates.
        log: where the lines for the user go (the Prefect run logger).
        resumed_from: the checkpoint folder the last attempt resumed from (None: it started fresh).

    Returns:
        The summary (JSON-able): ``grpo_core.tracking.report.summarize``'s figures plus the run folder, checkpoint,
        reward curve, MLflow run and URI, ``resumed_from``, and the model's places (``model``, ``registered_model``,
        ``hub_commit``).
    """
    from grpo_core.models import hub
    from grpo_core.tracking import report
    from grpo_core.train.checkpoint import latest_checkpoint

    root = Path(run_dir)
    png = report.plot_reward_curve(root / layout.METRICS, root / layout.REWARD_CURVE)
    summary = {
        **report.summarize(root / layout.METRICS, wall_s),
        "run_dir": run_dir,
        "checkpoint": str(latest_checkpoint(root)),
        "reward_curve": str(png) if png else None,
        "mlflow_run_id": mlflow_run_id,
        "mlflow_uri": cfg.tracking.shown_tracking_uri(),
        "resumed_from": resumed_from,
    }
    model_dir = root / layout.FINAL_MODEL_DIR
    if model_dir.is_dir():
        hub.write_model_card(cfg, model_dir, summary, png, adapter=cfg.train.lora.enabled)
        summary["model"] = str(model_dir)
    status = "FAILED"
    try:
        if mlflow_run_id:
            summary.update(track_final(cfg, mlflow_run_id, png, model_dir if model_dir.is_dir() else None, summary))
        if cfg.export.push_to_hub and model_dir.is_dir():
            summary["hub_commit"] = hub.push_to_hub(cfg, model_dir)
        status = "FINISHED"
    finally:
        if mlflow_run_id:
            from grpo_core import tracking

            tracking.end_run(cfg.tracking, mlflow_run_id, status)
    log.info("summary: %s", summary)
    if summary.get("stopped_early"):
        log.warning(
            "trained %s of %s steps: %s", summary["steps"], summary["steps_requested"], summary["stopped_early"]
        )
    return summary


def track_final(cfg: RunConfig, run_id: str, png: Path | None, model_dir: Path | None, summary: dict) -> dict:
    """Log the reward curve and the exported model to the MLflow run; register a version when configured.

    Returns:
        ``{"registered_model": "NAME vN @ALIAS"}`` when a version was registered, else ``{}``.
    """
    from grpo_core import tracking

    tc, out = cfg.tracking, {}
    if png is not None:
        tracking.log_file(tc, run_id, png, "plots")
    if tc.log_model and model_dir is not None:
        source = tracking.log_model(tc, run_id, model_dir, adapter=cfg.train.lora.enabled)
        if tc.registered_model_name:
            version = tracking.register_model(
                tc,
                run_id,
                source,
                description=f"{summary.get('steps', 0):.0f} steps; reward of the last five steps "
                f"{summary.get('reward_last5', float('nan')):.4f}",
            )
            out["registered_model"] = f"{tc.registered_model_name} v{version.version} @{tc.registered_model_alias}"
    return out
