"""End-of-run summary and reward curve, read from a run's ``metrics.jsonl``.

``reward`` is the mean reward of the rollouts scored in a logging window (DESIGN.md §7);
throughputs are the rate metrics of the trainer (``perf/tokens_per_s``,
``perf/trained_tokens_per_s``) and the generated tokens of the rollout side over wall time.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from grpo_core.run.durable import atomic_write_text
from grpo_core.run.layout import TRAIN_END, TRAINER_ERROR
from grpo_core.tracking.metrics import JsonlSink

logger = logging.getLogger(__name__)

REWARD = "reward"
GROUP_COUNT = "rollout/group_count"
#: The metric every held-out evaluation logs (``grpo_core.rollout.evaluate``): marks a ``metrics.jsonl`` line as one.
EVAL_MARK = "eval/num_prompts"


def write_train_end(
    output_dir: Path, steps: int, max_steps: int, stopped_early: str | None, skipped_nonfinite_steps: int = 0
) -> Path:
    """Record how a trainer run ended: ``{"steps", "max_steps", "stopped_early", "skipped_nonfinite_steps"}``.

    Args:
        output_dir: the trainer's ``train.output_dir``.
        steps: optimizer steps done (resumed ones included).
        max_steps: ``train.max_steps``.
        stopped_early: why it stopped before ``max_steps`` (None = it did not).
        skipped_nonfinite_steps: steps of this process whose update was skipped (non-finite gradient norm).
    """
    path = Path(output_dir) / TRAIN_END
    atomic_write_text(
        path,
        json.dumps(
            {
                "steps": steps,
                "max_steps": max_steps,
                "stopped_early": stopped_early,
                "skipped_nonfinite_steps": skipped_nonfinite_steps,
            }
        ),
    )
    return path


def write_trainer_error(output_dir: Path, rank: int, exc: BaseException) -> None:
    """Append ``rank R: Type: message`` for an exception that ends a trainer process (read by the flow)."""
    path = Path(output_dir) / TRAINER_ERROR
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(f"rank {rank}: {type(exc).__name__}: {exc}\n")


def read_trainer_error(output_dir: Path) -> str:
    """What :func:`write_trainer_error` recorded ('' if nothing)."""
    path = Path(output_dir) / TRAINER_ERROR
    return path.read_text().strip() if path.is_file() else ""


def read_train_end(output_dir: Path) -> dict | None:
    """What :func:`write_train_end` wrote, or None (no trainer run ended there)."""
    path = Path(output_dir) / TRAIN_END
    return json.loads(path.read_text()) if path.is_file() else None


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def _reward_of(records: list[dict]) -> float:
    """Mean reward of the rollouts scored in ``records``' windows: each step's ``reward`` (its window's mean)
    weighted by the groups its window scored (``rollout/group_count``; 1 where not logged), so a step whose window
    closed on one group weighs one group, not a whole step. NaN without a reward."""
    pairs = [(r[REWARD], r.get(GROUP_COUNT, 1.0)) for r in records if not math.isnan(r[REWARD])]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else float("nan")


def summarize(metrics_path: Path, wall_s: float | None = None) -> dict[str, float | str | None]:
    """Numbers of the summary table.

    Args:
        metrics_path: the run's ``metrics.jsonl`` (the trainer's ``train_end.json`` beside it is read too).
        wall_s: seconds the training took (for generated tokens/s); None = sum of ``perf/step_s``.

    Returns:
        ``steps`` (steps trained, from ``train_end.json`` when present, else the last logged step),
        ``steps_requested`` (``train.max_steps``; None when unknown), ``stopped_early`` (why the run
        trained fewer steps than asked; None when it did not), ``skipped_nonfinite_steps``,
        ``reward_first5`` / ``reward_last5`` (mean reward of the rollouts scored in the first and last five logged
        steps' windows: each step weighted by the groups its window scored, :func:`_reward_of`),
        ``trained_tokens_per_s``, ``forwarded_tokens_per_s``, ``generated_tokens_per_s`` (tokens/s;
        NaN when unknown), ``eval`` (the last held-out evaluation in words, :func:`eval_line`; None without one),
        ``time_to_first_step_s`` (``perf/time_to_first_step_s`` of the run's last start: the command's start to its
        first optimizer step; None when not logged).
    """
    records = JsonlSink.read(metrics_path) if Path(metrics_path).exists() else []
    records = [r for r in records if EVAL_MARK not in r]  # the steps' own lines, not the evaluations'
    rewarded = [r for r in records if REWARD in r]
    step_s = sum(r.get("perf/step_s", 0.0) for r in records)
    seconds = wall_s if wall_s else step_s
    trained = sum(r.get("batch/trained_tokens_per_step", 0.0) for r in records)
    forwarded = sum(r.get("batch/forwarded_tokens_per_step", 0.0) for r in records)
    generated = _mean([r["rollout/generated_tokens_per_s"] for r in records if "rollout/generated_tokens_per_s" in r])

    def rate(n: float) -> float:
        return n / seconds if seconds else float("nan")

    end = read_train_end(Path(metrics_path).parent) or {}
    first = [r["perf/time_to_first_step_s"] for r in records if "perf/time_to_first_step_s" in r]
    evals = eval_history(metrics_path)
    return {
        "eval": eval_line(evals[-1]) if evals else None,
        "steps": float(end.get("steps", records[-1]["step"] if records else 0.0)),
        "steps_requested": end.get("max_steps"),
        "stopped_early": end.get("stopped_early"),
        "skipped_nonfinite_steps": end.get("skipped_nonfinite_steps", 0),
        "reward_first5": _reward_of(rewarded[:5]),
        "reward_last5": _reward_of(rewarded[-5:]),
        "trained_tokens_per_s": rate(trained),
        "forwarded_tokens_per_s": rate(forwarded),
        "generated_tokens_per_s": generated,
        "time_to_first_step_s": first[-1] if first else None,
    }


def eval_history(metrics_path: Path) -> list[dict[str, float]]:
    """The held-out evaluations of a run's ``metrics.jsonl`` (``eval``), in step order: each ``{"step", "eval/..."}``
    (a resumed run's evaluation of an already evaluated step: the last one logged)."""
    records = JsonlSink.read(metrics_path) if Path(metrics_path).exists() else []
    by_step = {r["step"]: r for r in records if EVAL_MARK in r}
    return [by_step[s] for s in sorted(by_step)]


def eval_line(record: dict[str, float]) -> str:
    """One evaluation in words: ``step 8 (policy version 8), 16 prompts: reward_mean 0.41, pass_at_4 0.62, ...``."""
    figures = ", ".join(
        f"{k.removeprefix('eval/')} {v:.4g}"
        for k, v in sorted(record.items())
        if k.startswith("eval/") and k not in (EVAL_MARK, "eval/policy_version", "eval/duration_s")
    )
    return (
        f"step {record['step']:.0f} (policy version {record.get('eval/policy_version', float('nan')):.0f}), "
        f"{record[EVAL_MARK]:.0f} prompts: {figures}"
    )


def plot_reward_curve(metrics_path: Path, png_path: Path) -> Path | None:
    """Write a PNG of reward per step (and a 5-step running mean); None when no reward was logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in JsonlSink.read(metrics_path) if REWARD in r] if Path(metrics_path).exists() else []
    if not records:
        logger.warning("no reward in %s: no reward curve", metrics_path)
        return None
    steps, rewards = [r["step"] for r in records], [r[REWARD] for r in records]
    smooth = [_mean(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, rewards, "o-", alpha=0.4, label="reward (per step)")
    ax.plot(steps, smooth, "-", linewidth=2, label="running mean (5 steps)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
