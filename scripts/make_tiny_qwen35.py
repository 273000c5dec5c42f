"""Write a small random Qwen3.5 checkpoint for GPU checks on a machine without the Hub or our wheels.

Usage: ``python scripts/make_tiny_qwen35.py OUT_DIR [--seed N]``

The folder is what Qwen/Qwen3.5-* ship, scaled down: ``Qwen3_5ForConditionalGeneration`` (a Gated
DeltaNet + full-attention hybrid language model, three linear-attention layers per attention layer,
M-RoPE, and a small vision tower), bf16 safetensors, and a byte-level BPE tokenizer (1024 tokens)
trained here on generated text. Random weights: for throughput and equivalence checks, not quality. The model is
built by the registry's Qwen3.5 builder (``grpo_core.models.qwen3_5_config``); run it from the repository root (or
with the repository on ``PYTHONPATH``, as ``scripts/gpu_qwen35.sh`` does).
"""

from __future__ import annotations

import argparse
from pathlib import Path

#: The language model: the registry's small GPU-sized Qwen3.5 shape (grpo_core.models.QWEN3_5_SMALL_TEXT) with this
#: tokenizer's vocabulary.
VOCAB_SIZE = 1024
VISION = dict(
    depth=1,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    out_hidden_size=256,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
)


def tokenizer(out: Path):
    """A byte-level BPE tokenizer with the ChatML specials and chat template Qwen models use."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = [
        f"The quick brown fox jumps over the lazy dog {i}. Question: what is {i} + {i % 7}? Answer: {i + i % 7}."
        for i in range(3000)
    ]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(out)
    return fast


def main() -> None:
    """CLI."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import torch

    from grpo_core.models import QWEN3_5_SMALL_TEXT, qwen3_5_config, random_model

    fast = tokenizer(args.out)
    ids = {"eos_token_id": fast.eos_token_id, "pad_token_id": fast.pad_token_id}
    config = qwen3_5_config({**QWEN3_5_SMALL_TEXT, "vocab_size": VOCAB_SIZE}, ids, VISION)
    model = random_model(config, args.seed, init_dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    print("wrote", args.out, sorted(f.name for f in args.out.iterdir()))


if __name__ == "__main__":
    main()
