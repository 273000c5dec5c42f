"""Per-process views: what the rollout process and the trainer read, each value taken from its one owner."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    model_validator,
)

from grpo_core.config.base import LOOPBACK_HOSTS, _CandidateFilter, _ServerKey, _Strict, _view
from grpo_core.config.evaluation import EvalConfig
from grpo_core.config.rollout import RolloutConfig
from grpo_core.config.server import ModelConfig, ServerConfig
from grpo_core.config.tracking import TrackingConfig
from grpo_core.config.train import ExportConfig, PackingConfig, TrainConfig
from grpo_core.errors import ConfigError
from grpo_core.security.redact import MASK, secret_fields

logger = logging.getLogger(__name__)


class RolloutProcessConfig(_Strict):
    """What the rollout process reads: its own section, and the few values it needs from other sections, each
    taken from its one owner by :meth:`RunConfig.rollout_process` (the process never sees the whole run config)."""

    model: ModelConfig
    """The policy model (the rollout process loads its tokenizer)."""
    rollout: RolloutConfig
    """The rollout section."""
    server: ServerConfig
    """The server section: the rollout routes its requests over the replicas (``route_imbalance``,
    ``control_retry_s``, ``api_key``)."""
    served_model_name: str
    """Name the base model answers to on the servers (``server.served_model_name`` or ``model.name``)."""
    max_model_len: int = Field(ge=16)
    """``server.max_model_len``: the context length when the server does not report its own."""
    adapter_name: str | None = None
    """``train.lora.name`` when the trainer trains a LoRA adapter (``train.lora.enabled``; version N is served as
    ``{name}-v{N}``), else None (the base model is sampled)."""
    log_completions: bool = False
    """``tracking.log_completions``: keep a sample of each window's completions for the trainer to log."""
    num_completions_to_print: int | None = Field(default=16, ge=1)
    """``tracking.num_completions_to_print``: rows of each window's completion sample; None = all."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """The held-out evaluation the rollout process runs beside the training rollouts (``eval``)."""
    max_steps: int = Field(default=1000, ge=1)
    """``train.max_steps``: the step of the final evaluation (``eval.at_end``)."""


def _refuse_masked(config: BaseModel) -> None:
    """Raise a ConfigError naming the first secret of ``config`` that holds the mask of a saved config."""
    for path, secret in secret_fields(config):
        if MASK in secret.get_secret_value():
            # a field or dict key takes the secret off the command line; an item of a list (extra_args.3) only inline
            parts = path.split(".")
            if any(p.isdigit() for p in parts):
                how = f"--set {'.'.join(p for p in parts if not p.isdigit())}=[...]"
            else:
                how = f"--set {path}=@env:NAME (or @file:PATH, @stdin: off the command line)"
            raise ConfigError(
                f"{path} holds a redacted value ({MASK!r}: a config grpo-flow saved or logged "
                f"keeps no secret); set the real value, e.g. {how}, or (a trainer host "
                f'started by hand) export GRPO_RUN_SECRETS=\'{{"{path}": "..."}}\''
            )


def _check_trainer_fields(config: Any) -> None:
    """Cross-field checks of what the trainer reads (``config.train``, ``config.rollout.num_sampler_logprobs``):
    run on the run config and on the trainer's sub-config alike.

    Raises:
        ConfigError: naming the fields and the fix.
    """
    train = config.train
    if train.clip_min >= train.clip_max:
        raise ConfigError(f"train.clip_min ({train.clip_min}) must be below train.clip_max ({train.clip_max})")
    if train.loss_type != "grpo" and train.score_centering:
        raise ConfigError(
            f"train.loss_type: {train.loss_type} replaces the score-centred gradient: set train.score_centering: false"
        )
    if train.score_centering and config.rollout.num_sampler_logprobs == 0:
        raise ConfigError(
            "train.score_centering needs the sampler's top log-probs: set rollout.num_sampler_logprobs > 0 "
            "(e.g. 8) or train.score_centering: false"
        )
    if train.nnodes > 1 and not train.rdzv_endpoint:
        raise ConfigError(
            f"train.nnodes={train.nnodes} needs train.rdzv_endpoint ('host:port' on the flow's host, "
            "reachable from every trainer host, e.g. 'trainer-0:29400')"
        )
    if train.nnodes > 1 and not train.output_dir.is_absolute():
        logger.warning(
            "train.output_dir=%s is relative: each trainer host resolves it against its own working "
            "folder (train.nnodes=%d); give the shared folder's absolute path",
            train.output_dir,
            train.nnodes,
        )
    if train.nnodes > 1 and train.rdzv_endpoint.rpartition(":")[0].strip("[]").lower() in LOOPBACK_HOSTS:
        logger.warning(
            "train.rdzv_endpoint=%s is a loopback address: only trainer hosts on this machine can join "
            "(train.nnodes=%d); give the host name the other trainer hosts reach",
            train.rdzv_endpoint,
            train.nnodes,
        )
    if train.gpu_ids is not None and len(set(train.gpu_ids)) < train.num_ranks:
        raise ConfigError(
            f"train.gpu_ids lists {len(set(train.gpu_ids))} distinct GPUs but train.num_ranks is "
            f"{train.num_ranks}; list one GPU per rank or lower train.num_ranks"
        )
    if train.gpu_ids is not None and len(train.gpu_ids) > train.num_ranks:
        raise ConfigError(
            f"train.gpu_ids lists {len(train.gpu_ids)} GPUs but train.num_ranks is {train.num_ranks}: the last "
            f"{len(train.gpu_ids) - train.num_ranks} would feed no rank; list {train.num_ranks}, or raise "
            "train.num_ranks to use them"
        )


#: What the trainer reads of sections it does not own, under the owners' field names (see ``TrainerProcessConfig``).
TRAINER_ROLLOUT_FIELDS = (
    "max_staleness",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "num_generations",
    "max_completion_length",
    "num_sampler_logprobs",
    "num_epochs",
    "rollout_worker_timeout_s",
    "dataset",
    "dataset_size",
    "dataset_seed",
    "dataset_kwargs",
    "shuffle",
    "shuffle_seed",
    "dataset_split",
    "prompt_column",
    "system_prompt",
    "column_types",
    "datasets",
    "mixture_epoch_size",
    "scale_rewards",
    "mask_truncated_completions",
    "reward_weights",
    "overlong_buffer_len",
    "overlong_penalty_factor",
)


TRAINER_SERVER_FIELDS = (
    "api_key",
    "route_imbalance",
    "control_retry_s",
    "control_timeout_s",
    "weight_transfer_backend",
)


TRAINER_PACKING_FIELDS = ("backend",)


TRAINER_EXPORT_FIELDS = ("max_shard_size",)


TRAINER_EVAL_FIELDS = ("dataset", "every_steps", "at_end", "final_timeout_s")


if TYPE_CHECKING:  # each view has a subset of its owner's fields, made at runtime (create_model)
    TrainerRolloutView = RolloutConfig
    TrainerServerView = ServerConfig
    TrainerPackingView = PackingConfig
    TrainerExportView = ExportConfig
    TrainerEvalView = EvalConfig
else:
    TrainerRolloutView = _view(
        RolloutConfig,
        TRAINER_ROLLOUT_FIELDS,
        _CandidateFilter,
        "The rollout settings the trainer reads (``rollout.*``, owned by the rollout section): staleness, the "
        "sampler's settings (the log-prob head matches them), the group size, and what identifies the dataset (the "
        "checkpoint's fingerprint).",
    )
    TrainerServerView = _view(
        ServerConfig,
        TRAINER_SERVER_FIELDS,
        _ServerKey,
        "The server settings the trainer's weight sync reads (``server.*``): the bearer token, the control fan-out's "
        "retries and the vLLM weight-transfer backend.",
    )
    TrainerPackingView = _view(
        PackingConfig,
        TRAINER_PACKING_FIELDS,
        _Strict,
        "The packer backend the trainer's planner uses (``packing.backend``).",
    )
    TrainerExportView = _view(
        ExportConfig,
        TRAINER_EXPORT_FIELDS,
        _Strict,
        "The export setting the trainer's final ``save_pretrained`` reads (``export.max_shard_size``).",
    )
    TrainerEvalView = _view(
        EvalConfig,
        TRAINER_EVAL_FIELDS,
        _Strict,
        "The evaluation settings the trainer reads (``eval.*``): when the rollout evaluates and how long the end "
        "waits for it.",
    )


class TrainerProcessConfig(_Strict):
    """What the trainer (every torchrun rank) reads: its own section, and the few values it needs from other
    sections, each taken from its one owner by :meth:`RunConfig.trainer_process` (the trainer never sees the whole
    run config). Borrowed values keep their owners' paths (``rollout.max_staleness``, ``server.api_key``), so errors,
    ``--set`` overrides, secrets and the checkpoint fingerprint name the field a user sets. The flow writes it as
    ``train_config.json``."""

    process: Literal["trainer"] = "trainer"
    """Marks a trainer sub-config file (``python -m grpo_core.train --config`` also takes a whole run config)."""
    model: ModelConfig
    """The policy model."""
    train: TrainConfig
    """The trainer's section."""
    tracking: TrackingConfig
    """MLflow tracking (the trainer logs metrics, checkpoints and the final model)."""
    rollout: TrainerRolloutView
    """The rollout settings the trainer reads."""
    server: TrainerServerView
    """The server settings the weight sync reads."""
    packing: TrainerPackingView
    """The packer backend."""
    export: TrainerExportView
    """The shard size of the exported model."""
    eval: TrainerEvalView = Field(default_factory=lambda: TrainerEvalView())
    """When the rollout evaluates (the trainer logs each evaluation at its step and waits for the last ones)."""
    token_budget: int = Field(ge=16)
    """Row token budget: ``packing.token_budget``, else ``server.max_model_len`` (:meth:`RunConfig.token_budget`)."""

    @model_validator(mode="after")
    def _check_cross_fields(self) -> TrainerProcessConfig:
        _refuse_masked(self)
        _check_trainer_fields(self)
        return self
