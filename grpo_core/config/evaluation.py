"""The ``eval`` section: held-out evaluation during training (docs/evaluation.md)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from grpo_core.config.base import _Strict
from grpo_core.errors import ConfigError


class EvalConfig(_Strict):
    """Held-out evaluation while training: the rollout process samples a held-out dataset on the same generation
    servers with the current policy version, every ``every_steps`` optimizer steps and at the end, beside the
    training rollouts (it takes no training prompt and no token allowance). Off while ``dataset`` is unset."""

    dataset: str | None = None
    """Held-out prompts, in any form ``rollout.dataset`` takes (``reasoning_gym:TASK``, ``json:PATH``,
    ``module:callable``, ...); None = no evaluation."""
    dataset_size: int = Field(default=100, ge=1)
    """Prompts of a ``reasoning_gym:`` eval dataset."""
    dataset_seed: int = Field(default=12345, ge=0)
    """Seed of a ``reasoning_gym:`` eval dataset: keep it apart from ``rollout.dataset_seed`` so the held-out prompts
    are not the training ones."""
    dataset_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of a ``module:callable`` eval dataset, or the task config of a ``reasoning_gym:`` one."""
    prompt_column: str | None = None
    """Column of ``dataset`` holding each row's prompt, as ``rollout.prompt_column`` (chat messages or a plain
    string); None = ``rollout.prompt_column``."""
    num_prompts: int | None = Field(default=None, ge=1)
    """Evaluate the first ``num_prompts`` rows only; None = every row."""
    every_steps: int | None = Field(default=None, ge=1)
    """Evaluate after every ``every_steps`` optimizer steps (steps N, 2N, ...); None = only at the end."""
    at_end: bool = True
    """Evaluate the final policy when training ends (the trainer waits for it, at most ``final_timeout_s``). False
    needs ``every_steps`` (at most ``train.max_steps``): settings that never evaluate are refused (unset ``dataset``
    to train without evaluation)."""
    greedy: bool = False
    """Sample at temperature 0 (one sample per prompt; ``eval/accuracy`` is the greedy accuracy); false = sample
    ``num_samples`` per prompt with the rollout's sampling settings."""
    num_samples: int = Field(default=1, ge=1)
    """Samples per prompt (n of the pass@k estimator); 1 with ``greedy``."""
    pass_at_k: list[int] | None = None
    """The k of each ``eval/pass_at_k`` metric, each at most ``num_samples`` and listed once; None =
    ``[num_samples]``."""
    reward_functions: list[str] | None = None
    """Reward functions ``module:function`` scoring the eval samples (an empty list is refused); None = the
    training ones (``rollout.reward_functions``, plus the eval dataset's own verifier for ``reasoning_gym:``)."""
    correct_above: float = 0.0
    """A sample is correct when its reward is above this value (reward > 0 by default)."""
    max_completion_length: int | None = Field(default=None, ge=1)
    """Most tokens generated per eval sample, below ``server.max_model_len`` (room for the prompt); None =
    ``rollout.max_completion_length``."""
    max_concurrent_requests: int = Field(default=8, ge=1)
    """Eval requests in flight at once (each asks for ``num_samples`` completions), beside the training rollouts."""
    final_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds the trainer waits at the end for the final evaluation before it finishes without it."""
    seed: int = Field(default=0, ge=0)
    """Base of the eval requests' sampler seeds (request seed = f(seed, prompt, step))."""

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.dataset is not None and self.every_steps is None and not self.at_end:
            raise ConfigError(
                "eval.every_steps is null and eval.at_end is false: the run would never evaluate eval.dataset; set "
                "eval.every_steps (e.g. 50) or eval.at_end: true, or unset eval.dataset to train without evaluation"
            )
        if self.greedy and self.num_samples != 1:
            raise ConfigError(
                f"eval.greedy samples one completion per prompt, but eval.num_samples={self.num_samples}; "
                "set eval.num_samples: 1, or eval.greedy: false for pass@k over sampled completions"
            )
        if self.reward_functions == []:
            raise ConfigError(
                "eval.reward_functions is an empty list: no function would score the eval samples (every "
                "eval/accuracy and eval/pass_at_k would be 0); list 'module:function' reward functions, or unset "
                "eval.reward_functions (null) to score them with the training ones"
            )
        repeated = sorted({k for k in self.pass_at_k or [] if (self.pass_at_k or []).count(k) > 1})
        if repeated:
            raise ConfigError(
                f"eval.pass_at_k={self.pass_at_k} lists {repeated} more than once (each k is one eval/pass_at_k "
                "metric); list each k once"
            )
        too_big = [k for k in self.pass_at_k or [] if not 1 <= k <= self.num_samples]
        if too_big:
            raise ConfigError(
                f"eval.pass_at_k {too_big}: each k must be between 1 and eval.num_samples ({self.num_samples}); "
                "raise eval.num_samples or drop those k"
            )
        return self

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates (``dataset`` is set)."""
        return self.dataset is not None

    def ks(self) -> list[int]:
        """The k of each pass@k metric, sorted and unique."""
        return sorted(set(self.pass_at_k or [self.num_samples]))
