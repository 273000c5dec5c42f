"""The trainer's final export (two FSDP2 ranks on gloo): a sharded ``save_pretrained`` folder holding exactly the
trained weights of the last checkpoint, loadable with ``from_pretrained``; ``--set`` on the trainer entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from trainer_helpers import ROOT, read_jsonl, trainer_config, write_samples
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_core.config import ModelConfig
from grpo_core.models import resolve_model_dir


def test_two_rank_run_exports_the_trained_weights_sharded(tmp_path):
    samples = write_samples(tmp_path / "samples.arrow", 8)
    config = trainer_config(tmp_path, samples, max_steps=6, save_steps=50, learning_rate=5e-2)
    cmd = [
        sys.executable,
        "-m",
        "grpo_core.train.launch",
        "--nproc-per-node",
        "2",
        "-m",
        "grpo_core.train",
        "--config",
        str(config),
        "--set",
        "train.max_steps=2",
        "--set",
        "export.max_shard_size=200KB",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    out = tmp_path / "out"
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]  # --set beat the file's max_steps=6

    final = out / "final_model"
    index = json.loads((final / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert (final / "generation_config.json").is_file() and (final / "tokenizer.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).state_dict()

    # Independent source: the final DCP checkpoint, converted by torch's own tool.
    checkpoint = out / "checkpoints" / "step-0000002"
    dcp_to_torch_save(str(checkpoint / "dcp"), str(tmp_path / "ckpt.pt"))
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # tensors only, keyed by their dotted state path
    trained = {k.removeprefix("model.").removeprefix("lm."): v for k, v in saved.items() if k.startswith("model.")}
    assert trained, sorted(saved)[:5]
    base = AutoModelForCausalLM.from_pretrained(resolve_model_dir(ModelConfig(name="tiny-qwen3"))).state_dict()
    moved = 0
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0)
        moved += not torch.equal(tensor, base[name])
    assert moved > len(exported) // 2, "the exported weights are the base model's"
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.decode(tokenizer("2 + 2 = 4")["input_ids"]) == "2 + 2 = 4"


def test_tied_output_head_is_written_once_as_the_original_stores_it(tmp_path):
    """A model with tied word embeddings stores ``embed_tokens`` only; the trainer's state dict also names the
    tied ``lm_head.weight``. The export keeps the original's single copy and loads back with both equal."""
    import pytest
    from safetensors.torch import load_file, save_file

    from grpo_core.errors import ConfigError
    from grpo_core.models.text_model import write_trained_checkpoint

    original = tmp_path / "original"
    original.mkdir()
    save_file({"embed.weight": torch.zeros(4, 3), "norm.weight": torch.ones(3)}, str(original / "model.safetensors"))
    (original / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    trained_embed = torch.arange(12.0).reshape(4, 3)
    out = write_trained_checkpoint(
        original, {"embed.weight": trained_embed, "lm_head.weight": trained_embed.clone()}, tmp_path / "out"
    )
    written = load_file(str(out / "model.safetensors"))
    assert set(written) == {"embed.weight", "norm.weight"}
    assert torch.equal(written["embed.weight"], trained_embed) and torch.equal(written["norm.weight"], torch.ones(3))
    # An untied extra tensor (different values) still matches nothing and is refused.
    with pytest.raises(ConfigError, match="1 trained tensors match no tensor"):
        write_trained_checkpoint(
            original, {"embed.weight": trained_embed, "lm_head.weight": -trained_embed}, tmp_path / "out2"
        )
