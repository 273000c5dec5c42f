"""Which models can be trained on packed tree rows, checked before anything trains.

Tree rows give each token exactly its sample's history only if every token mixer of the model
follows the trie: full (causal) attention does through the tree mask, and the supported Gated
DeltaNet layers do through ``grpo_core.train.recurrent``. Anything else would silently mix samples
or drop part of a token's history, so it is refused with the layer type named (the seed manual's
compatibility list: attention sinks are refused; Gated DeltaNet is the only non-attention layer):

* attention sinks (a learned ``sinks`` logit per head, e.g. GPT-OSS);
* sliding-window or chunked attention whose window is shorter than the longest sequence;
* attention logit soft-capping (the tree-attention kernels do not apply it);
* every other recurrent or convolutional mixer (Mamba, ShortConv, Lightning attention, other
  DeltaNet variants, ...).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from grpo_core.errors import ConfigError

from .recurrent import SUPPORTED_RECURRENT

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: ``layer_types`` entries that are not token mixers or that tree rows support.
_FINE_LAYER_TYPES = {"full_attention", "linear_attention", "mlp", "moe", "dense"}
_WINDOWED_LAYER_TYPES = {"sliding_attention", "chunked_attention"}
#: Class-name parts of recurrent / convolutional token mixers in transformers.
_RECURRENT_CLASS = re.compile(
    r"Mamba|Mixer|DeltaNet|Delta|Lightning|ShortConv|Rwkv|RWKV|Recurrent|Retention|SSM|"
    r"LinearAttention|Hyena|Conv(?!1d|2d|3d)"
)


def _refuse(model_name: str, what: str) -> ConfigError:
    return ConfigError(
        f"model.name={model_name!r} has {what}, which cannot be packed into tree rows (a packed "
        "token would see other samples or lose part of its own history); train a model whose "
        "token mixers are full attention and Gated DeltaNet (Qwen3, Llama, Qwen3.5, Qwen3-Next, ...)"
    )


def check_packable(model: nn.Module, model_name: str, max_len: int) -> None:
    """Raise when a layer of ``model`` cannot run on packed tree rows.

    Args:
        model: the causal LM (may live on the meta device).
        model_name: ``model.name`` for the message.
        max_len: the longest sequence a row may hold, in tokens (a sliding window at least this
            long never drops anything).

    Raises:
        ConfigError: naming the first unsupported layer type found.
    """
    cfg = model.config.get_text_config() if hasattr(model, "config") else None
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    window = getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_chunk_size", None)
    windowed = [t for t in layer_types if t in _WINDOWED_LAYER_TYPES]
    if not layer_types and window and getattr(cfg, "use_sliding_window", True):
        windowed = ["sliding_attention"]
    if windowed and (not window or window < max_len):
        raise _refuse(model_name, f"{windowed[0]} layers (window {window} < {max_len} tokens per row)")
    other = sorted(set(layer_types) - _FINE_LAYER_TYPES - _WINDOWED_LAYER_TYPES)
    if other:
        raise _refuse(model_name, f"layers of type {other[0]!r}")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise _refuse(model_name, f"attention logit soft-capping (attn_logit_softcapping={cfg.attn_logit_softcapping})")
    supported = 0
    for name, module in model.named_modules():
        cls = type(module).__name__
        if any("sink" in p for p, _ in module.named_parameters(recurse=False)):
            raise _refuse(model_name, f"attention sinks ({cls} at {name or 'the root'})")
        if cls in SUPPORTED_RECURRENT:
            supported += 1
        elif _RECURRENT_CLASS.search(cls) and not isinstance(module, nn.modules.conv._ConvNd):  # noqa: SLF001
            raise _refuse(model_name, f"recurrent layers of type {cls} (at {name or 'the root'})")
    linear = layer_types.count("linear_attention")
    if linear != supported or (getattr(model, "_is_stateful", False) and not supported):
        raise _refuse(
            model_name,
            f"{linear} linear-attention layers of which {supported} are Gated DeltaNet "
            f"layers of a supported kind ({', '.join(SUPPORTED_RECURRENT)})",
        )


def meta_text_model(config: PretrainedConfig, where: str | Path) -> nn.Module:
    """The language model of ``config`` as the trainer builds it (a VLM's vision tower dropped), on the meta device
    (no memory for weights, none read): for checks of its layers and module names.

    Raises:
        ConfigError: the architecture has no text-generation class (names ``where``).
    """
    from grpo_core.models.text_model import drop_non_language_parts, is_vision_language, text_model_class

    cls = text_model_class(config, where)
    with torch.device("meta"):
        model = cls.from_config(config)
    if is_vision_language(model.config) and hasattr(model.model, "language_model"):
        drop_non_language_parts(model)
    return model


def check_model_folder(path: str | Path, model_name: str, max_len: int) -> nn.Module:
    """:func:`check_packable` on the model of a folder, built on the meta device (no weights read).

    Returns:
        The model built on the meta device (:func:`meta_text_model`), for further checks of its modules.

    Raises:
        ConfigError: as :func:`check_packable`, or the folder holds no text-generation model.
    """
    from transformers import AutoConfig

    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"model.name={model_name!r}: the folder {path} has no config.json; a model folder "
            "holds config.json, the weights (*.safetensors) and the tokenizer files (save one "
            "with save_pretrained, or name a Hub id)"
        )
    model = meta_text_model(AutoConfig.from_pretrained(path), path)
    check_packable(model, model_name, max_len)
    return model
