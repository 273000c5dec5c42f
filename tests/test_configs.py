"""Every shipped config parses, and the GPU configs put vLLM and the trainer where their weight sync works."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_core.config import load_config
from grpo_core.errors import ConfigError
from grpo_core.serving.vllm import check_gpu_layout

CONFIGS = sorted(Path(__file__).resolve().parent.parent.glob("configs/*.yaml"))
GPU = [p for p in CONFIGS if p.name.startswith("gpu-")]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses(path):
    load_config(path)


def test_the_gpu_configs_of_the_issue_exist():
    assert {p.name for p in GPU} >= {"gpu-1xh200.yaml", "gpu-1xh200-lora.yaml", "gpu-2xh200.yaml",
                                     "gpu-qwen3-0.6b-random.yaml"}


@pytest.mark.parametrize("path", GPU, ids=lambda p: p.name)
def test_gpu_configs_place_vllm_and_trainer_for_their_weight_sync(path):
    cfg = load_config(path)
    assert cfg.server.backend == "vllm" and cfg.train.device == "cuda" and cfg.rollout.num_generations == 8
    check_gpu_layout(cfg)
    server_gpus, trainer_gpus = set(cfg.server.gpu_ids), set(cfg.train.gpu_ids)
    if cfg.train.lora.enabled:
        assert cfg.serves_lora() and server_gpus == trainer_gpus
    elif cfg.server.weight_transfer_backend == "ipc":
        assert server_gpus == trainer_gpus and cfg.server.gpu_memory_utilization <= 0.5  # the trainer needs the rest
    else:
        assert cfg.server.weight_transfer_backend == "nccl" and not server_gpus & trainer_gpus


@pytest.mark.parametrize("backend, train_gpus, message", [
    ("nccl", [0], "'nccl' needs the trainer and vLLM on different GPUs"),
    ("ipc", [1], "'ipc' needs every vLLM GPU among the trainer's"),
])
def test_gpu_layout_that_cannot_sync_is_refused_naming_the_fields(backend, train_gpus, message):
    cfg = load_config(None, ["server.backend=vllm", "server.gpu_ids=[0]", f"server.weight_transfer_backend={backend}",
                             f"train.gpu_ids={train_gpus}"])
    with pytest.raises(ConfigError, match=message):
        check_gpu_layout(cfg)


def test_trainer_gpu_ids_must_cover_its_ranks():
    with pytest.raises(ConfigError, match=r"train.gpu_ids lists 1 distinct GPUs but train.num_ranks is 2"):
        load_config(None, ["train.num_ranks=2", "train.gpu_ids=[3]"])
