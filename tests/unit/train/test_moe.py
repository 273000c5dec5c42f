"""Mixture-of-experts policies on packed tree rows (issue 27 item 5, ``train.router_aux_loss_coef``): the routers'
load-balancing loss of a packed row is transformers' own ``load_balancing_loss_func`` over the row's tokens, each
forwarded token once (Switch Transformer, Fedus et al. 2021, eq. 4-6), and the loss gains coef × it.

References are independent of the packed path: each sample run alone through the same weights with plain causal
SDPA attention (transformers' forward), its router logits recorded by transformers and fed to transformers'
function; the GRPO part is ``test_loss.reference_loss``, the per-sample formula."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_loss import reference_loss, samples_with_sampler
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from grpo_core.config import LoraConfig, ModelConfig
from grpo_core.errors import ConfigError
from grpo_core.packing import Sample, get_packer
from grpo_core.train.loss import LossSettings
from grpo_core.train.moe import load_balancing_loss, resolve_router_aux_loss_coef
from grpo_core.train.policy import build_policy
from grpo_core.train.rows import to_tensors

MOE = ModelConfig(name="tiny-qwen3-moe")
SETTINGS = LossSettings()  # the score-centred gradient with masked importance sampling (top-k in the samples)
COEF = 0.5  # large, so that the aux term is a visible share of the gradient


@pytest.fixture(scope="module")
def folder():
    from grpo_core.models import resolve_model_dir

    return resolve_model_dir(MOE)


@pytest.fixture(scope="module")
def qwen35_moe_folder(tmp_path_factory):
    """A tiny random Qwen3.5-MoE language model (Gated DeltaNet + attention hybrid, every MLP 4 experts, top 2, and
    a shared expert), saved as a folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3_5_moe_text",
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=1024,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("qwen3.5-moe")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return folder


def _policy(folder, coef, model=MOE):
    return build_policy(
        str(folder),
        model,
        dtype=torch.float32,
        device=torch.device("cpu"),
        lora=LoraConfig(),
        temperature=1.0,
        chunk_size=7,
        router_aux_loss_coef=coef,
    )


def _alone_router_logits(lm, samples):
    """Per MoE layer, ``[Σ len, E]`` router logits of every sample run alone (sdpa), and a ``[1, Σ len]`` mask that
    keeps each distinct prefix (each trie node, what a tree row forwards once) at its first occurrence."""
    attn = lm.config._attn_implementation
    lm.config._attn_implementation = "sdpa"
    try:
        per_sample = [lm(input_ids=torch.as_tensor(s.input_ids)[None], output_router_logits=True) for s in samples]
    finally:
        lm.config._attn_implementation = attn
    seen, keep = set(), []
    for s in samples:
        for t in range(len(s.input_ids)):
            node = tuple(int(x) for x in s.input_ids[: t + 1])
            keep.append(node not in seen)
            seen.add(node)
    layers = tuple(torch.cat(parts) for parts in zip(*(out.router_logits for out in per_sample)))
    return layers, torch.tensor(keep, dtype=torch.float32)[None]


