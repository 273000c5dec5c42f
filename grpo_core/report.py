"""End-of-run summary and reward curve, read from a run's ``metrics.jsonl``.

``reward`` is the mean reward of the rollouts scored in a logging window (DESIGN.md §7);
throughputs are the rate metrics of the trainer (``perf/tokens_per_s``,
``perf/trained_tokens_per_s``) and the generated tokens of the rollout side over wall time.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from grpo_core.metrics import JsonlSink

logger = logging.getLogger(__name__)

REWARD = "reward"


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def summarize(metrics_path: Path, wall_s: float | None = None) -> dict[str, float]:
    """Numbers of the summary table.

    Args:
        metrics_path: the run's ``metrics.jsonl``.
        wall_s: seconds the training took (for generated tokens/s); None = sum of ``perf/step_s``.

    Returns:
        ``steps``, ``reward_first5`` / ``reward_last5`` (mean reward of the first and last five logged
        steps), ``trained_tokens_per_s``, ``forwarded_tokens_per_s``, ``generated_tokens_per_s``
        (tokens/s; NaN when unknown).
    """
    records = JsonlSink.read(metrics_path) if Path(metrics_path).exists() else []
    rewards = [r[REWARD] for r in records if REWARD in r]
    step_s = sum(r.get("perf/step_s", 0.0) for r in records)
    seconds = wall_s if wall_s else step_s
    trained = sum(r.get("batch/trained_tokens_per_step", 0.0) for r in records)
    forwarded = sum(r.get("batch/forwarded_tokens_per_step", 0.0) for r in records)
    generated = _mean([r["rollout/generated_tokens_per_s"] for r in records if "rollout/generated_tokens_per_s" in r])
    rate = (lambda n: n / seconds if seconds else float("nan"))
    return {"steps": float(records[-1]["step"]) if records else 0.0,
            "reward_first5": _mean(rewards[:5]), "reward_last5": _mean(rewards[-5:]),
            "trained_tokens_per_s": rate(trained), "forwarded_tokens_per_s": rate(forwarded),
            "generated_tokens_per_s": generated}


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
    smooth = [_mean(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]
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
