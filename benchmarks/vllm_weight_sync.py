"""GPU check: full-weight sync from the FSDP2 trainer to a real vLLM over CUDA IPC.

Expects a vLLM server (``--weight-transfer-config '{"backend":"ipc"}'``,
``VLLM_SERVER_DEV_MODE=1``) on ``--url`` serving ``--model-dir`` on the same GPU.
The trainer perturbs its weights (as a training step would), syncs them, asks
vLLM for a sampled continuation with log-probs, and compares them with the
trainer's own log-probs of the same tokens at staleness 0. Tensors travel under the served
checkpoint's names (a Qwen3.5 VLM: ``model.language_model.…``). Prints JSON.
"""

from __future__ import annotations

import argparse
import json

import httpx
import torch

from grpo_core.config import LoraConfig, ModelConfig
from grpo_core.packing import Sample, get_packer
from grpo_core.security.auth import bearer_headers, run_token
from grpo_core.train.attention import FlexTreeMasks
from grpo_core.train.distributed import init_world
from grpo_core.train.parallelize import shard
from grpo_core.train.policy import build_policy
from grpo_core.train.rows import to_tensors
from grpo_core.train.weight_sync.vllm import VllmWeightTransferSync

PROMPT = [1, 5, 17, 42, 99, 7, 300, 12]


def sample_from_vllm(url: str, model: str, n_tokens: int) -> tuple[list[int], list[float]]:
    """A seeded sampled continuation and the sampler's log-probs (temperature 1)."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": n_tokens,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    answer = httpx.post(url + "/v1/completions", json=body, headers=bearer_headers(run_token()), timeout=120)
    c = answer.json()["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"]


def trainer_logprobs(policy, tokens: list[int]) -> torch.Tensor:
    """The trainer's log-probs of ``tokens`` after PROMPT (packed row, FlexAttention)."""
    ids = PROMPT + tokens
    row = get_packer().pack_row([Sample.build(ids, [0] * len(PROMPT) + [1] * len(tokens))], 4096)
    rt = to_tensors(row, torch.device("cuda"), 128)
    rt.tree_mask = FlexTreeMasks(torch.device("cuda")).build(rt.tree_mask.subtree_end, 128)
    with torch.no_grad():
        return policy.logprobs(rt).logprobs.float().cpu()


def perturb(policy, scale: float = 0.05, only_lora: bool = False) -> None:
    """Move the weights as a (large) training step would; LoRA B starts at zero, so it gets noise."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, prm in policy.named_parameters():
            if only_lora and "lora_" not in name:
                continue
            std = prm.detach().float().std()
            std = float(std.full_tensor() if hasattr(std, "full_tensor") else std)
            prm.add_(torch.randn_like(prm) * (scale * (std if std > 0 else 0.02)))


def lora_checks(args, world) -> dict:
    """With ``--enable-lora`` on the server: the trainer's adapter versions, and full weights with .base_layer names."""
    from grpo_core.train.weight_sync import LoraAdapterSync

    lora = LoraConfig(enabled=True, r=8, alpha=16)
    policy = build_policy(
        args.model_dir,
        ModelConfig(name=args.model_dir),
        dtype=torch.bfloat16,
        device=world.device,
        lora=lora,
        temperature=1.0,
        chunk_size=1024,
    )
    shard(policy, mixed_precision=False)
    perturb(policy, scale=2.0, only_lora=True)
    sync = LoraAdapterSync([args.url], "/tmp/grpo-sync", "policy", max_staleness=1, model_dir=args.model_dir)
    out = {}
    for version in (1, 2, 3):
        sync.sync(policy, version, world.rank)
    models = [m["id"] for m in httpx.get(args.url + "/v1/models", headers=bearer_headers(run_token())).json()["data"]]
    tokens, served = sample_from_vllm(args.url, "policy-v3", 48)
    diff = (trainer_logprobs(policy, tokens) - torch.tensor(served)).abs()
    out.update(
        {
            "lora_served_models": models,
            "lora_max_abs_logprob_diff": diff.max().item(),
            "lora_mean_abs_logprob_diff": diff.mean().item(),
        }
    )
    base = build_policy(
        args.model_dir,
        ModelConfig(name=args.model_dir),
        dtype=torch.bfloat16,
        device=world.device,
        lora=LoraConfig(),
        temperature=1.0,
        chunk_size=1024,
    )
    shard(base, mixed_precision=False)
    perturb(base)
    VllmWeightTransferSync([args.url], "ipc", lora_names=True, model_dir=args.model_dir).sync(base, 1, world.rank)
    tokens, served = sample_from_vllm(args.url, args.model, 48)
    out["base_layer_ipc_max_abs_logprob_diff"] = (
        (trainer_logprobs(base, tokens) - torch.tensor(served)).abs().max().item()
    )
    return out


def main() -> None:
    """CLI."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="tiny")
    p.add_argument("--model-dir", default="/tmp/tiny-llama")
    p.add_argument("--lora", action="store_true", help="the server runs --enable-lora: check adapter sync instead")
    args = p.parse_args()
    world = init_world("cuda")
    if args.lora:
        print(json.dumps({"check": "vllm_lora_sync", **lora_checks(args, world)}))
        return
    policy = build_policy(
        args.model_dir,
        ModelConfig(name=args.model_dir),
        dtype=torch.bfloat16,
        device=world.device,
        lora=LoraConfig(),
        temperature=1.0,
        chunk_size=1024,
    )
    shard(policy, mixed_precision=False)
    tokens0, served0 = sample_from_vllm(args.url, args.model, 48)
    before = (trainer_logprobs(policy, tokens0) - torch.tensor(served0)).abs().max().item()
    perturb(policy)
    stale = (trainer_logprobs(policy, tokens0) - torch.tensor(served0)).abs().max().item()
    out = VllmWeightTransferSync([args.url], "ipc", model_dir=args.model_dir).sync(policy, 1, world.rank)
    tokens1, served1 = sample_from_vllm(args.url, args.model, 48)
    after = (trainer_logprobs(policy, tokens1) - torch.tensor(served1)).abs()
    print(
        json.dumps(
            {
                "check": "vllm_ipc_weight_sync",
                "max_abs_logprob_diff_before_sync": before,
                "max_abs_logprob_diff_stale_weights": stale,
                "max_abs_logprob_diff_after_sync": after.max().item(),
                "mean_abs_logprob_diff_after_sync": after.mean().item(),
                "tokens": len(tokens1),
                **out,
            }
        )
    )


if __name__ == "__main__":
    main()
