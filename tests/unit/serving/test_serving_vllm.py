"""vLLM provisioning: command lines, environment, replica GPUs, config validation, fallback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from grpo_core.config import RunConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.serving.launch import (
    _lora_problems,
    choose_backend,
    embedded_command,
    kv_bytes_per_token,
    max_lora_rank_for,
    provision,
    replica_gpus,
    shares_gpu,
    vllm_command,
)


def config(model_dtype: str = "auto", **server) -> RunConfig:
    return RunConfig(
        model={"name": "tiny-llama", "dtype": model_dtype}, server=server, rollout={"max_completion_length": 256}
    )


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_base_command_line_and_env():
    spec = vllm_command(config(port=8100, max_model_len=1024))
    argv = spec.argv
    assert argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"] and argv[4].endswith("tiny-llama-seed0")
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--port") == "8100"
    assert flag(argv, "--max-model-len") == "1024" and flag(argv, "--dtype") == "auto"
    assert flag(argv, "--logprobs-mode") == "processed_logprobs" and flag(argv, "--api-server-count") == "1"
    assert json.loads(flag(argv, "--weight-transfer-config")) == {"backend": "nccl"}
    assert flag(argv, "--served-model-name") == "tiny-llama"
    assert {k: spec.env[k] for k in ("VLLM_SERVER_DEV_MODE", "CUDA_VISIBLE_DEVICES")} == {
        "VLLM_SERVER_DEV_MODE": "1",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    # The guard (token on every route, nonce, pause limit, adapter folder) rides on vLLM's --middleware hook;
    # the token itself is added to the child's environment by launch(), never to a spec.
    assert flag(argv, "--middleware") == "grpo_core.serving.guard.RunGuardMiddleware"
    assert len(spec.env["GRPO_RUN_NONCE"]) == 32 and spec.nonce == spec.env["GRPO_RUN_NONCE"]
    assert spec.env["GRPO_ADAPTER_DIR"].endswith("runs/train/.vllm_lora") and spec.env["GRPO_MAX_PAUSE_S"] == "300.0"
    assert not {"GRPO_RUN_TOKEN", "VLLM_API_KEY"} & set(spec.env) and "--api-key" not in argv
    assert "--enable-lora" not in argv and "--return-sampling-mask" not in argv


def test_engine_stats_lines_are_off_unless_asked_and_metrics_stay(monkeypatch):
    """vLLM 0.25.1 logs its stats line every VLLM_LOG_STATS_INTERVAL seconds (a value <= 0 means its default, 10 s;
    vllm/envs.py) and --disable-log-stats would also drop the Prometheus logger behind /metrics
    (vllm/v1/engine/async_llm.py: no StatLoggerManager), which the rollout reads: only the interval may change."""
    monkeypatch.delenv("VLLM_LOG_STATS_INTERVAL", raising=False)
    quiet = vllm_command(config(port=8100))
    assert float(quiet.env["VLLM_LOG_STATS_INTERVAL"]) >= 86_400  # at most one line a day
    assert "--disable-log-stats" not in quiet.argv
    asked = vllm_command(config(port=8100, log_engine_stats=True))
    assert "VLLM_LOG_STATS_INTERVAL" not in asked.env and "--disable-log-stats" not in asked.argv  # vLLM's 10 s
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "30")  # the user's own interval wins: the child inherits it
    assert "VLLM_LOG_STATS_INTERVAL" not in vllm_command(config(port=8100)).env


@pytest.mark.parametrize("rank, expected", [(1, 1), (4, 8), (8, 8), (17, 32), (300, 320), (512, 512)])
def test_lora_rank_is_next_allowed_value(rank, expected):
    assert max_lora_rank_for(rank) == expected


def test_lora_flags_and_env():
    cfg = RunConfig(train={"lora": {"enabled": True, "r": 24}}, rollout={"max_staleness": 4})
    spec = vllm_command(cfg)
    assert flag(spec.argv, "--max-lora-rank") == "32" and flag(spec.argv, "--max-loras") == "6"
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert (
        flag(
            vllm_command(cfg.model_copy(update={"server": cfg.server.model_copy(update={"max_loras": 9})})).argv,
            "--max-loras",
        )
        == "9"
    )


@pytest.mark.parametrize(
    "section, values, fix",
    [
        ("server", {"enable_lora": True}, "set train.lora.enabled"),
        ("server", {"lora_rank": 16}, "set train.lora.r"),
        ("rollout", {"max_steps": 40}, "set rollout.num_epochs: null"),
    ],
)
def test_a_removed_duplicate_field_names_its_one_owner(tmp_path, section, values, fix):
    ((name, value),) = values.items()
    with pytest.raises(ValueError, match=rf"{section}\.{name} was removed: .*{fix}"):
        RunConfig(**{section: values})
    path = tmp_path / "run.yaml"
    path.write_text(f"{section}:\n  {name}: {str(value).lower()}\n")
    with pytest.raises(ConfigError, match=rf"{section}\.{name} was removed: .*{fix}"):
        load_config(path)
    with pytest.raises(ConfigError, match=rf"{section}\.{name} was removed"):
        load_config(None, [f"{section}.{name}={value}"])


def test_the_trainers_lora_settings_are_the_servers():
    plain = vllm_command(RunConfig()).argv
    assert "--enable-lora" not in plain and not RunConfig().serves_lora()
    cfg = RunConfig(train={"lora": {"enabled": True, "r": 8}})
    assert cfg.serves_lora() and "--enable-lora" in vllm_command(cfg).argv
    assert flag(vllm_command(cfg).argv, "--max-lora-rank") == "8" == flag(embedded_command(cfg).argv, "--max-lora-rank")


def test_candidate_filter_adds_sampling_mask_flags():
    for rollout in ({"top_k": 50}, {"top_k": 50, "top_p": 0.9}, {"min_p": 0.05}):
        argv = vllm_command(RunConfig(rollout=rollout)).argv
        assert "--return-sampling-mask" in argv and "--enable-scale-out" in argv


def test_replicas_get_disjoint_gpus_and_ports():
    cfg = config(num_replicas=2, tensor_parallel_size=2, gpu_ids=[4, 5, 6, 7], port=9000)
    assert replica_gpus(cfg, 0) == [4, 5] and replica_gpus(cfg, 1) == [6, 7]
    specs = [vllm_command(cfg, i) for i in range(2)]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["4,5", "6,7"]
    assert [s.port for s in specs] == [9000, 9001]
    assert flag(specs[1].argv, "--tensor-parallel-size") == "2"
    assert specs[0].log_path != specs[1].log_path


def test_replicas_may_share_a_gpu_listed_once_per_replica():
    cfg = config(num_replicas=3, gpu_ids=[0, 0, 1], gpu_memory_utilization=0.3)
    assert [replica_gpus(cfg, i) for i in range(3)] == [[0], [0], [1]]
    assert [vllm_command(cfg, i).env["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["0", "0", "1"]
    # each replica's KV cache is sized from the model's shape, so those sharing GPU 0 start together:
    # tiny-llama (registry shape: 2 layers, 2 KV heads of 16, fp32 weights with dtype auto) holds 64 sequences
    # (server.max_num_seqs' default) of 4096 tokens (max_model_len's): 2 (K, V) x 2 x 2 x 16 x 4 = 512 bytes a token
    assert [shares_gpu(cfg, i) for i in range(3)] == [False, False, False]
    assert [flag(vllm_command(cfg, i).argv, "--kv-cache-memory-bytes") for i in range(3)] == [str(64 * 4096 * 512)] * 3
    # a partial last block is rounded up to whole blocks of 16 tokens
    sized = config(
        num_replicas=2, gpu_ids=[0, 0], gpu_memory_utilization=0.3, kv_cache_size_tokens=1000, model_dtype="bfloat16"
    )
    assert flag(vllm_command(sized, 1).argv, "--kv-cache-memory-bytes") == str(1008 * 256)
    # a replica alone on its GPU keeps vLLM's own sizing (gpu_memory_utilization) unless a size is given; one beside
    # a trainer rank (train.gpu_ids, default 0 .. num_ranks-1) gets a computed size: the trainer starts with the
    # servers, and vLLM's profiling of free memory would count its allocations as its own
    own_gpus = {"num_replicas": 2, "gpu_ids": [0, 1]}
    kept = RunConfig(model={"name": "tiny-llama"}, server=own_gpus, train={"gpu_ids": [2]})
    assert not any("--kv-cache-memory-bytes" in vllm_command(kept, i).argv for i in range(2))
    on_cpu = RunConfig(model={"name": "tiny-llama"}, server=own_gpus, train={"device": "cpu"})
    assert "--kv-cache-memory-bytes" not in vllm_command(on_cpu, 0).argv
    beside = RunConfig(model={"name": "tiny-llama"}, server=own_gpus)
    assert flag(vllm_command(beside, 0).argv, "--kv-cache-memory-bytes") == str(64 * 4096 * 512)
    alone = config(num_replicas=1, kv_cache_size_tokens=32)
    assert flag(vllm_command(alone).argv, "--kv-cache-memory-bytes") == str(32 * 512)
    tp = config(num_replicas=2, tensor_parallel_size=2, gpu_ids=[2, 3, 3, 2], gpu_memory_utilization=0.4)
    assert replica_gpus(tp, 1) == [3, 2] and not shares_gpu(tp, 1)
    # a KV cache size given to vLLM: nothing is profiled from free memory, so replicas on one GPU start together
    fixed = config(
        num_replicas=2, gpu_ids=[0, 0], gpu_memory_utilization=0.3, extra_args=["--kv-cache-memory-bytes=4000000000"]
    )
    assert [shares_gpu(fixed, i) for i in range(2)] == [False, False]
    assert "--kv-cache-memory-bytes=4000000000" in vllm_command(fixed, 1).argv


def _model_folder(tmp_path, **cfg) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_kv_bytes_per_token_follows_the_model_shape_or_declines(tmp_path):
    # SmolLM2-135M's published shape: 30 layers, 3 KV heads of 64 (bf16): 2 x 30 x 3 x 64 x 2 = 23,040 bytes a token
    smol = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert kv_bytes_per_token(Path(_model_folder(tmp_path, **smol, dtype="bfloat16")), "auto") == 23040
    assert kv_bytes_per_token(Path(_model_folder(tmp_path, **smol)), "float32") == 46080
    # a vision-language checkpoint: the text model's shape; no KV-head count = every head keeps keys and values
    nested = {"text_config": {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8}}
    assert kv_bytes_per_token(Path(_model_folder(tmp_path, **nested)), "float16") == 2 * 2 * 4 * 8 * 2
    # shapes the formula is not vLLM's for: linear-attention layers, MLA, a config without the fields
    hybrid = {**smol, "layer_types": ["linear_attention", "full_attention"]}
    assert kv_bytes_per_token(Path(_model_folder(tmp_path, **hybrid)), "bfloat16") is None
    assert kv_bytes_per_token(Path(_model_folder(tmp_path, **smol, kv_lora_rank=512)), "bfloat16") is None
    assert kv_bytes_per_token(Path(_model_folder(tmp_path, hidden_size=8)), "bfloat16") is None


def test_a_computed_kv_cache_is_held_to_the_replicas_share_of_its_gpu(monkeypatch, tmp_path):
    """Every sequence at full length may not fit: 2 replicas on a GPU of 8 GiB with 0.45 of it each hold at most
    0.45 x 8 GiB - weights - 2 GiB of headroom; a share without room for one sequence is refused naming the field."""
    import grpo_core.serving.launch as launch_mod

    monkeypatch.setattr(launch_mod, "gpu_memory_bytes", lambda gpu: 8 * 2**30)
    # 2 layers x 2 KV heads x 16 x 2 (K, V) x 2 bytes (bf16) = 256 bytes a token; weights: one file of 1 MiB
    model = Path(
        _model_folder(tmp_path, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    )
    (model / "model.safetensors").write_bytes(b"\0" * 2**20)

    def cfg(**server):
        return RunConfig(
            model={"name": str(model), "dtype": "bfloat16"},
            server={"num_replicas": 2, "gpu_ids": [0, 0], "gpu_memory_utilization": 0.45, **server},
        )

    # 64 x 4096 tokens x 256 bytes = 64 MiB fits the share: all of it
    assert flag(vllm_command(cfg(), 1).argv, "--kv-cache-memory-bytes") == str(64 * 4096 * 256)
    # 1024 x 65536 tokens = 16 GiB does not: the share, 0.45 x 8 GiB - 1 MiB - 2 GiB, in whole blocks of 16 tokens
    budget = int(0.45 * 8 * 2**30) - 2**20 - 2 * 2**30
    capped = flag(vllm_command(cfg(max_num_seqs=1024, max_model_len=65536), 1).argv, "--kv-cache-memory-bytes")
    assert int(capped) == budget // (16 * 256) * 16 * 256
    # a size given in tokens is the user's: not held to the share
    big = cfg(max_num_seqs=1024, max_model_len=65536, kv_cache_size_tokens=2**26)
    assert flag(vllm_command(big, 1).argv, "--kv-cache-memory-bytes") == str(2**26 * 256)
    with pytest.raises(ConfigError, match=r"server.gpu_memory_utilization=0.25.*server.max_model_len"):
        vllm_command(cfg(gpu_memory_utilization=0.25, max_model_len=2**23), 1)


def test_replicas_of_a_hybrid_model_on_one_gpu_start_in_turn(tmp_path):
    hybrid = _model_folder(
        tmp_path,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=64,
        layer_types=["linear_attention", "full_attention"],
    )
    cfg = RunConfig(
        model={"name": hybrid}, server={"num_replicas": 2, "gpu_ids": [0, 0], "gpu_memory_utilization": 0.3}
    )
    assert [shares_gpu(cfg, i) for i in range(2)] == [False, True]
    assert "--kv-cache-memory-bytes" not in vllm_command(cfg, 1).argv


@pytest.mark.parametrize(
    "server, match",
    [
        ({"api_server_count": 2}, r"server.api_server_count \(2\) > 1: the run's guard keeps each replica's fence"),
        ({"num_replicas": 2, "gpu_ids": [0]}, r"server.gpu_ids lists 1 GPUs but .* = 2"),
        ({"num_replicas": 1, "tensor_parallel_size": 2, "gpu_ids": [1, 1]}, r"replica 0 the GPUs \[1, 1\]"),
        ({"num_replicas": 2, "gpu_ids": [0, 0], "gpu_memory_utilization": 0.5}, r"puts 2 replicas on one GPU"),
    ],
)
def test_replica_gpu_lists_that_cannot_work_are_refused(server, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [f"server.{k}={json.dumps(v)}" for k, v in server.items()])


@pytest.mark.parametrize(
    "hybrid, gpu_ids, expected",
    [
        # a hybrid's KV size is vLLM's to profile: replicas sharing its GPU start one after the other
        (True, [0, 0], ["launch 0", "healthy 0", "launch 1", "healthy 1"]),
        # a KV size computed from the model's shape: nothing profiles, replicas sharing a GPU start together
        (False, [0, 0], ["launch 0", "launch 1", "healthy 0", "healthy 1"]),
        (False, [0, 1], ["launch 0", "launch 1", "healthy 0", "healthy 1"]),  # own GPUs: together
    ],
)
def test_a_replica_sharing_a_gpu_starts_after_the_earlier_one_is_healthy(
    monkeypatch, tmp_path, hybrid, gpu_ids, expected
):
    """vLLM sizes its KV cache from the memory free while it profiles: a neighbour starting meanwhile would
    change it, so replicas on one GPU start in turn unless each is given its size (the order of launches and
    health checks shows it)."""
    import grpo_core.serving.launch as launch_mod

    events = []

    class Handle:
        def __init__(self, spec):
            self.spec, self.url = spec, f"http://127.0.0.1:{9000 + spec.replica}"

        def stop(self):
            events.append(f"stop {self.spec.replica}")

    monkeypatch.setattr(launch_mod, "choose_backend", lambda cfg: "vllm")
    monkeypatch.setattr(launch_mod, "check_gpu_layout", lambda cfg: None)
    monkeypatch.setattr(
        launch_mod, "launch", lambda spec, token: events.append(f"launch {spec.replica}") or Handle(spec)
    )
    monkeypatch.setattr(
        launch_mod, "wait_healthy", lambda h, timeout, token: events.append(f"healthy {h.spec.replica}")
    )

    async def checked(url, cfg, token):
        return None

    monkeypatch.setattr(launch_mod, "check_server", checked)
    cfg = config(num_replicas=2, gpu_ids=gpu_ids, gpu_memory_utilization=0.3)
    if hybrid:
        model = _model_folder(
            tmp_path, num_hidden_layers=2, num_attention_heads=4, hidden_size=64, layer_types=["linear_attention"] * 2
        )
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": model})})
    handles = provision(cfg, token="t")
    assert events == expected and [h.spec.replica for h in handles] == [0, 1]


@pytest.mark.parametrize(
    "kwargs, fields",
    [
        (
            {"server": {"max_model_len": 512}, "rollout": {"max_completion_length": 512}},
            ["rollout.max_completion_length", "server.max_model_len"],
        ),
        ({"rollout": {"top_p": 0.9}}, ["rollout.top_p", "rollout.top_k"]),
        ({"rollout": {"num_sampler_logprobs": 30}}, ["rollout.num_sampler_logprobs", "server.max_logprobs"]),
        (
            {"train": {"lora": {"enabled": True}}, "server": {"max_loras": 3}, "rollout": {"max_staleness": 4}},
            ["server.max_loras", "rollout.max_staleness"],
        ),
        ({"server": {"num_replicas": 2, "gpu_ids": [0]}}, ["server.gpu_ids", "server.num_replicas"]),
    ],
)
def test_cross_field_errors_name_fields(kwargs, fields):
    with pytest.raises(ValidationError) as info:
        RunConfig(**kwargs)
    assert all(f in str(info.value) for f in fields)
    assert isinstance(info.value, ValueError)


def test_unknown_keys_and_bounds_are_errors():
    with pytest.raises(ValidationError, match="max_model_lenn"):
        RunConfig(server={"max_model_lenn": 10})
    with pytest.raises(ValidationError, match=r"train\.lora\.r"):
        RunConfig(train={"lora": {"r": 1000}})
    with pytest.raises(ConfigError):
        max_lora_rank_for(513)


def test_auto_backend_falls_back_to_embedded_without_vllm(caplog):
    caplog.set_level("WARNING")
    assert choose_backend(RunConfig()) == "embedded"
    assert "EMBEDDED server" in caplog.text
    spec = embedded_command(config(port=0, embedded_num_threads=1))
    assert spec.argv[1:3] == ["-m", "grpo_core.serving.embedded"] and flag(spec.argv, "--num-threads") == "1"
    assert spec.port_file is not None and flag(spec.argv, "--port") == "0"


def test_lora_check_names_restart_flags():
    cfg = RunConfig(train={"lora": {"enabled": True, "r": 16}}, rollout={"max_staleness": 4})
    assert _lora_problems('{"max_lora_rank": 64, "max_loras": 6}', cfg) == []
    problem = _lora_problems("LoRAConfig(max_lora_rank=8, max_loras=2)", cfg)[0]
    assert "--max-lora-rank 16" in problem and "--max-loras 6" in problem


def test_embedded_help_is_instant_and_imports_no_torch():
    code = (
        "import sys, grpo_core.serving.embedded.server as e; e.build_parser().format_help(); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    out = subprocess.run(
        [sys.executable, "-m", "grpo_core.serving.embedded", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "--max-model-len" in out.stdout
