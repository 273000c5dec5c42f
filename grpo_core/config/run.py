"""The root ``RunConfig``: sections, algorithm presets and the cross-section checks."""

from __future__ import annotations

import logging
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    model_validator,
)

from grpo_core.config.base import LOOPBACK_HOSTS, _changed, _Strict, _warn_unused, url_port
from grpo_core.config.evaluation import EvalConfig
from grpo_core.config.rollout import KWARGS_FORMS, RolloutConfig, dataset_form, dataset_identity
from grpo_core.config.security import TLSConfig
from grpo_core.config.server import ModelConfig, ServerConfig
from grpo_core.config.tracking import FlowConfig, TrackingConfig
from grpo_core.config.train import ExportConfig, PackingConfig, TrainConfig
from grpo_core.config.views import (
    TRAINER_EVAL_FIELDS,
    TRAINER_EXPORT_FIELDS,
    TRAINER_PACKING_FIELDS,
    TRAINER_ROLLOUT_FIELDS,
    TRAINER_SERVER_FIELDS,
    RolloutProcessConfig,
    TrainerProcessConfig,
    _check_trainer_fields,
    _refuse_masked,
)
from grpo_core.errors import ConfigError
from grpo_core.run.layout import ADAPTER_DIR, WEIGHTS_DIR

logger = logging.getLogger(__name__)


def _check_fixed_ports(cfg: RunConfig) -> None:
    """Refuse two of the run's listeners on one fixed port of the flow's host: the replicas it starts
    (``server.port`` + i) or those of ``server.urls`` on loopback, the router (``server.router_port``) and the rollout's
    Flight server
    (``rollout.flight_port``); the later one would fail to start after the others (0 = a free port, never shared).

    Raises:
        ConfigError: naming both settings and the port.
    """
    server, taken = cfg.server, {}
    if server.starts_here() and server.port:
        taken.update(
            {
                server.port + i: "server.port" if i == 0 else f"server.port + {i} (replica {i})"
                for i in range(server.num_replicas)
            }
        )
    for i, url in enumerate(server.urls):  # a replica on this host
        parts = urllib.parse.urlsplit(url)
        if parts.hostname in LOOPBACK_HOSTS:
            taken[url_port(parts)] = f"the port of server.urls[{i}]"
    for port, name in ((server.router_port, "server.router_port"), (cfg.rollout.flight_port, "rollout.flight_port")):
        if not port:
            continue
        if port in taken:
            raise ConfigError(
                f"{name} ({port}) is also {taken[port]}: two of the run's listeners cannot share a "
                f"port; choose another {name} (0 = a free one)"
            )
        taken[port] = name


#: Tracking settings only an MLflow-tracked run reads (``tracking.enabled``).
TRACKING_ONLY_FIELDS = (
    "registered_model_name",
    "registered_model_alias",
    "log_model",
    "log_completions",
    "log_system_metrics",
    "system_metrics_interval_s",
    "checkpoint_artifact_max_mib",
)


#: ``algorithm`` presets: the fields each sets, by section (docs/algorithms.md gives the papers).
ALGORITHM_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "grpo": {},
    "dapo": {
        "train": {"score_centering": False, "loss_type": "grpo", "epsilon": 0.2, "epsilon_high": 0.28},
        "rollout": {
            "scale_rewards": "group",
            "mask_truncated_completions": True,
            "overlong_buffer_len": "auto",
            "overlong_penalty_factor": 1.0,
        },
    },
    "dr_grpo": {
        "train": {"score_centering": False, "loss_type": "grpo"},
        "rollout": {"scale_rewards": "none"},
    },
    "gspo": {
        "train": {"score_centering": False, "loss_type": "gspo", "epsilon": 3e-4, "epsilon_high": 4e-4},
    },
    "cispo": {
        "train": {
            "score_centering": False,
            "loss_type": "cispo",
            "epsilon": 1.0,
            "epsilon_high": 5.0,
            "clip_max": 10.0,
        },
    },
}


