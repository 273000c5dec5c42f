"""Model registry and loader: SmolLM2 from its wheel, tiny random models, local folders, concurrency."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hub_helpers import FakeHub
from safetensors import safe_open

from grpo_core.config import ModelConfig
from grpo_core.errors import ConfigError
from grpo_core.models import load_model, load_tokenizer, registry_names, resolve_model_dir, smollm2_gguf_path


def test_registry_names():
    assert registry_names() == [
        "smollm2-135m-instruct",
        "tiny-llama",
        "tiny-qwen3",
        "tiny-qwen3.5",
        "tiny-qwen3-moe",
        "random-smollm2-135m",
        "random-qwen3-0.6b",
        "random-qwen3-1.7b",
    ]


@pytest.mark.parametrize(
    ("name", "published"),
    [
        # HuggingFaceTB/SmolLM2-135M-Instruct and Qwen/Qwen3-1.7B config.json: hidden, intermediate, layers, heads,
        # KV heads, head dim, tied embeddings
        ("random-smollm2-135m", ("llama", 576, 1536, 30, 9, 3, 64, True)),
        ("random-qwen3-1.7b", ("qwen3", 2048, 6144, 28, 16, 8, 128, True)),
    ],
)
def test_random_shapes_are_the_published_ones(name, published):
    from grpo_core.models import RANDOM_SHAPES

    arch, shape = RANDOM_SHAPES[name]
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    assert (arch, *(shape[k] for k in keys), shape["head_dim"], shape["tie_word_embeddings"]) == published


def test_random_qwen3_shape_is_qwen3_0_6b_with_the_smollm2_vocabulary():
    """Checked against Qwen/Qwen3-0.6B's config.json (no weights are built here: 0.5B parameters)."""
    from grpo_core.models import RANDOM_SHAPES

    arch, shape = RANDOM_SHAPES["random-qwen3-0.6b"]
    assert arch == "qwen3" and (
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_hidden_layers"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["head_dim"],
        shape["tie_word_embeddings"],
    ) == (1024, 3072, 28, 16, 8, 128, True)


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
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.parametrize(
    "name, model_type",
    [
        ("tiny-llama", "llama"),
        ("tiny-qwen3", "qwen3"),
        ("tiny-qwen3.5", "qwen3_5_text"),
        ("tiny-qwen3-moe", "qwen3_moe"),
    ],
)
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
        except Exception as exc:  # noqa: BLE001 - collected and re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    leftovers = [p.name for p in target.parent.iterdir() if p.name.startswith("tiny-qwen3-seed7.tmp-")]
    assert leftovers == [] and (results[0] / "config.json").is_file()


def test_what_a_killed_builder_left_is_rebuilt(tmp_path):
    config = ModelConfig(name="tiny-qwen3", seed=5, cache_dir=tmp_path)
    target = resolve_model_dir(config)
    shutil.rmtree(target)
    target.mkdir()  # a half-written target (no config.json) and a stale temporary sibling
    (target / "tokenizer.json").write_text("{}")
    (target.parent / f"{target.name}.tmp-dead").mkdir()
    assert resolve_model_dir(config) == target and (target / "config.json").is_file()
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []


