"""The trainer's forward has no stochastic layer (DESIGN.md §5): whatever the model config or the LoRA settings say,
two forwards of the same row give the same log-probs, bit for bit, and gradients still flow."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from grpo_core.config import LoraConfig, ModelConfig
from grpo_core.packing import Sample, get_packer
from grpo_core.train.policy import build_policy, disable_dropout
from grpo_core.train.rows import to_tensors

VOCAB = 97


@pytest.fixture(scope="module")
def dropout_model_dir(tmp_path_factory):
    """A tiny Qwen3 folder whose config asks for attention dropout 0.5."""
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        attention_dropout=0.5,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("dropout_model")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["attention_dropout"] == 0.5
    return path


def row(seed=0):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, 5).tolist()
    samples = []
    for i in range(3):
        ids = prompt + rng.integers(0, VOCAB, 4 + i).tolist()
        mask = [0] * 5 + [1] * (len(ids) - 5)
        samples.append(Sample.build(ids, mask, [0.0] * len(ids), sample_id=i, group_id=0, advantage=1.0))
    return to_tensors(get_packer("rust").pack_row(samples, 64), torch.device("cpu"))


@pytest.mark.parametrize("mode", ["as built", "train()"])
def test_two_forwards_of_a_row_agree_exactly_despite_dropout_settings(dropout_model_dir, mode):
    lora = LoraConfig(enabled=True, dropout=0.5, r=4, target_modules=["q_proj", "v_proj", "up_proj"])
    policy = build_policy(
        str(dropout_model_dir),
        ModelConfig(name=str(dropout_model_dir)),
        dtype=torch.float32,
        device=torch.device("cpu"),
        lora=lora,
        temperature=1.0,
        chunk_size=8,
    )
    lora_dropouts = [m for n, m in policy.named_modules() if ".lora_dropout." in n]
    assert len(lora_dropouts) == 2 * 3  # the adapter really has its dropout modules (layers x targets)
    if mode == "train()":
        policy.train()  # whatever mode a caller leaves the model in
    rt = row()
    first = policy.logprobs(rt).logprobs
    second = policy.logprobs(rt).logprobs
    assert first.requires_grad  # gradients are not disabled
    assert torch.equal(first, second)
    first.sum().backward()
    assert all(p.grad is not None for p in policy.parameters() if p.requires_grad)
    assert policy.base().config.attention_dropout == 0.0
    assert all(m.p == 0.0 for m in lora_dropouts)


def test_disable_dropout_reports_what_was_on():
    model = AutoModelForCausalLM.from_config(
        Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            attention_dropout=0.25,
        )
    )
    model.extra = torch.nn.Dropout(0.1)
    turned_off = disable_dropout(model)
    assert "config.attention_dropout=0.25" in turned_off
    assert "Dropout modules (p=0.1) x1" in turned_off
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in model.model.layers)
    assert disable_dropout(model) == []  # nothing left on


def test_a_lora_dropout_setting_is_warned_about(caplog):
    from grpo_core.config import RunConfig

    with caplog.at_level("WARNING", logger="grpo_core.config"):
        RunConfig.model_validate({"train": {"lora": {"enabled": True, "dropout": 0.1}}})
    assert "train.lora.dropout: no effect (the trainer's forward has no dropout" in caplog.text, caplog.text