def _check_eval_fields(cfg: RunConfig) -> None:
    """Cross-section checks of ``eval`` (its own fields: :class:`EvalConfig`): an eval completion leaves room for a
    prompt; an ``every_steps`` no step reaches, and an eval dataset that is the training one, are warned about.

    Raises:
        ConfigError: ``eval.max_completion_length`` >= ``server.max_model_len`` (names both and the largest value).
    """
    ev, rollout, max_len = cfg.eval, cfg.rollout, cfg.server.max_model_len
    if not ev.enabled:
        return
    if ev.max_completion_length is not None and ev.max_completion_length >= max_len:
        raise ConfigError(
            f"eval.max_completion_length ({ev.max_completion_length}) must be below server.max_model_len ({max_len}) "
            f"to leave room for the prompt: set eval.max_completion_length to at most {max_len - 1} (a one-token "
            "prompt; `grpo validate` measures the eval prompts and names the largest value that fits them), or "
            "raise server.max_model_len"
        )
    if ev.at_end and ev.every_steps is not None and ev.every_steps > cfg.train.max_steps:
        logger.warning(
            f"eval.every_steps ({ev.every_steps}) is above train.max_steps ({cfg.train.max_steps}): no step "
            "reaches it, so the run evaluates once, at the end (eval.at_end); lower eval.every_steps to evaluate "
            "during training, or unset it"
        )
    training = [(rollout.dataset, "rollout.dataset")] + [
        (d.path, f"rollout.datasets[{i}].path") for i, d in enumerate(rollout.datasets)
    ]
    held_out = None if ev.dataset is None else dataset_identity(ev.dataset)
    for spec, field in training:
        if spec is None or dataset_identity(spec) != held_out:
            continue
        generated = spec.startswith("reasoning_gym:")
        if generated and ev.dataset_seed != rollout.dataset_seed:
            continue  # another seed draws other problems
        if generated:
            same, fix = (
                f"eval.dataset_seed equals rollout.dataset_seed ({ev.dataset_seed}) on the same task {ev.dataset!r}",
                "give eval.dataset_seed another value",
            )
        else:
            spelled = "" if spec == ev.dataset else f" and {ev.dataset!r} read the same file"
            same, fix = f"eval.dataset is {field} ({spec!r}{spelled})", "point eval.dataset at held-out prompts"
        logger.warning(
            f"{same}: the held-out set is not held out (its prompts are training prompts, so eval/* measures "
            f"recall of trained prompts); {fix}"
        )


def apply_algorithm_preset(data: Any) -> Any:
    """A run config's input with its ``algorithm`` preset's fields filled in where the input leaves them unset.

    Args:
        data: the raw run config (a dict; anything else is returned as it is for pydantic to refuse).

    Returns:
        A copy of ``data`` whose sections hold the preset's values for the fields they did not set. A field the
        input sets to another value than the preset's is logged as a warning (once per process), naming the field
        and both values.

    Raises:
        ConfigError: an unknown preset name (lists the valid ones).
    """
    if not isinstance(data, dict):
        return data
    name = data.get("algorithm", "grpo")
    if name not in ALGORITHM_PRESETS:
        raise ConfigError(f"algorithm: {name!r} is not a preset; choose one of {', '.join(ALGORITHM_PRESETS)}")
    data = dict(data)
    for section, values in ALGORITHM_PRESETS[name].items():
        given = data.get(section)
        if isinstance(given, BaseModel):
            given = given.model_dump(exclude_unset=True)
        if given is None:
            given = {}
        if not isinstance(given, dict):
            continue  # pydantic refuses it, naming the section
        for field, value in values.items():
            if field in given and given[field] != value:
                _warn_preset_override(name, f"{section}.{field}", value, given[field])
        data[section] = {**values, **given}
    return data


def _warn_preset_override(preset: str, path: str, preset_value: Any, value: Any) -> None:
    """Log that the config sets ``path``, a field the ``algorithm`` preset sets, to another value (once per process,
    as every config warning: grpo_core/config/shown_once.py)."""
    logger.warning(
        f"algorithm: {preset} sets {path}: {preset_value!r}, but the config sets {value!r}; the config's value is "
        f"used (drop {path} to keep the preset's)"
    )


