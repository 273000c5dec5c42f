"""The language model of a checkpoint, loaded for text-only training and serving.

One loader for the trainer, the embedded server and the benchmarks, so they agree on classes
and parameter names. Causal LMs load as themselves. Vision-language checkpoints (Qwen3.5,
Qwen3-VL, ...) train and serve their language model on text prompts (the seed manual's VLM
section; images are not supported):

* where transformers maps the VLM's config to a causal-LM class (Qwen3.5 → ``Qwen3_5ForCausalLM``),
  that class reads the language model's weights alone; the vision tower is never loaded;
* otherwise (Qwen3-VL) the image-text-to-text class loads on the CPU and every part of its inner
  model besides ``language_model`` (vision tower, merger, projector) is removed before the model
  moves to a device: it takes no device memory, no FSDP shard, no optimizer state, no LoRA
  adapter and no weight sync, and the generation server keeps the tower it loaded itself.

transformers renames some weights on load (Qwen3.5's ``model.language_model.`` → ``model.``);
:func:`checkpoint_name_map` gives each parameter's name in the checkpoint, which is what vLLM's
loader expects from a weight sync.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)


def is_vision_language(config: PretrainedConfig) -> bool:
    """Whether ``config`` describes a vision-language model (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def drop_non_language_parts(model: nn.Module) -> list[str]:
    """Remove every child of the VLM's inner model except ``language_model``; returns their names."""
    inner = model.model
    dropped = [name for name, child in inner.named_children() if name != "language_model" and child is not None]
    for name in dropped:
        setattr(inner, name, None)
    return dropped


def text_model_class(config: PretrainedConfig, where: str | Path) -> type[PreTrainedModel]:
    """The transformers auto class that loads ``config``'s language model (see module docs).

    Raises:
        ConfigError: the architecture has no causal-LM or image-text-to-text class.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    if is_vision_language(config):
        return AutoModelForImageTextToText
    raise ConfigError(
        f"model at {where} (model_type {config.model_type!r}) has no causal-LM or "
        "image-text-to-text class in transformers; use a text-generation model"
    )


def load_text_model(path: str | Path, *, dtype: torch.dtype, attn_implementation: str = "sdpa") -> PreTrainedModel:
    """Load the checkpoint's language model (see module docs) on the CPU.

    Args:
        path: a Hugging Face model folder.
        dtype: parameter dtype.
        attn_implementation: transformers attention implementation (``sdpa``, ``grpo_tree``, ...).

    Returns:
        A causal LM whose ``forward`` takes token ids and returns logits (a VLM class with its vision
        parts removed, for VLMs without a causal-LM class).

    Raises:
        ConfigError: the folder's architecture has no text-generation class, or weights the model
            needs are missing from the checkpoint (they would be trained from random values).
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    cls = text_model_class(AutoConfig.from_pretrained(path), path)
    model, info = cls.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, output_loading_info=True
    )
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ConfigError(
            f"model at {path}: {len(missing)} weights are missing from the checkpoint "
            f"(e.g. {missing[:3]}); they would start from random values. Check the folder's "
            "config.json (e.g. tie_word_embeddings in text_config) and weights"
        )
    if cls is AutoModelForImageTextToText:
        dropped = drop_non_language_parts(model)
        logger.info("%s: training/serving the language model on text; removed %s", type(model).__name__, dropped)
    return model


def text_decoder(model: nn.Module) -> nn.Module:
    """The decoder stack that maps token ids to final hidden states (``model.model`` of a causal
    LM, ``model.model.language_model`` of a VLM)."""
    inner = model.model
    return getattr(inner, "language_model", None) or inner


def checkpoint_keys(path: str | Path) -> set[str]:
    """Tensor names stored in a model folder's safetensors files (headers only; empty if none)."""
    from safetensors import safe_open

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    keys: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


