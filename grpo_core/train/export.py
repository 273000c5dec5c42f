"""The trained policy as Hugging Face folders: LoRA adapters (PEFT ``save_pretrained``) and the final model.

Both are written by rank 0 from a gathered full state dict into a ``.tmp`` sibling and published by
rename, so a reader (a server loading an adapter version, the flow logging the final model) never
sees a half-written folder.

* :func:`save_adapter`: ``PeftModel.save_pretrained`` (``adapter_config.json`` with PEFT's own
  metadata, ``adapter_model.safetensors``, PEFT's model card); vLLM, the embedded server and
  ``PeftModel.from_pretrained`` load it.
* :func:`export_final_model`: at the end of training, ``<output_dir>/final_model/``: the full model
  through ``save_pretrained`` (sharded by ``export.max_shard_size`` with a
  ``model.safetensors.index.json``, in the base model's dtype, with its generation config) or the
  LoRA adapter, plus the tokenizer; ``AutoModelForCausalLM.from_pretrained`` (or
  ``PeftModel.from_pretrained`` on the base model) loads it.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo_core.config import TrainerProcessConfig
from grpo_core.run.layout import FINAL_MODEL_DIR

if TYPE_CHECKING:
    from peft import PeftModel

    from .policy import Policy


logger = logging.getLogger(__name__)


def publish(tmp: Path, final: Path) -> Path:
    """Replace ``final`` by the finished folder ``tmp`` (rename; the old folder is removed first)."""
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def _fresh_tmp(final: Path) -> Path:
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def save_adapter(
    peft_model: PeftModel,
    state_dict: dict[str, torch.Tensor],
    out: Path,
    rename: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write a PEFT adapter folder with ``PeftModel.save_pretrained`` from a full (gathered) state dict.

    Args:
        peft_model: the trainer's PEFT-wrapped LM (FSDP-sharded is fine: only its config and adapter
            names are read; the tensors come from ``state_dict``).
        state_dict: full state dict of ``peft_model`` (CPU tensors; keys as ``peft_model.state_dict()``).
        out: the adapter folder to publish.
        rename: maps the saved adapter's tensors to other keys before the folder is published (a VLM's
            adapter under the checkpoint's module names, ``LoraAdapterSync.checkpoint_keys``).

    Returns:
        ``out``.
    """
    tmp = _fresh_tmp(out)
    peft_model.save_pretrained(str(tmp), state_dict=state_dict, safe_serialization=True)
    if rename is not None:
        from safetensors.torch import load_file, save_file

        file = tmp / "adapter_model.safetensors"
        save_file(rename(load_file(str(file))), str(file), metadata={"format": "pt"})
    return publish(tmp, out)


def _base_dtype(base_dir: Path, trained: torch.dtype) -> torch.dtype:
    """The dtype the base checkpoint was stored in (``config.json`` ``dtype``/``torch_dtype``), else ``trained``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base_dir)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else trained


def save_full_model(base_dir: Path, state_dict: dict[str, torch.Tensor], out: Path, max_shard_size: str) -> Path:
    """``save_pretrained`` of the base architecture holding ``state_dict`` (no second copy of the weights).

    The model is built on the meta device and the (CPU) tensors are assigned into it, cast to the base
    checkpoint's dtype in place (``state_dict``'s entries are replaced, so peak memory stays near one copy);
    tied weights are re-tied from the config.

    Args:
        base_dir: the base model folder (config, generation config).
        state_dict: full state dict with Hugging Face parameter names.
        out: folder to write (not published: the caller renames it).
        max_shard_size: e.g. ``"5GB"``; larger models are split with an index file.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(base_dir)
    dtype = _base_dtype(base_dir, next(iter(state_dict.values())).dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name in list(state_dict):  # cast entry by entry: the full-precision tensors are freed as we go
        state_dict[name] = state_dict[name].to(dtype)
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"trained weights do not match {base_dir}: missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    model.tie_weights()
    if (base_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(base_dir)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    return out


def save_tokenizer(base_dir: Path, out: Path) -> None:
    """Copy the base model's tokenizer (and chat template) into ``out`` with ``save_pretrained``.

    A byte-level BPE tokenizer is saved with ``clean_up_tokenization_spaces=False``: WordPiece's space
    clean-up would corrupt its text, and transformers warns on every decode and skips it anyway.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        tokenizer.clean_up_tokenization_spaces = False
    tokenizer.save_pretrained(str(out))


def _is_vision_language(base_dir: Path) -> bool:
    from transformers import AutoConfig

    from grpo_core.models.text_model import is_vision_language

    return is_vision_language(AutoConfig.from_pretrained(base_dir))


def export_final_model(
    policy: Policy, cfg: TrainerProcessConfig, state_dict: dict[str, torch.Tensor] | None
) -> Path | None:
    """Write ``<train.output_dir>/final_model`` from the gathered state dict (rank 0 passes it; others None).

    Returns:
        The published folder on rank 0, None elsewhere.
    """
    if state_dict is None:
        return None
    from grpo_core.models import resolve_model_dir

    base_dir = resolve_model_dir(cfg.model)
    final = Path(cfg.train.output_dir) / FINAL_MODEL_DIR
    tmp = _fresh_tmp(final)
    if cfg.train.lora.enabled:
        policy.lm.save_pretrained(str(tmp), state_dict=state_dict, safe_serialization=True)
    elif _is_vision_language(base_dir):  # the language model under the checkpoint's names, tower kept
        from grpo_core.models.text_model import checkpoint_name_map, write_trained_checkpoint

        name_map = checkpoint_name_map(policy.base(), base_dir)
        renamed = {name_map.get(k, k): v for k, v in state_dict.items()}
        write_trained_checkpoint(base_dir, renamed, tmp, cfg.export.max_shard_size)
    else:
        save_full_model(base_dir, state_dict, tmp, cfg.export.max_shard_size)
    save_tokenizer(base_dir, tmp)
    logger.info("exported the trained %s to %s", "adapter" if cfg.train.lora.enabled else "model", final)
    return publish(tmp, final)
