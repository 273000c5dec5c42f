"""The fingerprint of a run in each checkpoint: the dataset and the training-relevant config (``fingerprint.json``).

On resume (:func:`check_resume`) the fingerprint of the checkpoint is compared with the current config:

* **unsafe** changes make the checkpoint belong to a different run and are refused with a diff: another
  model (name, revision, seed of a random init), parameter dtype, LoRA shape, group size, another loss
  (``train.loss_type``: the checkpoint's optimizer moments belong to another objective), or another
  dataset (its spec, size, seed and options, its order: ``rollout.shuffle`` and its seed; the SHA-256 of a
  data file or of ``train.samples_path``; a mixture's sources and weights, the prompt column and system prompt)
  — prompt indices in the checkpoint would point at other prompts;
* **safe** changes are applied and logged: optimizer settings (the trainer puts the config's learning
  rate, betas and weight decay into the restored optimizer, see ``Trainer._apply_optimizer_config``),
  schedule, clipping, the other loss settings (the masked range, the trust region, truncated IS, the sequence
  masks, the KL coefficient, the advantages' ``rollout.scale_rewards``, ``rollout.mask_truncated_completions``
  and the soft overlong punishment), step counts.

A ``module:callable`` dataset is fingerprinted by its name and options only (its rows are built by the
rollout process).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from grpo_core.config import TrainerProcessConfig, dataset_form, user_path
from grpo_core.errors import ConfigError
from grpo_core.run.layout import FINGERPRINT as FINGERPRINT_FILE
from grpo_core.security.redact import mask_secret_keys

logger = logging.getLogger(__name__)


UNSAFE = (
    "model.name",
    "model.revision",
    "model.seed",
    "train.dtype",
    "train.lora.enabled",
    "train.lora.r",
    "train.lora.alpha",
    "train.lora.target_modules",
    "rollout.num_generations",
    "train.loss_type",
)
SAFE = (
    "train.learning_rate",
    "train.adam_betas",
    "train.weight_decay",
    "train.lr_scheduler",
    "train.warmup_steps",
    "train.max_steps",
    "train.max_grad_norm",
    "train.clip_min",
    "train.clip_max",
    "train.epsilon",
    "train.epsilon_high",
    "train.score_centering",
    "train.tis_cap",
    "train.sequence_mask",
    "train.sequence_mask_min",
    "train.sequence_mask_max",
    "train.kl_coef",
    "train.router_aux_loss_coef",
    "train.gradient_accumulation_steps",
    "train.loss_normalization",
    "train.save_steps",
    "train.save_total_limit",
    "train.weight_sync_steps",
    "rollout.max_staleness",
    "rollout.temperature",
    "rollout.scale_rewards",
    "rollout.mask_truncated_completions",
    "rollout.reward_weights",
    "rollout.overlong_buffer_len",
    "rollout.overlong_penalty_factor",
)


#: What a checkpoint written before ``rollout.shuffle`` existed trained on: the dataset's order.
BEFORE_SHUFFLE = {"rollout.shuffle": False, "rollout.shuffle_seed": None}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _data_file(spec: str) -> Path | None:
    """The one local file a dataset spec names (a path or a ``json:``/``csv:``/``parquet:``/``arrow:`` file)."""
    form, rest = dataset_form(spec)
    path = user_path(rest)
    return path if form in ("path", "json", "csv", "parquet", "arrow") and path.is_file() else None


def _get(data: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def dataset_fingerprint(cfg: TrainerProcessConfig) -> dict[str, Any]:
    """What identifies the prompts a run trains on: the dataset spec and options, and file digests."""
    ro, tc = cfg.rollout, cfg.train
    out: dict[str, Any] = {
        "rollout.dataset": ro.dataset,
        "rollout.dataset_size": ro.dataset_size,
        "rollout.dataset_seed": ro.dataset_seed,
        "rollout.dataset_kwargs": mask_secret_keys(ro.dataset_kwargs),  # fingerprint.json travels with checkpoints
        "rollout.shuffle": ro.shuffle,  # the prompt order: prompt indices of another order are other prompts
        "rollout.shuffle_seed": ro.shuffle_seed if ro.shuffle else None,
    }
    # Issue 27's data settings, recorded when not their default (a checkpoint without them trained with their
    # defaults): the prompt column and system prompt change the prompts, a mixture's sources and weights the order.
    fields = type(ro).model_fields
    for name in ("dataset_split", "prompt_column", "system_prompt", "column_types", "mixture_epoch_size"):
        if getattr(ro, name) != fields[name].get_default(call_default_factory=True):
            out[f"rollout.{name}"] = getattr(ro, name)
    if ro.datasets:
        out["rollout.datasets"] = [mask_secret_keys(s.model_dump()) for s in ro.datasets]
        for i, source in enumerate(ro.datasets):
            path = _data_file(source.path)
            if path is not None:
                out[f"rollout.datasets[{i}] sha256"] = _sha256(path)
    data_file = _data_file(ro.dataset) if ro.dataset else None
    if data_file is not None:
        out["rollout.dataset sha256"] = _sha256(data_file)
    if tc.samples_path is not None and Path(tc.samples_path).is_file():
        out["train.samples_path sha256"] = _sha256(Path(tc.samples_path))
    return out


def fingerprint(cfg: TrainerProcessConfig) -> dict[str, Any]:
    """``{"dataset": {...}, "config": {field: value}}`` of ``cfg`` (the trainer's sub-config, whose fields keep
    their run-config paths; JSON values)."""
    data = json.loads(cfg.model_dump_json())
    return {"dataset": dataset_fingerprint(cfg), "config": {k: _get(data, k) for k in UNSAFE + SAFE}}


def fingerprint_text(cfg: TrainerProcessConfig) -> str:
    """The fingerprint as the text of ``fingerprint.json`` (the checkpoint writes it with its other files)."""
    return json.dumps(fingerprint(cfg), indent=1, sort_keys=True)


def check_resume(cfg: TrainerProcessConfig, checkpoint_dir: Path) -> list[str]:
    """Compare ``cfg`` (``RunConfig.trainer_process()``) with the fingerprint stored in a checkpoint.

    Returns:
        The safe changes (``"field: old -> new"``), which the resumed run applies; each is logged.

    Raises:
        ConfigError: an unsafe change or another dataset; the message lists every difference (a diff) and the
            fix (set the fields back, or start a new run instead of resuming).
    """
    path = Path(checkpoint_dir) / FINGERPRINT_FILE
    if not path.is_file():
        logger.warning(
            "checkpoint %s has no %s (written before fingerprints existed): the config is not compared",
            checkpoint_dir,
            FINGERPRINT_FILE,
        )
        return []
    stored, now = json.loads(path.read_text()), fingerprint(cfg)
    stored["dataset"] = {**BEFORE_SHUFFLE, **stored["dataset"]}
    unsafe = [
        f"  {k}: {stored['dataset'].get(k)!r} -> {v!r}"
        for k, v in now["dataset"].items()
        if stored["dataset"].get(k) != v
    ]
    unsafe += [
        f"  {k}: {stored['config'].get(k)!r} -> {now['config'][k]!r}"
        for k in UNSAFE
        if k in stored["config"] and stored["config"][k] != now["config"][k]
    ]
    if (
        "train.loss_type" in stored["config"]
        and stored["config"]["train.loss_type"] != now["config"]["train.loss_type"]
    ):
        unsafe.append(
            "  (train.loss_type: the checkpoint was trained with another loss; the algorithm preset sets it too, "
            "so set algorithm/train.loss_type back, or start a new run to change the loss)"
        )
    if unsafe:
        raise ConfigError(
            f"resume from {checkpoint_dir} refused: the config trains a different run than the "
            "checkpoint (checkpoint -> config):\n"
            + "\n".join(unsafe)
            + "\nSet these fields back to the checkpoint's values, or start a new run (a new output "
            "folder, no resume_from) to train with them"
        )
    safe = [
        f"{k}: {stored['config'].get(k)!r} -> {now['config'][k]!r}"
        for k in SAFE
        if k in stored["config"] and stored["config"][k] != now["config"][k]
    ]
    for change in safe:
        logger.warning("resume from %s: config change applied: %s", checkpoint_dir, change)
    return safe