def _grads(model):
    return {n.removeprefix("lm."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen3.5-moe"])
def test_packed_row_loss_and_gradients_equal_each_sample_alone(request, kind):
    """Qwen3-MoE, and the Qwen3.5 MoE hybrid (its Gated DeltaNet layers on tree rows too)."""
    folder = request.getfixturevalue("folder" if kind == "qwen3-moe" else "qwen35_moe_folder")
    policy = _policy(folder, COEF, MOE if kind == "qwen3-moe" else ModelConfig(name=str(folder)))
    lm = policy.lm
    routers = [p for n, p in lm.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(routers) == lm.config.num_hidden_layers and all(r.abs().max() > 0 for r in routers)  # real routing
    samples = samples_with_sampler(lm, np.random.default_rng(5))  # 5 completions of one shared 6-token prompt
    row = get_packer("python").pack_row(samples, 1024)
    assert row.num_forwarded < sum(len(s.input_ids) for s in samples)  # the prompt is shared in the trie
    rt = to_tensors(row, torch.device("cpu"), length=row.num_forwarded + 9)  # padding after the row's tokens
    normaliser = float(sum(s.num_trained for s in samples))
    policy.zero_grad()
    res = policy.grpo_loss(rt, SETTINGS, normaliser)
    res.loss.backward()
    packed = _grads(policy)

    lm.zero_grad()
    logits, keep = _alone_router_logits(lm, samples)
    assert int(keep.sum()) == row.num_forwarded  # the reference counts the tokens the row forwards
    aux = load_balancing_loss_func(logits, lm.config.num_experts, lm.config.num_experts_per_tok, keep)
    (reference_loss(lm, samples, SETTINGS, normaliser) + COEF * aux).backward()
    alone = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}

    torch.testing.assert_close(res.stats["aux_loss"], aux.detach(), atol=1e-6, rtol=1e-5)
    assert 0 < float(aux.detach()) <= 4 * 2  # Σ_e f_e = top_k and Σ_e P_e = 1, so 0 < E·Σ f_e·P_e ≤ E·top_k
    assert packed.keys() == alone.keys()
    for (
        name,
        g,
    ) in alone.items():  # fp32: within 1e-4 of each tensor's largest entry (as tests/unit/train/test_tree_recurrence)
        assert float((packed[name] - g).abs().max()) <= 1e-4 * float(g.abs().max()) + 1e-6, name
    gate = "model.layers.0.mlp.gate.weight"
    assert alone[gate].abs().max() > 1e-4  # the routers get a gradient (from the aux term and from the loss)


def test_aux_loss_equals_the_models_own_on_the_same_tokens(folder):
    policy = _policy(folder, COEF)
    lm = policy.lm
    rng = np.random.default_rng(11)
    lengths = [9, 5, 13]
    ids = [[100 + i] + rng.integers(200, 900, n - 1).tolist() for i, n in enumerate(lengths)]  # no shared prefix
    samples = [
        Sample.build(x, [0] * 3 + [1] * (len(x) - 3), np.full(len(x), -1.0, np.float32), sample_id=i, group_id=i)
        for i, x in enumerate(ids)
    ]
    row = get_packer("python").pack_row(samples, 1024)
    assert row.num_forwarded == sum(lengths)
    rt = to_tensors(row, torch.device("cpu"), length=48)
    with torch.no_grad():
        packed = policy.grpo_loss(rt, LossSettings(score_centering=False), 10.0).stats["aux_loss"]
        batch = torch.zeros(len(ids), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(batch)
        for i, x in enumerate(ids):
            batch[i, : len(x)], mask[i, : len(x)] = torch.as_tensor(x), 1
        attn = lm.config._attn_implementation
        lm.config._attn_implementation = "sdpa"
        own = lm(input_ids=batch, attention_mask=mask, output_router_logits=True).aux_loss
        lm.config._attn_implementation = attn
    torch.testing.assert_close(packed, own, atol=1e-6, rtol=1e-5)


def test_coefficient_zero_leaves_the_loss_unchanged_and_none_is_the_model_configs(folder):
    off, on, default = _policy(folder, 0.0), _policy(folder, COEF), _policy(folder, None)
    config = json.loads((folder / "config.json").read_text())
    assert default.router_aux_loss_coef == config["router_aux_loss_coef"] == 0.001
    samples = samples_with_sampler(off.lm, np.random.default_rng(7))
    rt = to_tensors(get_packer("python").pack_row(samples, 1024), torch.device("cpu"))
    normaliser = float(sum(s.num_trained for s in samples))
    res_off, res_on = off.grpo_loss(rt, SETTINGS, normaliser), on.grpo_loss(rt, SETTINGS, normaliser)
    assert "aux_loss" not in res_off.stats  # neither computed nor logged
    off.zero_grad()
    res_off.loss.backward()
    packed = _grads(off)
    off.zero_grad()
    reference_loss(off.lm, samples, SETTINGS, normaliser).backward()  # the GRPO part alone, per sample
    want = _grads(off)
    assert packed.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(packed[name], g, atol=1e-5, rtol=1e-4, msg=name)
    aux = res_on.stats["aux_loss"]
    torch.testing.assert_close(res_on.loss, res_off.loss + COEF * aux, atol=1e-6, rtol=1e-6)
    assert float(COEF * aux) > 0.1  # the weighted term is there when the coefficient is not 0
    # the trainer's weight: coef ÷ micro-batches
    half = on.grpo_loss(rt, SETTINGS, normaliser, aux_scale=0.5)
    torch.testing.assert_close(half.loss, res_off.loss + COEF * 0.5 * aux, atol=1e-6, rtol=1e-6)


def test_a_dense_model_with_a_nonzero_coefficient_is_refused_naming_the_field():
    from grpo_core.models import resolve_model_dir

    dense = ModelConfig(name="tiny-qwen3")
    with pytest.raises(ConfigError, match=r"train\.router_aux_loss_coef=0\.01 .*'tiny-qwen3' is dense"):
        _policy(resolve_model_dir(dense), 0.01, dense)
    for coef in (None, 0.0):  # unset or off: fine
        assert _policy(resolve_model_dir(dense), coef, dense).router_aux_loss_coef == 0.0


def test_the_loss_counts_the_rows_tokens_only():
    """The formula on hand-made logits: 2 layers, 3 real tokens, 2 experts, top-1; padding is ignored."""
    real = [torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]), torch.tensor([[0.0, 2.0], [1.0, 0.0], [0.0, 0.5]])]
    padded = [torch.cat([x, torch.tensor([[9.0, -9.0]] * 4)]) for x in real]
    p = [torch.softmax(x.double(), -1) for x in real]
    f = torch.tensor([2.0, 1.0]) + torch.tensor([1.0, 2.0])  # chosen experts, layer by layer
    want = 2 * float((f / 6 * (p[0].sum(0) + p[1].sum(0)) / 6).sum())
    assert float(load_balancing_loss(padded, 2, 1, 3)) == pytest.approx(want, rel=1e-6)
    assert float(load_balancing_loss(padded, 2, 1, 0)) == 0.0


def test_resolve_reads_the_text_config_of_a_vision_language_moe():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        "qwen3_5_moe", text_config={"num_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}
    )
    assert resolve_router_aux_loss_coef(None, cfg, "x") == 0.02
    assert resolve_router_aux_loss_coef(0.0, cfg, "x") == 0.0


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"]
)  # the compiled run: torch.compile of a length bucket on each rank
def test_a_two_rank_trainer_run_logs_the_aux_loss(tmp_path, compiled):
    """The real trainer under torchrun (2 ranks, gloo, FSDP2 on every decoder layer and the root; each layer's
    forward compiled in the slow tier): a MoE policy trains, and every step logs ``aux_loss``, the rows' mean
    load-balancing loss, which lies in (0, E·top_k]."""
    import subprocess

    import yaml
    from trainer_helpers import read_jsonl, torchrun, trainer_config, write_samples

    samples = write_samples(tmp_path / "samples.arrow", num_prompts=8)
    speed = dict(compile=True, compile_backend="aot_eager", length_buckets=1) if compiled else {}
    config = trainer_config(tmp_path, samples, max_steps=3, save_steps=3, **speed)
    cfg = yaml.safe_load(config.read_text())
    cfg["model"]["name"] = "tiny-qwen3-moe"
    cfg["train"]["router_aux_loss_coef"] = 0.01
    config.write_text(yaml.safe_dump(cfg))
    with open(tmp_path / "log", "w") as log:
        code = torchrun(config, 2, stdout=log, stderr=subprocess.STDOUT).wait(timeout=600)
    assert code == 0, (tmp_path / "log").read_text()[-4000:]
    assert ("(the top: full rows)" in (tmp_path / "log").read_text()) == compiled  # the one bucket, before step 1
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0 < r["aux_loss"] <= 4 * 2 for r in records), [r.get("aux_loss") for r in records]
    if compiled:  # the bucket was compiled with its router outputs before the first step
        assert all(r["perf/recompile_count"] == 0 for r in records)


def test_validation_refuses_a_nonzero_coefficient_for_a_dense_model_before_anything_starts():
    """``grpo validate`` / the run's start (preflight ``check_model``): registry names by their known shape, folders
    by their config.json."""
    from grpo_core.config import RunConfig
    from grpo_core.models import resolve_model_dir
    from grpo_core.run.preflight import check_model

    dense_folder = str(resolve_model_dir(ModelConfig(name="tiny-qwen3")))
    for name in ("tiny-qwen3", "smollm2-135m-instruct", dense_folder):
        with pytest.raises(ConfigError, match=r"train\.router_aux_loss_coef=0\.01 .* is dense"):
            check_model(RunConfig(model={"name": name}, train={"router_aux_loss_coef": 0.01}))
        check_model(RunConfig(model={"name": name}, train={"router_aux_loss_coef": 0.0}))  # off: fine
    for name in ("tiny-qwen3-moe", str(resolve_model_dir(MOE))):
        check_model(RunConfig(model={"name": name}, train={"router_aux_loss_coef": 0.01}))