def test_a_trainer_rank_other_than_0_builds_a_complete_model(tmp_path):
    """transformers skips save_pretrained on ranks > 0 of a process group; the cache builder must not
    (the first rank to take the lock builds). Rank 1 of a real 2-rank gloo group builds alone here."""
    script = (
        "import os, sys, torch.distributed as dist\n"
        "from grpo_core.config import ModelConfig\n"
        "from grpo_core.models import resolve_model_dir\n"
        "rank = int(sys.argv[1])\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=rank, world_size=2)\n"
        f"if rank == 1: print(resolve_model_dir(ModelConfig(name='tiny-qwen3', seed=3, cache_dir={str(tmp_path)!r})))\n"
        "dist.barrier(); dist.destroy_process_group()\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    built = Path(outs[1].strip().splitlines()[-1])
    assert json.loads((built / "config.json").read_text())["model_type"] == "qwen3"
    with safe_open(str(built / "model.safetensors"), framework="pt") as f:
        assert len(list(f.keys())) > 5


def test_cache_dir_default_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPO_FLOW_CACHE_DIR", str(tmp_path / "c"))
    assert ModelConfig().resolved_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("GRPO_FLOW_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ModelConfig().resolved_cache_dir() == tmp_path / "xdg" / "grpo-flow"
    assert ModelConfig(cache_dir=tmp_path / "x").resolved_cache_dir() == tmp_path / "x"


REPO = "grpo-test/tiny-qwen3.5"


@pytest.fixture
def hub(tmp_path):
    """Two revisions of a tiny Qwen3.5 served as a Hub repository, and an empty Hub cache folder."""
    revisions = {
        "main": resolve_model_dir(ModelConfig(name="tiny-qwen3.5")),
        "v2": resolve_model_dir(ModelConfig(name="tiny-qwen3.5", seed=1)),
    }
    with FakeHub({REPO: revisions}) as server:
        yield server, revisions, tmp_path / "hf"


def _resolve(name: str, cache, endpoint: str, offline: bool = False, revision: str | None = None):
    """``resolve_model_dir`` in a fresh process (huggingface_hub reads HF_* at import, as in a real run)."""
    code = (
        "from grpo_core.config import ModelConfig; from grpo_core.models import resolve_model_dir; "
        f"print(resolve_model_dir(ModelConfig(name={name!r}, revision={revision!r})))"
    )
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "HF_ENDPOINT": endpoint,
        "HF_HUB_OFFLINE": "1" if offline else "0",
        "PYTHONPATH": str(Path(__file__).resolve().parents[3]),
    }
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_hub_id_downloads_into_the_hub_cache_and_resolves_offline_from_it(hub, monkeypatch):
    from huggingface_hub import constants

    server, revisions, cache = hub
    main, v2 = (_resolve(REPO, cache, server.url, revision=r) for r in (None, "v2"))
    assert main.returncode == 0 and v2.returncode == 0, main.stderr[-2000:] + v2.stderr[-2000:]
    main, v2 = Path(main.stdout.strip()), Path(v2.stdout.strip())
    # huggingface_hub's own cache layout: models--owner--name/snapshots/<commit>/, refs/<revision>
    repo_cache = cache / "models--grpo-test--tiny-qwen3.5"
    assert main == repo_cache / "snapshots" / FakeHub.commit(REPO, "main")
    assert v2 == repo_cache / "snapshots" / FakeHub.commit(REPO, "v2")
    assert (repo_cache / "refs" / "v2").read_text() == FakeHub.commit(REPO, "v2")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (main / name).read_bytes() == (revisions["main"] / name).read_bytes()
    served = server.requests
    server.stop()  # no Hub any more: offline (HF_HUB_OFFLINE=1), and online with the Hub unreachable
    for offline in (True, False):
        again = _resolve(REPO, cache, server.url, offline=offline, revision="v2")
        assert again.returncode == 0 and Path(again.stdout.strip()) == v2, again.stderr[-2000:]
    assert server.requests == served
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model, tokenizer = load_model(ModelConfig(name=REPO, revision="v2"))
    reference, _ = load_model(ModelConfig(name="tiny-qwen3.5", seed=1))
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and len(tokenizer) == 49152
    assert torch.equal(model.get_input_embeddings().weight, reference.get_input_embeddings().weight)


def test_hub_id_errors_name_the_field_and_the_fix(hub):
    server, _, cache = hub
    nope = _resolve("grpo-test/nope", cache, server.url)
    assert nope.returncode != 0 and "model.name='grpo-test/nope'" in nope.stderr and "no such model" in nope.stderr
    bad = _resolve(REPO, cache, server.url, revision="v9")
    assert "model.revision='v9'" in bad.stderr and "no such revision; fix model.revision" in bad.stderr
    server.stop()
    for offline, why in ((False, "could not be reached"), (True, "HF_HUB_OFFLINE is set")):
        missing = _resolve(REPO, cache, server.url, offline=offline)  # neither the Hub nor the cache has it
        assert (
            missing.returncode != 0 and why in missing.stderr and "hf download grpo-test/tiny-qwen3.5" in missing.stderr
        )
    with pytest.raises(ConfigError, match="model.revision='v2' applies to Hub ids only"):
        resolve_model_dir(ModelConfig(name="tiny-qwen3.5", revision="v2"))


def test_tiny_qwen35_is_built_as_transformers_builds_it_by_hand(tmp_path):
    """The one Qwen3.5 builder (``qwen3_5_config`` + ``random_model``) gives the registry's ``tiny-qwen3.5`` the
    weights transformers' own classes give it, spelled out here: the vision-language config of the released
    checkpoint, drawn in fp32 from the seed."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from grpo_core.models import _TINY_QWEN3_5_TEXT, _TINY_VISION

    cfg = ModelConfig(name="tiny-qwen3.5", seed=5, cache_dir=tmp_path)
    folder = resolve_model_dir(cfg)
    tokenizer = load_tokenizer(cfg)
    ids = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    text = {**_TINY_QWEN3_5_TEXT, "vocab_size": len(tokenizer), **ids}
    config = AutoConfig.for_model(
        "qwen3_5", text_config=text, vision_config=_TINY_VISION, tie_word_embeddings=True, **ids
    )
    torch.manual_seed(5)
    reference = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).state_dict()
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in saved
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert len(keys) > 20  # the set-up: the folder holds the language model and the vision tower
        for key in keys:
            ref = reference[key]
            assert torch.equal(f.get_tensor(key), ref), key


def test_make_tiny_qwen35_writes_the_released_layout_with_the_small_shape(tmp_path):
    """scripts/make_tiny_qwen35.py (the GPU checks' vLLM model) builds through the registry's Qwen3.5 builder: the
    vision-language checkpoint with its own 1024-token tokenizer, bf16, the small GPU-sized text shape."""
    from grpo_core.models import QWEN3_5_SMALL_TEXT

    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "tiny-qwen35"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    subprocess.run(
        [sys.executable, "scripts/make_tiny_qwen35.py", str(out)], cwd=root, env=env, check=True, timeout=300
    )
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = saved["text_config"]
    assert text["vocab_size"] == 1024 and text["dtype"] == "bfloat16"
    for key in ("hidden_size", "head_dim", "linear_key_head_dim", "layer_types", "num_hidden_layers"):
        assert text[key] == QWEN3_5_SMALL_TEXT[key], key
    assert text["layer_types"].count("full_attention") == 1 and len(text["layer_types"]) == 4  # 3 DeltaNet : 1
