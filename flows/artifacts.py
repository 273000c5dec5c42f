"""Prefect artifacts of a ``grpo-train`` flow run (the run page's Artifacts tab, and the Artifacts page by key).

* ``grpo-mlflow-run`` (link): the run's page in the MLflow UI, published as soon as ``prepare`` opened it;
* ``grpo-progress`` (progress): percent of ``train.max_steps`` done, updated while the trainer writes
  ``metrics.jsonl`` (:class:`TrainingProgress`);
* ``grpo-summary`` (table): the end-of-run summary (steps, rewards, throughputs, MLflow run, checkpoint);
* ``grpo-reward-curve`` (markdown): the reward curve PNG inline, with the first and last rewards.

Keys are shared by every run, so the Artifacts page keeps one history per kind (the nightly
retraining's summaries side by side); each artifact also belongs to its own flow run.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import threading
from pathlib import Path
from typing import Any

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from grpo_core.tracking.report import EVAL_MARK

logger = logging.getLogger(__name__)

LINK_KEY, PROGRESS_KEY, SUMMARY_KEY, CURVE_KEY = "grpo-mlflow-run", "grpo-progress", "grpo-summary", "grpo-reward-curve"
EVAL_KEY = "grpo-eval"


def last_record(metrics_path: Path) -> dict[str, Any] | None:
    """The last complete step line of a ``metrics.jsonl`` (None when there is none yet); a held-out evaluation's
    line, logged later at the earlier step it evaluated (``eval``), is skipped."""
    try:
        lines = Path(metrics_path).read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        if EVAL_MARK not in record:
            return record
    return None


def publish_mlflow_link(url: str, run_id: str) -> None:
    """The link artifact to the MLflow run."""
    create_link_artifact(
        url,
        link_text=f"MLflow run {run_id}",
        key=LINK_KEY,
        description="Metrics, system metrics, completion tables, checkpoints and the model of this "
        "run in the MLflow UI (`grpo ui --mlflow` serves it locally).",
    )


class TrainingProgress(threading.Thread):
    """Progress artifact of the ``train`` task: percent of ``max_steps``, from the trainer's ``metrics.jsonl``.

    Create it inside the task (the artifact belongs to the task run), ``start()`` it, and ``stop()`` it
    when the trainer exits (a last update is made then).

    Args:
        metrics_path: the run's ``metrics.jsonl``.
        max_steps: ``train.max_steps``.
        poll_s: seconds between reads of the file.
    """

    def __init__(self, metrics_path: Path, max_steps: int, poll_s: float = 2.0):
        super().__init__(name="progress-artifact", daemon=True)
        self.metrics_path, self.max_steps, self.poll_s = Path(metrics_path), max_steps, poll_s
        self.stopped = threading.Event()
        self.shown = -1.0
        self.artifact_id = create_progress_artifact(
            self._percent(), key=PROGRESS_KEY, description=self._description(last_record(self.metrics_path))
        )

    def _percent(self, record: dict[str, Any] | None = None) -> float:
        step = (record or last_record(self.metrics_path) or {}).get("step", 0)
        return min(100.0, 100.0 * step / self.max_steps)

    def _description(self, record: dict[str, Any] | None) -> str:
        if not record:
            return f"step 0 of {self.max_steps}"
        reward = record.get("reward")
        return f"step {record['step']} of {self.max_steps}" + (f", reward {reward:.3f}" if reward is not None else "")

    def update(self) -> None:
        """Publish the current percentage (when it changed)."""
        record = last_record(self.metrics_path)
        percent = self._percent(record)
        if percent != self.shown:
            update_progress_artifact(self.artifact_id, percent, description=self._description(record))
            self.shown = percent

    def run(self) -> None:  # noqa: D102 - Thread.run
        while not self.stopped.wait(self.poll_s):
            try:
                self.update()
            except Exception as exc:  # noqa: BLE001 - a missed update must not stop training; logged
                logger.warning("progress artifact update failed: %s", exc)

    def stop(self) -> None:
        """Make a last update and end the thread."""
        self.stopped.set()
        self.join(timeout=10)
        try:
            self.update()
        except Exception as exc:  # noqa: BLE001 - as in run()
            logger.warning("progress artifact update failed: %s", exc)


SUMMARY_ROWS = (
    ("steps", "optimizer steps"),
    ("steps_requested", "steps asked (train.max_steps)"),
    ("stopped_early", "stopped early because"),
    ("reward_first5", "reward, first 5 steps"),
    ("reward_last5", "reward, last 5 steps"),
    ("eval", "held-out evaluation, last"),
    ("generated_tokens_per_s", "generated tokens/s"),
    ("trained_tokens_per_s", "trained tokens/s"),
    ("forwarded_tokens_per_s", "forwarded tokens/s"),
    ("mlflow_run_id", "MLflow run id"),
    ("mlflow_uri", "MLflow tracking URI"),
    ("registered_model", "registered model version"),
    ("hub_commit", "Hub commit"),
    ("checkpoint", "checkpoint"),
    ("run_dir", "run folder"),
)


_BLOCK_MARKER = re.compile(r"^(\s*)([-+*#>]|\d+[.)])(?=\s|$)")


def table_cell(value: Any) -> str:
    """A value as the text of a table cell. The Prefect UI renders cells as Markdown, so a text that would open
    a block there (``-``/``+``/``*`` list, ``#`` heading, ``>`` quote, ``1.`` list) gets its marker escaped."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.4f}"
    text = "none" if value is None else str(value)
    return _BLOCK_MARKER.sub(lambda m: m[1] + m[2][:-1] + "\\" + m[2][-1], text, count=1)


def publish_summary(summary: dict[str, Any]) -> None:
    """The summary table artifact (a missing value reads ``none``, e.g. "stopped early because: none")."""
    rows = [{"quantity": label, "value": table_cell(summary.get(key))} for key, label in SUMMARY_ROWS if key in summary]
    create_table_artifact(rows, key=SUMMARY_KEY, description="End-of-run summary of grpo-train")


def publish_reward_curve(png: Path | None, summary: dict[str, Any]) -> None:
    """The reward curve as a markdown artifact (the PNG inline as a data URI, so no server has to serve it)."""
    if png is None or not Path(png).is_file():
        text = "No reward was logged: no reward curve."
    else:
        data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
        text = (
            f"### Reward per optimizer step\n\n![reward curve](data:image/png;base64,{data})\n\n"
            f"Mean reward of the first five steps **{table_cell(summary.get('reward_first5'))}**, "
            f"of the last five **{table_cell(summary.get('reward_last5'))}** "
            f"({table_cell(summary.get('steps'))} steps)."
        )
    create_markdown_artifact(text, key=CURVE_KEY, description="Reward curve of grpo-train")


def eval_markdown(history: list[dict[str, Any]]) -> str:
    """The held-out evaluations as a markdown table: one row per evaluated step, one column per ``eval/*`` metric."""
    names = sorted({k for r in history for k in r if k.startswith("eval/")})
    head = "| step | " + " | ".join(n.removeprefix("eval/") for n in names) + " |"
    rule = "|---:|" + "---:|" * len(names)
    rows = [
        f"| {table_cell(float(r['step']))} | " + " | ".join(table_cell(r.get(n)) for n in names) + " |" for r in history
    ]
    return "\n".join(["### Held-out evaluation (eval/*) per optimizer step", "", head, rule, *rows])


def publish_eval(history: list[dict[str, Any]]) -> None:
    """The held-out evaluations of the run (``eval``) as a markdown table artifact; nothing without any."""
    if history:
        create_markdown_artifact(eval_markdown(history), key=EVAL_KEY, description="Held-out evaluation of grpo-train")
