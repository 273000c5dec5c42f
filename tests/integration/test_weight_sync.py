"""Weight sync to a real embedded server: after the trainer's syncs, the server samples
from the trained weights (full weights via disk, and LoRA adapter versions)."""

import json
import subprocess

import numpy as np
import torch
from safetensors.torch import load_file
from serving_helpers import embedded_server, run
from trainer_helpers import read_jsonl, torchrun, trainer_config, write_samples
from transformers import AutoModelForCausalLM

from grpo_core.config import ModelConfig
from grpo_core.models import resolve_model_dir
from grpo_core.serving.client import GenerationClient

PROMPT = [1, 504, 2682, 314, 3060, 28, 198]


async def server_logprobs(url, model, n=8):
    async with GenerationClient(url, max_connections=2) as c:
        [out] = await c.complete(PROMPT, model=model, max_tokens=n, temperature=1.0, seed=7, ignore_eos=True)
    return out.token_ids, torch.tensor(out.logprobs)


def local_logprobs(model, tokens):
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    t = torch.arange(len(PROMPT), len(PROMPT) + len(tokens))
    return logp[t - 1, ids[0, t]]


def run_trainer(tmp_path, url, server=None, **train):
    samples = write_samples(tmp_path / "samples.arrow", 6)
    config = trainer_config(tmp_path, samples, server, max_steps=2, weight_sync_steps=1, learning_rate=5e-2, **train)
    with open(tmp_path / "log", "w") as log:
        code = torchrun(config, 1, stdout=log, stderr=subprocess.STDOUT, server_urls=[url]).wait(timeout=600)
    assert code == 0, (tmp_path / "log").read_text()[-4000:]
    return tmp_path / "out"


def test_full_weight_sync_serves_the_trained_weights(tmp_path):
    base_dir = resolve_model_dir(ModelConfig(name="tiny-qwen3"))
    with embedded_server(tmp_path / "server", output_dir=tmp_path / "out") as server:
        before_tokens, before = run(server_logprobs(server.url, "tiny-qwen3"))
        out = run_trainer(tmp_path, server.url)
        tokens, served = run(server_logprobs(server.url, "tiny-qwen3"))
    assert [m["policy_version"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    trained = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    trained.load_state_dict(load_file(out / ".weights" / "v2" / "model.safetensors"), strict=False)
    torch.testing.assert_close(served, local_logprobs(trained, tokens), atol=2e-4, rtol=0)
    original = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    assert (local_logprobs(original, tokens) - served).abs().max() > 1e-3  # the weights really moved


def test_lora_sync_serves_each_adapter_version(tmp_path):
    from peft import PeftModel

    base_dir = resolve_model_dir(ModelConfig(name="tiny-qwen3"))
    with embedded_server(tmp_path / "server", output_dir=tmp_path / "out", lora_r=8) as server:
        out = run_trainer(tmp_path, server.url, lora={"enabled": True, "r": 8, "alpha": 16})
        tokens, served = run(server_logprobs(server.url, "policy-v2"))
    adapter = out / ".vllm_lora" / "policy-v2"
    assert (adapter / "adapter_model.safetensors").exists() and (out / ".vllm_lora" / "policy-v1").exists()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), adapter)
    torch.testing.assert_close(served, local_logprobs(model, tokens), atol=2e-4, rtol=0)
    assert np.isfinite(served.numpy()).all()
    # Written by PEFT's save_pretrained: its own config fields and model card, not a hand-made JSON.
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["base_model_name_or_path"]
    assert (adapter / "README.md").is_file() and "peft" in (adapter / "README.md").read_text().lower()
    # The exported adapter at the end is the last synced version, with the tokenizer beside it.
    final = out / "final_model"
    exported = load_file(final / "adapter_model.safetensors")
    assert exported.keys() == load_file(adapter / "adapter_model.safetensors").keys()
    for name, tensor in load_file(adapter / "adapter_model.safetensors").items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0)
    assert (final / "tokenizer_config.json").is_file()


def test_vllm_names_gain_base_layer_only_with_lora():
    from grpo_core.train.weight_sync.vllm import vllm_name

    assert vllm_name("lm.model.layers.0.self_attn.q_proj.weight", False) == "model.layers.0.self_attn.q_proj.weight"
    assert (
        vllm_name("lm.model.layers.0.self_attn.q_proj.weight", True)
        == "model.layers.0.self_attn.q_proj.base_layer.weight"
    )
    assert vllm_name("lm.model.embed_tokens.weight", True) == "model.embed_tokens.base_layer.weight"
    assert vllm_name("lm.model.norm.weight", True) == "model.norm.weight"


def test_resumed_lora_run_gives_fresh_servers_its_adapter_first(tmp_path):
    samples = write_samples(tmp_path / "samples.arrow", 16)
    lora = {"enabled": True, "r": 8, "alpha": 16}
    for attempt, max_steps in ((1, 2), (2, 3)):  # the second attempt resumes at step 2 on a new server
        config = trainer_config(
            tmp_path, samples, max_steps=max_steps, save_steps=2, weight_sync_steps=1, learning_rate=5e-2, lora=lora
        )
        with embedded_server(tmp_path / f"server{attempt}", output_dir=tmp_path / "out", lora_r=8) as server:
            with open(tmp_path / f"log{attempt}", "w") as log:
                code = torchrun(config, 1, stdout=log, stderr=subprocess.STDOUT, server_urls=[server.url]).wait(600)
            assert code == 0, (tmp_path / f"log{attempt}").read_text()[-3000:]
            served = run(models(server.url))
    assert "resumed from" in (tmp_path / "log2").read_text()
    assert {"policy-v2", "policy-v3"} <= served and "policy-v1" not in served  # v2 re-synced, v3 trained
    # A LoRA checkpoint holds the adapter and its optimizer state, not the frozen base model.
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(tmp_path / "out" / "checkpoints" / "step-0000002" / "dcp")).read_metadata()
    keys = list(keys.state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), [k for k in model_keys if "lora_" not in k][:5]
    assert any(k.startswith("optim.state.") and "lora_" in k for k in keys)


async def models(url):
    async with GenerationClient(url, max_connections=2) as c:
        return {m["id"] for m in await c.models()}
