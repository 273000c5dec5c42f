"""Held-out evaluation during training (the ``eval`` section, docs/evaluation.md).

The rollout process evaluates the policy on a held-out dataset beside the training rollouts: an
:class:`EvalRunner` task on the rollout's event loop takes the steps to evaluate from an :class:`EvalBoard`
(the trainer's reports of every ``eval.every_steps``-th step and of ``train.max_steps``), samples each prompt
``eval.num_samples`` times (or greedily) on the same generation servers with the policy version of that step,
scores the samples with the eval reward functions and adds ``eval/*`` to the rollout's metric window tagged with
the step (``eval@12/pass_at_4``, ``grpo_core.tracking.metrics.at_step``): the trainer drains the window as every
rollout metric and logs them at the step they evaluated. The runner has its own request bound
(``eval.max_concurrent_requests``) and thread pool, reads no training prompt and takes no token allowance, so the
training rollouts' order, staleness and pace are those of a run without evaluation.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from grpo_core.config import RolloutConfig
from grpo_core.config.evaluation import EvalConfig
from grpo_core.errors import ConfigError, RolloutError, ServingError, UserCodeError
from grpo_core.security.allowlist import import_object
from grpo_core.tracking.metrics import at_step

from .data import default_rewards, iter_rows, load_dataset
from .loop import RolloutLoop, request_seed
from .scoring import score_group
from .types import Rollout, RolloutGroup
from .window import MetricWindow

logger = logging.getLogger(__name__)

#: Group ids of eval requests start here (the sampler seed and the replica affinity key never meet training's).
EVAL_GROUP_BASE = 1 << 40
POLL_S = 0.05


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from ``n`` samples of which ``c`` are correct.

    ``1 - C(n - c, k) / C(n, k)``: the probability that k samples drawn without replacement from the n hold at
    least one correct one (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1), computed
    as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (the paper's numerically stable form).

    Raises:
        ValueError: not ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def eval_metrics(rewards: list[np.ndarray], ks: list[int], correct_above: float) -> dict[str, float]:
    """``eval/*`` of one evaluation from each prompt's sample rewards.

    Args:
        rewards: per prompt, ``float64[n]`` rewards of its samples (NaN = no reward function scored it: incorrect,
            left out of the mean).
        ks: the k of each ``eval/pass_at_k``.
        correct_above: a sample is correct when its reward is above this.

    Returns:
        ``eval/reward_mean`` (mean over scored samples; NaN if none), ``eval/accuracy`` (fraction of samples
        correct), ``eval/pass_at_k`` per k (mean over prompts of :func:`pass_at_k`), ``eval/num_prompts``.
    """
    flat = np.concatenate(rewards) if rewards else np.zeros(0)
    scored = flat[~np.isnan(flat)]
    correct = [int(np.sum(np.nan_to_num(r, nan=-np.inf) > correct_above)) for r in rewards]
    out = {
        "eval/reward_mean": float(scored.mean()) if scored.size else float("nan"),
        "eval/accuracy": sum(correct) / flat.size if flat.size else float("nan"),
        "eval/num_prompts": float(len(rewards)),
    }
    for k in ks:
        values = [pass_at_k(len(r), c, k) for r, c in zip(rewards, correct, strict=True) if len(r) >= k]
        out[f"eval/pass_at_{k}"] = float(np.mean(values)) if values else float("nan")
    return out


class EvalBoard:
    """The steps to evaluate, fed by the trainer's reports from the Flight server's threads (thread-safe).

    Args:
        every_steps: ``eval.every_steps`` (None = only at the end).
        final_step: ``train.max_steps`` when ``eval.at_end``, else None.
    """

    def __init__(self, every_steps: int | None, final_step: int | None) -> None:
        self.every_steps, self.final_step = every_steps, final_step
        self.requests: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()

    def on_report(self, step: int, policy_version: int) -> None:
        """A trainer report (``TokenAllowance.on_report``): after step ``step``, ask for an evaluation of
        ``policy_version`` when ``step`` is a multiple of ``every_steps`` or the final step."""
        due = bool(self.every_steps) and step % self.every_steps == 0
        if step > 0 and (due or step == self.final_step):
            self.requests.put((step, policy_version))


class EvalRunner:
    """Runs the evaluations the board asks for, one at a time, on the rollout's event loop.

    Args:
        config: the ``eval`` section.
        rollout: the rollout section (sampling settings when not greedy).
        loop: the training rollout loop (its server, tokenizer, ``served_model`` and runtime are shared).
        board: the steps to evaluate (the metrics go to the loop's window, tagged with the step).
        prompts: per eval prompt, ``(row, messages, prompt token ids)``.
        reward_functions: the eval reward functions.
    """

    def __init__(
        self,
        config: EvalConfig,
        rollout: RolloutConfig,
        loop: RolloutLoop,
        board: EvalBoard,
        prompts: list[tuple[dict[str, Any], list[dict[str, Any]], list[int]]],
        reward_functions: list[Any],
    ) -> None:
        self.config, self.rollout, self.loop, self.board = config, rollout, loop, board
        self.prompts, self.reward_functions = prompts, reward_functions
        self.executor = ThreadPoolExecutor(max_workers=config.max_concurrent_requests, thread_name_prefix="eval")

    async def run(self) -> None:
        """Evaluate each requested step until cancelled (the rollout process's shutdown)."""
        try:
            while True:
                try:
                    step, version = self.board.requests.get_nowait()
                except queue.Empty:
                    await asyncio.sleep(POLL_S)
                    continue
                await self.evaluate_logged(step, version)
        finally:
            self.executor.shutdown(wait=False, cancel_futures=True)

    async def evaluate_logged(self, step: int, version: int) -> dict[str, float] | None:
        """:meth:`evaluate`, its metrics put in the rollout's window tagged with ``step``
        (``grpo_core.tracking.metrics.at_step``: the trainer logs them at that step). A failure of the servers or of
        user code is logged and counted (``eval/failed_count`` at that step) instead of ending the run; None then."""
        start = time.monotonic()
        window = self.loop.window
        try:
            metrics = await self.evaluate(step, version)
        except (ServingError, UserCodeError, RolloutError) as exc:
            logger.warning("evaluation at step %d (policy version %d) failed: %s", step, version, exc)
            window.add(at_step("eval/failed_count", step), 1)
            return None
        metrics["eval/duration_s"] = time.monotonic() - start
        logger.info("evaluation at step %d (policy version %d): %s", step, version, metrics)
        for name, value in metrics.items():
            window.add(at_step(name, step), value)
        return metrics

    async def evaluate(self, step: int, version: int) -> dict[str, float]:
        """Sample and score every eval prompt with policy version ``version``; returns ``eval/*``."""
        cfg, limit = self.config, asyncio.Semaphore(self.config.max_concurrent_requests)

        async def one(i: int) -> np.ndarray:
            async with limit:
                return await self._prompt_rewards(i, step, version)

        rewards = await asyncio.gather(*(one(i) for i in range(len(self.prompts))))
        metrics = eval_metrics(list(rewards), cfg.ks(), cfg.correct_above)
        metrics["eval/policy_version"] = float(version)
        return metrics

    async def _prompt_rewards(self, i: int, step: int, version: int) -> np.ndarray:
        """``float64[num_samples]`` rewards of prompt ``i``'s samples (NaN = unscored)."""
        cfg, ro, runtime = self.config, self.rollout, self.loop.runtime
        row, messages, ids = self.prompts[i]
        budget = min(cfg.max_completion_length or ro.max_completion_length, runtime.max_model_len - len(ids))
        group_id = EVAL_GROUP_BASE + i
        outs = await runtime.server.complete(
            ids,
            affinity_key=(group_id, version),
            model=self.loop.served_model(version),
            max_tokens=max(budget, 1),
            n=cfg.num_samples,
            temperature=0.0 if cfg.greedy else ro.temperature,
            top_p=1.0 if cfg.greedy else ro.top_p,
            top_k=0 if cfg.greedy else ro.top_k,
            min_p=0.0 if cfg.greedy else ro.min_p,
            seed=request_seed(cfg.seed, group_id, 0, step) % (2**31 - 2**16),
            num_logprobs=0,
            policy_version=None if runtime.lora_name else version,
        )
        rollouts = [
            Rollout(completion=[{"role": "assistant", "content": o.text}], completion_ids=list(o.token_ids), turns=[])
            for o in outs
        ]
        group = RolloutGroup(
            prompt_index=i,
            row_index=i,
            epoch=0,
            row=row,
            prompts=[messages] * len(rollouts),
            rollouts=rollouts,
            sequences=[],
            policy_version=version,
            trainer_step=step,
        )
        # the reward functions' own log_metric values stay out of the training window
        # sync reward functions run in the rollout's worker processes as training's do (signals work there)
        await score_group(
            group, self.reward_functions, self.executor, MetricWindow(), ro.reward_timeout_s, pool=self.loop.reward_pool
        )
        assert group.rewards is not None
        return np.asarray(group.rewards, dtype=np.float64)


def eval_rewards(config: EvalConfig, rollout: RolloutConfig, eval_rollout: RolloutConfig) -> list[Any]:
    """The eval reward functions: ``eval.reward_functions``, else the training ones plus the eval dataset's own
    verifier (``reasoning_gym:``)."""
    if config.reward_functions is not None:
        return [import_object(n, "eval.reward_functions") for n in config.reward_functions]
    rewards = [import_object(n, "rollout.reward_functions") for n in rollout.reward_functions]
    return rewards + [f for f in default_rewards(rollout) + default_rewards(eval_rollout) if f not in rewards]


def eval_dataset_config(config: EvalConfig, rollout: RolloutConfig) -> RolloutConfig:
    """``rollout`` with the eval dataset in place of the training dataset (or mixture), for ``load_dataset``: its
    prompt column is ``eval.prompt_column`` when set; the rollout's other dataset settings (its system prompt, ...)
    apply to it as to the training one."""
    update: dict[str, Any] = {
        "dataset": config.dataset,
        "dataset_size": config.dataset_size,
        "dataset_seed": config.dataset_seed,
        "dataset_kwargs": config.dataset_kwargs,
    }
    if config.prompt_column is not None and "prompt_column" in type(rollout).model_fields:
        update["prompt_column"] = config.prompt_column
    if "datasets" in type(rollout).model_fields:
        update["datasets"] = []
    return rollout.model_copy(update=update)


def eval_rows(config: EvalConfig, rollout: RolloutConfig) -> list[dict[str, Any]]:
    """The eval prompts' rows (the first ``eval.num_prompts``), loaded as ``rollout.dataset`` is.

    Raises:
        ConfigError: the dataset cannot be loaded, has no rows, or a row has no ``prompt``; names ``eval.dataset``.
    """
    column_field = "eval.prompt_column" if config.prompt_column is not None else "rollout.prompt_column"
    data = load_dataset(eval_dataset_config(config, rollout), "eval", column_field)  # errors name eval.dataset
    rows = []
    for row in iter_rows(data):
        if config.num_prompts is not None and len(rows) >= config.num_prompts:
            break
        rows.append(row)
    if not rows:
        raise ConfigError(f"eval.dataset={config.dataset!r} has no rows; name a held-out dataset with prompts")
    missing = next((i for i, r in enumerate(rows) if not r.get("prompt")), None)
    if missing is not None:
        column = config.prompt_column or getattr(rollout, "prompt_column", "prompt")
        raise ConfigError(
            f"eval.dataset={config.dataset!r}: row {missing} has no {column!r} (a string or a list of "
            f"{{'role', 'content'}} messages); evaluation samples each row's prompt: set {column_field} to the "
            "column holding it"
        )
    return rows


def build_evaluator(config: EvalConfig, rollout: RolloutConfig, loop: RolloutLoop, board: EvalBoard) -> EvalRunner:
    """The :class:`EvalRunner` of a run: its rows loaded and rendered once with the loop's chat template. A prompt
    that leaves no room for a completion in the server's context (``max_model_len``) is left out, with a warning.

    Raises:
        ConfigError: see :func:`eval_rows`; a reward function cannot be imported; every prompt is too long.
    """
    eval_rollout = eval_dataset_config(config, rollout)
    rows = eval_rows(config, rollout)
    prompts, too_long = [], []
    for index, row in enumerate(rows):
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        ids = loop.render(messages)
        if len(ids) >= loop.runtime.max_model_len - 1:
            too_long.append(index)
            continue
        prompts.append((row, messages, ids))
    if too_long:
        logger.warning(
            "eval: %d prompts (rows %s) leave no room for a completion in max_model_len=%d tokens; not evaluated",
            len(too_long),
            too_long[:10],
            loop.runtime.max_model_len,
        )
    if not prompts:
        raise ConfigError(
            f"eval.dataset={config.dataset!r}: every prompt is longer than the servers' context "
            f"({loop.runtime.max_model_len} tokens); raise server.max_model_len or shorten the prompts"
        )
    rewards = eval_rewards(config, rollout, eval_rollout)
    if not rewards:
        logger.warning("eval: no reward function scores the eval samples; every eval/* reward is NaN")
    logger.info("eval: %d held-out prompts, %d samples each", len(prompts), config.num_samples)
    return EvalRunner(config, rollout, loop, board, prompts, rewards)