def checkpoint_name_map(model: PreTrainedModel, path: str | Path) -> dict[str, str]:
    """Each parameter's name in the checkpoint at ``path``.

    A name the checkpoint holds maps to itself; otherwise transformers' reverse of the renaming
    it applied on load (``revert_weight_conversion``) gives the checkpoint's name.

    Args:
        model: the transformers model (PEFT wrapper and ``lm.`` prefixes removed).
        path: the folder the model was loaded from.

    Returns:
        ``{model parameter name: checkpoint name}`` for every entry of ``model.state_dict()``.
    """
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    stored = checkpoint_keys(path)
    out = {}
    for name in model.state_dict():
        if name in stored:
            out[name] = name
            continue
        reverted = list(revert_weight_conversion(model, {name: torch.empty(0)}))
        out[name] = reverted[0] if len(reverted) == 1 else name
    return out


def rename_module_key(key: str, name_map: dict[str, str]) -> str:
    """Map a LoRA key under a module path (``P.lora_A.weight``) to the checkpoint's module path,
    as the module's own weight maps (``P.weight`` or PEFT's ``P.base_layer.weight`` → ``Q.…``)."""
    module, sep, rest = key.partition(".lora_")
    if not sep:
        return name_map.get(key, key)
    for suffix in (".weight", ".base_layer.weight"):
        mapped = name_map.get(module + suffix)
        if mapped is not None and mapped.endswith(suffix):
            return mapped[: -len(suffix)] + sep + rest
    return key


def _tied_to_stored(tensors: dict[str, torch.Tensor], key: str, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether ``tensors[key]`` equals a tensor the original checkpoint stores (every stored name is in ``tensors``)."""
    import torch

    value = tensors[key]
    return any(shape == tuple(value.shape) and torch.equal(tensors[name], value) for name, shape in shapes.items())


def write_trained_checkpoint(
    original: str | Path, trained: str | Path | dict[str, torch.Tensor], out: str | Path, max_shard_size: str = "5GB"
) -> Path:
    """A loadable model folder: ``original``'s files with its tensors replaced by the trained ones.

    Tensors the trainer never held (a VLM's vision tower) keep the original's values, so the result
    loads with the original's class (e.g. ``Qwen3_5ForConditionalGeneration``).

    Args:
        original: the model folder training started from.
        trained: checkpoint-named tensors: a safetensors file (a full weight sync's ``model.safetensors``) or
            a state dict (CPU tensors).
        out: folder to write (replaced); gets the tensors as safetensors shards of at most ``max_shard_size``
            (with ``model.safetensors.index.json`` when there are several; ``huggingface_hub``'s writer) and
            the original's other files.
        max_shard_size: largest shard, e.g. ``"5GB"``.

    Returns:
        ``out``.

    Raises:
        ConfigError: a trained tensor's name or shape matches nothing in the original checkpoint (a tied
            copy, e.g. ``lm_head.weight`` of tied word embeddings that the original stores once, is dropped).
    """
    import shutil

    from huggingface_hub import save_torch_state_dict
    from safetensors import safe_open
    from safetensors.torch import load_file

    original, out = Path(original), Path(out)
    tensors = dict(trained) if isinstance(trained, dict) else load_file(str(trained))
    shapes = {}
    for file in sorted(original.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[key] = tuple(f.get_slice(key).get_shape())
                if key not in tensors:
                    tensors[key] = f.get_tensor(key)
    for key in [k for k in tensors if k not in shapes and _tied_to_stored(tensors, k, shapes)]:
        del tensors[key]  # a tied copy (lm_head of tied word embeddings): the original stores one of the pair
    unknown = [k for k, v in tensors.items() if k not in shapes or tuple(v.shape) != shapes[k]]
    if shapes and unknown:
        raise ConfigError(f"{len(unknown)} trained tensors match no tensor of {original} (e.g. {unknown[:3]})")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(original, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json", "*.bin"))
    save_torch_state_dict(tensors, str(out), max_shard_size=max_shard_size, metadata={"format": "pt"})
    return out
