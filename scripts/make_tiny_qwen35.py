"""Write a small random Qwen3.5 checkpoint for GPU checks on a machine without the Hub or our wheels.

Usage: ``python scripts/make_tiny_qwen35.py OUT_DIR [--seed N]``

The folder is what Qwen/Qwen3.5-* ship, scaled down: ``Qwen3_5ForConditionalGeneration`` (a Gated
DeltaNet + full-attention hybrid language model, three linear-attention layers per attention layer,
M-RoPE, and a small vision tower), bf16 safetensors, and a byte-level BPE tokenizer (1024 tokens)
trained here on generated text. Random weights: for throughput and equivalence checks, not quality.
"""

from __future__ import annotations

import argparse
from pathlib import Path

TEXT = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
    tie_word_embeddings=True,
)
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
            vocab_size=TEXT["vocab_size"],
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
    from transformers import AutoConfig, AutoModelForImageTextToText

    fast = tokenizer(args.out)
    ids = {"eos_token_id": fast.eos_token_id, "pad_token_id": fast.pad_token_id}
    config = AutoConfig.for_model(
        "qwen3_5", text_config={**TEXT, **ids}, vision_config=VISION, tie_word_embeddings=True, **ids
    )
    torch.manual_seed(args.seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    print("wrote", args.out, sorted(f.name for f in args.out.iterdir()))


if __name__ == "__main__":
    main()
