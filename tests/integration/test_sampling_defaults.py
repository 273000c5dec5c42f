"""Server-side sampling defaults cannot change what the rollout samples (NeMo-RL #3497 kind).

vLLM fills every sampling field a request omits from the model's ``generation_config.json``
unless started with ``--generation-config vllm``. Shown here: both command lines carry the flag;
every request carries every sampling field (top-k "off" as -1, neutral penalties); a server
that applies a model's defaults (the embedded server with ``--generation-config auto``, as vLLM
by default) samples a request that omits fields differently, and the start-up check names the
difference for such a client while the real client passes; the probe's arithmetic against
log-probs computed independently from logits.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from serving_helpers import TINY, run

from grpo_core.config import ModelConfig, RolloutConfig, RunConfig
from grpo_core.models import resolve_model_dir
from grpo_core.security.auth import ensure_run_token
from grpo_core.serving.client import GenerationClient
from grpo_core.serving.launch import check_server, embedded_command, launch, vllm_command, wait_healthy
from grpo_core.serving.protocol import COMPLETIONS_PATH
from grpo_core.serving.sampling_defaults import probe_problems, sampling_problems, server_default_sampling


def test_both_command_lines_use_neutral_generation_config_and_ipc_allows_handles():
    vllm = vllm_command(RunConfig(model=ModelConfig(name="tiny-llama"), server={"weight_transfer_backend": "ipc"}))
    assert vllm.argv[vllm.argv.index("--generation-config") + 1] == "vllm"
    assert vllm.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    nccl = vllm_command(RunConfig(model=ModelConfig(name="tiny-llama")))
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in nccl.env
    embedded = embedded_command(RunConfig(model=ModelConfig(name=TINY), server={"backend": "embedded"}))
    assert embedded.argv[embedded.argv.index("--generation-config") + 1] == "vllm"


def test_every_request_carries_every_sampling_field(fake_generation):
    async def go():
        async with GenerationClient(fake_generation.url) as c:
            await c.complete([1, 2], model="m", max_tokens=5)
            await c.complete([1, 2], model="m", max_tokens=5, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=3)

    run(go())
    bodies = [r.body for r in fake_generation.calls(COMPLETIONS_PATH)]
    assert len(bodies) == 2 and [r.route for r in fake_generation.requests] == [COMPLETIONS_PATH] * 2
    neutral, tuned = bodies
    assert {
        k: neutral[k]
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "max_tokens",
            "n",
            "seed",
        )
    } == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": 5,
        "n": 1,
        "seed": None,
    }
    assert (tuned["temperature"], tuned["top_k"], tuned["top_p"], tuned["min_p"], tuned["seed"]) == (
        0.7,
        20,
        0.9,
        0.05,
        3,
    )


def _processed(logits: torch.Tensor, temperature: float, top_k: int) -> dict[int, float]:
    """Top-8 processed log-probs (vLLM's processed_logprobs), computed from raw logits; -9999 outside top-k."""
    scaled = logits / temperature
    if top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
    lp = scaled.log_softmax(-1)
    values, ids = lp.topk(8)
    return {int(i): max(float(v), -9999.0) for v, i in zip(values, ids)}


def test_probe_names_the_temperature_and_top_k_the_server_used():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(0)) * 3
    reference = _processed(logits, 1.0, 0)
    served = _processed(logits, 0.6, 3)  # what a server with Qwen-like defaults samples
    assert probe_problems(reference, served, RolloutConfig(temperature=0.6, top_k=3), 8) == []
    problems = probe_problems(reference, served, RolloutConfig(temperature=1.0), 8)
    assert len(problems) == 2 and problems[0].startswith("top_k: 3 of the top 8") and "top_k=0" in problems[0]
    assert problems[1].startswith("temperature: the server sampled with temperature ~0.600")
    assert probe_problems(reference, _processed(logits, 1.0, 0), RolloutConfig(top_k=3), 8)[0].startswith("top_k: 8")


def test_vllm_server_info_defaults_follow_the_generation_config_mode(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"top_k": 20, "top_p": 0.8, "temperature": 0.7, "repetition_penalty": 1.05})
    )
    info = {"vllm_config": {"model_config": {"generation_config": "auto", "override_generation_config": {"top_k": 5}}}}
    assert server_default_sampling(info, tmp_path) == (
        "auto",
        {"top_k": 5, "top_p": 0.8, "temperature": 0.7, "repetition_penalty": 1.05},
    )
    info["vllm_config"]["model_config"]["generation_config"] = "vllm"
    assert server_default_sampling(info, tmp_path) == ("vllm", {"top_k": 5})


class OmittingClient(GenerationClient):
    """The client before the fix: it left out ``top_k`` when top-k was off."""

    async def _request(self, method, path, body=None, params=None, headers=None, **kwargs):
        if body is not None and "prompt" in body and body.get("top_k", 0) <= 0:
            body = {k: v for k, v in body.items() if k != "top_k"}
        return await super()._request(method, path, body, params, headers, **kwargs)


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory):
    """An embedded server that applies its model's generation_config.json (top_k 3, temperature 0.5)."""
    root = tmp_path_factory.mktemp("auto-defaults")
    model_dir = root / "model"
    shutil.copytree(resolve_model_dir(ModelConfig(name=TINY)), model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"top_k": 3, "temperature": 0.5, "do_sample": True}))
    config = RunConfig(
        model=ModelConfig(name=str(model_dir)),
        server={
            "backend": "embedded",
            "port": 0,
            "embedded_num_threads": 1,
            "max_model_len": 128,
            "max_num_seqs": 8,
            "log_dir": root,
            "startup_timeout_s": 180,
            "served_model_name": "auto",
        },
        rollout={"max_completion_length": 32},
    )
    spec = embedded_command(config)
    spec.argv[spec.argv.index("--generation-config") + 1] = "auto"
    token = ensure_run_token()
    handle = launch(spec, token)
    try:
        wait_healthy(handle, 180, token)
        yield handle, config
    finally:
        handle.stop()


def test_server_defaults_apply_only_to_omitted_fields_and_the_check_catches_them(auto_server):
    handle, config = auto_server
    info = run(_server_info(handle.url))
    assert (info["generation_config"], info["default_sampling_params"]) == ("auto", {"top_k": 3, "temperature": 0.5})

    async def problems(client_class):
        async with client_class(handle.url, timeout_s=60) as c:
            return await sampling_problems(c, "auto", config.rollout, None, 8)

    old = run(problems(OmittingClient))
    assert old == ["top_k: 3 of the top 8 tokens are candidates but the config's top_k=0 allows 8"]
    assert run(problems(GenerationClient)) == []
    for rollout in (
        config.rollout,
        RolloutConfig(temperature=0.7, top_k=5, max_completion_length=32),
    ):  # explicit fields win over defaults
        asyncio.run(check_server(handle.url, config.model_copy(update={"rollout": rollout})))


async def _server_info(url):
    async with GenerationClient(url) as c:
        return await c.server_info()