class RunConfig(_Strict):
    """Root config of one grpo-flow run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """Generation server(s)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout sampling settings and limits."""
    packing: PackingConfig = Field(default_factory=PackingConfig)
    """Packing of samples into rows."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """The trainer."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """MLflow tracking."""
    export: ExportConfig = Field(default_factory=ExportConfig)
    """The exported model (Hugging Face folder, model card, Hub push)."""
    flow: FlowConfig = Field(default_factory=FlowConfig)
    """How the Prefect flow schedules the run."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation during training (docs/evaluation.md); off while ``eval.dataset`` is unset."""
    tls: TLSConfig = Field(default_factory=TLSConfig)
    """TLS of the run's generation servers, router and Flight server (docs/security.md); off while
    ``tls.cert_file`` is unset."""
    resume_from: str | None = None
    """MLflow run id whose latest checkpoint this run starts from (a new run continuing an old one)."""
    algorithm: str = "grpo"
    """Named preset of the loss and advantage settings (:data:`ALGORITHM_PRESETS`, docs/algorithms.md): ``grpo``
    (the defaults), ``dapo``, ``dr_grpo``, ``gspo``, ``cispo``. It fills in only the fields the config leaves unset;
    a field set in the config or by an override wins."""

    @model_validator(mode="before")
    @classmethod
    def _apply_algorithm_preset(cls, data: Any) -> Any:
        return apply_algorithm_preset(data)

    @model_validator(mode="after")
    def _check_cross_fields(self) -> RunConfig:
        _refuse_masked(self)
        _check_trainer_fields(self)
        server, rollout = self.server, self.rollout
        if rollout.max_completion_length >= server.max_model_len:
            raise ConfigError(
                f"rollout.max_completion_length ({rollout.max_completion_length}) must be below "
                f"server.max_model_len ({server.max_model_len}) to leave room for the prompt; "
                "raise server.max_model_len or lower rollout.max_completion_length"
            )
        if rollout.top_p < 1.0 and rollout.top_k == 0:
            raise ConfigError(
                "rollout.top_p < 1 needs rollout.top_k > 0 (vLLM bounds the candidate set by top_k); "
                "set rollout.top_k, e.g. 512"
            )
        if rollout.num_sampler_logprobs > server.max_logprobs:
            raise ConfigError(
                f"rollout.num_sampler_logprobs ({rollout.num_sampler_logprobs}) exceeds "
                f"server.max_logprobs ({server.max_logprobs}); raise server.max_logprobs"
            )
        if self.train.lora.enabled and server.max_loras is not None and server.max_loras < rollout.max_staleness + 2:
            raise ConfigError(
                f"server.max_loras ({server.max_loras}) must be >= rollout.max_staleness + 2 "
                f"({rollout.max_staleness + 2}): the trainer keeps max_staleness + 1 versions and loads the "
                "next before unloading the oldest; raise server.max_loras or leave it unset"
            )
        if self.packing.token_budget is not None and self.packing.token_budget < server.max_model_len:
            logger.warning(
                "packing.token_budget (%d) < server.max_model_len (%d): samples longer than the budget are dropped",
                self.packing.token_budget,
                server.max_model_len,
            )
        if server.deployment and server.urls:
            raise ConfigError(
                f"server.deployment ({server.deployment!r}) starts the replicas and server.urls names "
                "replicas already running; set one of them"
            )
        needed = server.num_replicas * server.tensor_parallel_size
        if server.gpu_ids is not None and len(server.gpu_ids) < needed:
            raise ConfigError(
                f"server.gpu_ids lists {len(server.gpu_ids)} GPUs but server.num_replicas * "
                f"server.tensor_parallel_size = {needed} (one entry per replica GPU; a GPU may be listed again "
                "to hold another replica): list more GPUs or lower num_replicas"
            )
        if server.gpu_ids is not None and len(server.gpu_ids) > needed and not server.urls:  # urls: warned unused
            raise ConfigError(
                f"server.gpu_ids lists {len(server.gpu_ids)} GPUs but server.num_replicas * "
                f"server.tensor_parallel_size = {needed}: the last {len(server.gpu_ids) - needed} would hold no "
                f"replica; list {needed}, or raise server.num_replicas to use them"
            )
        _check_fixed_ports(self)
        ev = self.eval
        if ev.enabled and not ev.at_end and ev.every_steps is not None and ev.every_steps > self.train.max_steps:
            raise ConfigError(
                f"eval.every_steps ({ev.every_steps}) is above train.max_steps ({self.train.max_steps}) and "
                "eval.at_end is false: the run would never evaluate eval.dataset; lower eval.every_steps or set "
                "eval.at_end: true"
            )
        _check_eval_fields(self)
        if server.gpu_ids is not None:
            tp = server.tensor_parallel_size
            for replica in range(server.num_replicas):
                own = server.gpu_ids[replica * tp : (replica + 1) * tp]
                if len(set(own)) < len(own):
                    raise ConfigError(
                        f"server.gpu_ids gives replica {replica} the GPUs {own}: the "
                        f"tensor_parallel_size ({tp}) GPUs of one replica must differ"
                    )
            sharing = max(Counter(server.gpu_ids[:needed]).values())  # replicas on the busiest GPU
            if sharing > 1 and server.gpu_memory_utilization * sharing > 0.95:
                raise ConfigError(
                    f"server.gpu_ids puts {sharing} replicas on one GPU, "
                    f"each taking server.gpu_memory_utilization ({server.gpu_memory_utilization}) of it: lower "
                    "gpu_memory_utilization so that they fit together"
                )
        _warn_unused(self.unused_settings())
        return self

    def unused_settings(self) -> dict[str, str]:
        """Settings off their defaults that nothing reads with the rest of the run config: field path -> why
        (``server.*`` ones: :meth:`ServerConfig.unused_settings`). Warned about at validation."""
        rollout, train, unused = self.rollout, self.train, {}
        generated = (rollout.dataset or "").startswith("reasoning_gym:")
        if not generated and "dataset_seed" in _changed(rollout):
            unused["rollout.dataset_seed"] = "reasoning_gym: datasets only"
        if rollout.dataset is not None and not generated and "dataset_size" in _changed(rollout):
            unused["rollout.dataset_size"] = (
                "read by reasoning_gym: datasets and by an environment's epoch without a dataset only"
            )
        if not rollout.shuffle and "shuffle_seed" in _changed(rollout):
            unused["rollout.shuffle_seed"] = "rollout.shuffle is false"
        kwargs_only = "read by reasoning_gym: and module:callable datasets only"
        if rollout.dataset and rollout.dataset_kwargs and dataset_form(rollout.dataset)[0] not in KWARGS_FORMS:
            unused["rollout.dataset_kwargs"] = kwargs_only
        for i, source in enumerate(rollout.datasets):
            if source.dataset_kwargs and dataset_form(source.path)[0] not in KWARGS_FORMS:
                unused[f"rollout.datasets[{i}].dataset_kwargs"] = kwargs_only
        if self.eval.dataset and self.eval.dataset_kwargs and dataset_form(self.eval.dataset)[0] not in KWARGS_FORMS:
            unused["eval.dataset_kwargs"] = kwargs_only
        if self.eval.dataset and not self.eval.dataset.startswith("reasoning_gym:"):
            unused.update(
                {
                    f"eval.{name}": "read by reasoning_gym: eval datasets only"
                    for name in ("dataset_size", "dataset_seed")
                    if name in _changed(self.eval)
                }
            )
        if train.gradient_checkpointing != "selective" and "selective_checkpointing" in _changed(train):
            unused["train.selective_checkpointing"] = "with train.gradient_checkpointing: selective only"
        if train.nnodes == 1 and train.rdzv_endpoint:
            unused["train.rdzv_endpoint"] = "with train.nnodes > 1 only"
        if train.nnodes == 1 and "rdzv_timeout_s" in _changed(train):
            unused["train.rdzv_timeout_s"] = "with train.nnodes > 1 only"
        if train.nnodes == 1 and "shared_folder_wait_s" in _changed(train):
            unused["train.shared_folder_wait_s"] = "with train.nnodes > 1 only"
        if train.lora.enabled and train.lora.dropout > 0:
            unused["train.lora.dropout"] = "the trainer's forward has no dropout, its log-probs must be the sampler's"
        if not train.lora.enabled:
            why = "train.lora.enabled is false"
            unused.update({f"train.lora.{name}": why for name in sorted(_changed(train.lora))})
            unused.update(
                {f"train.{name}": why for name in ("adapter_store", "adapter_store_served_as") if getattr(train, name)}
            )
        if not self.export.push_to_hub:
            unused.update(
                {
                    f"export.{name}": "export.push_to_hub is false"
                    for name in ("hub_private_repo", "hub_revision")
                    if name in _changed(self.export)
                }
            )
        if not self.tracking.enabled:
            unused.update(
                {
                    f"tracking.{name}": "tracking.enabled is false"
                    for name in TRACKING_ONLY_FIELDS
                    if name in _changed(self.tracking)
                }
            )
        if not self.eval.enabled:
            unused.update({f"eval.{name}": "eval.dataset is unset" for name in sorted(_changed(self.eval))})
        if self.flow.concurrency_limit is None and self.flow.concurrency_slots is not None:
            unused["flow.concurrency_slots"] = "flow.concurrency_limit is None"
        return unused

    def token_budget(self) -> int:
        """Row token budget actually used: ``packing.token_budget`` or ``server.max_model_len``."""
        return self.packing.token_budget or self.server.max_model_len

    def served_model_name(self) -> str:
        """Name the base model answers to in ``"model"`` fields."""
        return self.server.served_model_name or self.model.name

    def rollout_process(self) -> RolloutProcessConfig:
        """The rollout process's sub-config (its section plus the values it reads from their owners)."""
        lora, tracking = self.train.lora, self.tracking
        return RolloutProcessConfig(
            model=self.model,
            rollout=self.rollout,
            server=self.server,
            served_model_name=self.served_model_name(),
            max_model_len=self.server.max_model_len,
            adapter_name=lora.name if lora.enabled else None,
            log_completions=tracking.log_completions,
            num_completions_to_print=tracking.num_completions_to_print,
            eval=self.eval,
            max_steps=self.train.max_steps,
        )

    def trainer_process(self) -> TrainerProcessConfig:
        """The trainer's sub-config (its section plus the values it reads from their owners)."""

        def pick(section: BaseModel, names: tuple[str, ...]) -> Any:  # a dict pydantic validates into the view
            return {name: getattr(section, name) for name in names}

        return TrainerProcessConfig(
            model=self.model,
            train=self.train,
            tracking=self.tracking,
            rollout=pick(self.rollout, TRAINER_ROLLOUT_FIELDS),
            server=pick(self.server, TRAINER_SERVER_FIELDS),
            packing=pick(self.packing, TRAINER_PACKING_FIELDS),
            export=pick(self.export, TRAINER_EXPORT_FIELDS),
            eval=pick(self.eval, TRAINER_EVAL_FIELDS),
            token_budget=self.token_budget(),
        )

    def serves_lora(self) -> bool:
        """Whether the servers load LoRA adapters at run time (``--enable-lora``): exactly when the trainer trains
        one (``train.lora.enabled``, the owner)."""
        return self.train.lora.enabled

    def max_loras(self) -> int:
        """Adapters the server keeps resident: ``server.max_loras`` or max_staleness + 2."""
        return self.server.max_loras or self.rollout.max_staleness + 2

    def adapter_dir(self) -> Path:
        """The run's LoRA adapter folder (``<train.output_dir>/.vllm_lora``): the only one its servers load from."""
        return self.train.output_dir / ADAPTER_DIR

    def served_adapter_root(self) -> str:
        """Where the servers load LoRA adapters from (the only place their guard allows):
        ``train.adapter_store_served_as``, else ``train.adapter_store``, else :meth:`adapter_dir` (absolute)."""
        tc = self.train
        return tc.adapter_store_served_as or tc.adapter_store or str(self.adapter_dir().resolve())

    def weights_dir(self) -> Path:
        """The run's full-weight folder (``<train.output_dir>/.weights``): the only one its servers read from."""
        return self.train.output_dir / WEIGHTS_DIR
