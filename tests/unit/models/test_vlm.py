"""Vision-language checkpoints (tiny random Qwen3.5 and Qwen3-VL) trained on text: only the language
model reaches the trainer (no vision parameter, none trainable, none LoRA-wrapped), packed rows give
each sample's own log-probs, and weight syncs carry the checkpoint's language-model tensor names."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForImageTextToText

from grpo_core.config import LoraConfig, ModelConfig
from grpo_core.models import load_model, resolve_model_dir
from grpo_core.models.text_model import checkpoint_keys, checkpoint_name_map, load_text_model, write_trained_checkpoint
from grpo_core.packing import Sample, get_packer
from grpo_core.serving.embedded.engine import Engine
from grpo_core.serving.embedded.weights import WeightManager
from grpo_core.train.policy import build_policy
from grpo_core.train.rows import to_tensors
from grpo_core.train.weight_sync import LoraAdapterSync
from grpo_core.train.weight_sync.vllm import vllm_name

VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 1,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0],
}
QWEN3_VL_TEXT = {
    "vocab_size": 101,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
}


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """A tiny random Qwen3-VL checkpoint (no causal-LM class in transformers: loaded as the VLM, tower removed)."""
    folder = tmp_path_factory.mktemp("qwen3-vl")
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_vl", text_config=QWEN3_VL_TEXT, vision_config=VISION)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    return folder


def _folder(kind, qwen3_vl):
    return resolve_model_dir(ModelConfig(name="tiny-qwen3.5")) if kind == "qwen3.5" else qwen3_vl


def _policy(folder, lora: LoraConfig | None = None):
    return build_policy(
        str(folder),
        ModelConfig(name=str(folder)),
        dtype=torch.float32,
        device=torch.device("cpu"),
        lora=lora or LoraConfig(),
        temperature=1.0,
        chunk_size=64,
    )


def _vision_keys(folder) -> set[str]:
    return {k for k in checkpoint_keys(folder) if k.startswith("model.visual.")}


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3-vl"])
def test_only_the_language_model_is_trained_and_synced_under_checkpoint_names(kind, qwen3_vl):
    folder = _folder(kind, qwen3_vl)
    vision = _vision_keys(folder)
    assert vision  # the checkpoint has a vision tower
    policy = _policy(folder)
    names = [n for n, _ in policy.named_parameters()]
    assert not any("visual" in n or "merger" in n for n in names)
    assert all(p.requires_grad for p in policy.parameters())
    sent = {vllm_name(n, False, checkpoint_name_map(policy.base(), folder)) for n in names}
    assert sent == checkpoint_keys(folder) - vision  # every language-model tensor, under its checkpoint name
    assert all(n.startswith(("model.language_model.", "lm_head.")) for n in sent)


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3-vl"])
def test_lora_wraps_language_model_modules_only(kind, qwen3_vl):
    policy = _policy(_folder(kind, qwen3_vl), LoraConfig(enabled=True, r=4, alpha=8, target_modules="all-linear"))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.named_parameters() if ".lora_A." in n}
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert wrapped and all(".lora_" in n for n in trainable)
    assert all(".layers." in n and "visual" not in n and "lm_head" not in n for n in wrapped)
    if kind == "qwen3.5":  # the Gated DeltaNet projections are language-model modules too
        assert any("linear_attn.in_proj_qkv" in n for n in wrapped)


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3-vl"])
def test_packed_rows_of_a_vlm_give_each_sample_its_own_logprobs(kind, qwen3_vl):
    folder = _folder(kind, qwen3_vl)
    policy = _policy(folder)
    vocab = policy.base().get_output_embeddings().weight.shape[0]
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, 9).tolist()
    samples = [
        Sample.build(prompt + c, [0] * 9 + [1] * len(c), sample_id=i, group_id=0)
        for i, c in enumerate(rng.integers(0, vocab, (3, 6)).tolist())
    ]
    row = get_packer("rust").pack_row(samples, token_budget=512)
    with torch.no_grad():
        packed = policy.logprobs(to_tensors(row, torch.device("cpu"), 128)).logprobs
        reference = load_text_model(folder, dtype=torch.float32)
        for i, s in enumerate(samples):
            logp = reference(torch.tensor([s.input_ids])).logits[0].log_softmax(-1)
            want = logp[torch.arange(8, 14), torch.tensor(s.input_ids[9:])]
            torch.testing.assert_close(
                packed[torch.from_numpy(row.column("sample_index") == i)], want, atol=1e-4, rtol=0
            )


def test_lora_adapter_in_checkpoint_names_loads_on_the_embedded_servers_model(tmp_path):
    folder = resolve_model_dir(ModelConfig(name="tiny-qwen3.5"))
    policy = _policy(folder, LoraConfig(enabled=True, r=4, alpha=8, target_modules="all-linear"))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.5)
    adapter = LoraAdapterSync([], tmp_path, "pol", max_staleness=0, model_dir=folder).save_adapter(policy, 1)
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("base_model.model.model.language_model.layers.") for k in keys)
    base, _ = load_model(ModelConfig(name="tiny-qwen3.5"))
    engine = Engine(base, eos_token_ids=set(), max_model_len=64, max_num_seqs=1, kv_cache_size_tokens=64)
    weights = WeightManager(engine, model_path=folder)
    weights.load_adapter("pol-v1", str(adapter))  # the embedded server's adapter load
    served = weights.peft.eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 300, 12]])
    policy.base().config._attn_implementation = "sdpa"  # a plain forward of the trainer's model (no tree row)
    with torch.no_grad():
        want = policy.lm(input_ids=ids).logits
        plain = load_model(ModelConfig(name="tiny-qwen3.5"))[0](ids).logits
        torch.testing.assert_close(served(input_ids=ids).logits, want, atol=1e-4, rtol=0)
    assert (want - plain).abs().max() > 1e-2  # the adapter does change the model


def test_trained_vlm_checkpoint_keeps_the_original_vision_tower(tmp_path):
    folder = resolve_model_dir(ModelConfig(name="tiny-qwen3.5"))
    policy = _policy(folder)
    name_map = checkpoint_name_map(policy.base(), folder)
    trained = {name_map[k]: v.detach() + 1.0 for k, v in policy.base().state_dict().items() if k != "lm_head.weight"}
    save_file(trained, str(tmp_path / "trained.safetensors"))
    out = write_trained_checkpoint(folder, tmp_path / "trained.safetensors", tmp_path / "final")
    vlm = AutoModelForImageTextToText.from_pretrained(out)
    original = AutoModelForImageTextToText.from_pretrained(folder)
    got, before = vlm.state_dict(), original.state_dict()
    for key in got:
        expected = (
            trained.get(key, before[key])
            if key != "lm_head.weight"
            else trained["model.language_model.embed_tokens.weight"]
        )
        torch.testing.assert_close(got[key], expected, msg=key)
    assert any(k.startswith("model.visual.") for k in got)
