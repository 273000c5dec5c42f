"""Model registry and loader: SmolLM2 from its wheel, tiny random models, local folders, concurrency."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
from safetensors import safe_open

from grpo_core.config import ModelConfig
from grpo_core.errors import ConfigError
from grpo_core.models import load_model, load_tokenizer, registry_names, resolve_model_dir, smollm2_gguf_path


def test_registry_names():
    assert registry_names() == ["smollm2-135m-instruct", "tiny-llama", "tiny-qwen3", "random-qwen3-0.6b"]


def test_random_qwen3_shape_is_qwen3_0_6b_with_the_smollm2_vocabulary():
    """Checked against Qwen/Qwen3-0.6B's config.json (no weights are built here: 0.5B parameters)."""
    from grpo_core.models import RANDOM_SHAPES

    arch, shape = RANDOM_SHAPES["random-qwen3-0.6b"]
    assert arch == "qwen3" and (shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"],
                                shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"],
                                shape["tie_word_embeddings"]) == (1024, 3072, 28, 16, 8, 128, True)


def test_smollm2_gguf_comes_from_the_wheel():
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_smollm2_converted_once_to_bf16_folder():
    folder = resolve_model_dir(ModelConfig(name="smollm2-135m-instruct"))
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and "quantization_config" not in config
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert resolve_model_dir(ModelConfig(name="smollm2-135m-instruct")) == folder  # cached, not rebuilt
    tokenizer = load_tokenizer(ModelConfig(name="smollm2-135m-instruct"))
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == 49152


def test_smollm2_loads_and_answers_sensibly():
    torch.set_num_threads(1)
    model, tokenizer = load_model(ModelConfig(name="smollm2-135m-instruct"))
    assert model.dtype == torch.float32 and not model.training
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


@pytest.mark.parametrize("name, model_type", [("tiny-llama", "llama"), ("tiny-qwen3", "qwen3")])
def test_tiny_models_are_seeded_real_architectures(name, model_type):
    folder = resolve_model_dir(ModelConfig(name=name, seed=3))
    model, tokenizer = load_model(ModelConfig(name=name, seed=3))
    shutil.rmtree(folder)  # rebuilt from the seed alone
    again, _ = load_model(ModelConfig(name=name, seed=3))
    other, _ = load_model(ModelConfig(name=name, seed=4))
    assert model.config.model_type == model_type and model.config.vocab_size == len(tokenizer) == 49152
    weight = model.get_input_embeddings().weight
    assert torch.equal(weight, again.get_input_embeddings().weight)
    assert not torch.equal(weight, other.get_input_embeddings().weight)


def test_local_folder_and_unknown_name(tmp_path):
    folder = resolve_model_dir(ModelConfig(name="tiny-llama"))
    assert resolve_model_dir(ModelConfig(name=str(folder))) == folder
    with pytest.raises(ConfigError, match="model.name='nope'.*fix model.name"):
        resolve_model_dir(ModelConfig(name="nope", cache_dir=tmp_path))


def test_concurrent_builders_build_once():
    results, errors = [], []
    target = resolve_model_dir(ModelConfig(name="tiny-qwen3", seed=7))
    shutil.rmtree(target)

    def build() -> None:
        try:
            results.append(resolve_model_dir(ModelConfig(name="tiny-qwen3", seed=7)))
        except Exception as exc:  # collected and re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    leftovers = [p.name for p in target.parent.iterdir() if p.name.startswith("tiny-qwen3-seed7.tmp-")]
    assert leftovers == [] and (results[0] / "config.json").is_file()


def test_cache_dir_default_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPO_FLOW_CACHE_DIR", str(tmp_path / "c"))
    assert ModelConfig().resolved_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("GRPO_FLOW_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ModelConfig().resolved_cache_dir() == tmp_path / "xdg" / "grpo-flow"
    assert ModelConfig(cache_dir=tmp_path / "x").resolved_cache_dir() == tmp_path / "x"
