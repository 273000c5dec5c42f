"""Gated DeltaNet hybrids on tree rows: every trained token's log-prob (and the gradient) from a
packed row equals its sample run alone, in fp32, on random Qwen3.5- and Qwen3-Next-shaped models
with group-shared prompts, forks, multi-turn continuations and bucket padding; layers that cannot
be packed are refused with the layer type named."""

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from grpo_core.errors import ConfigError
from grpo_core.packing import Sample, get_packer
from grpo_core.train.attention import TREE_ATTENTION, TreeMask, pad_subtree_end, register_tree_attention
from grpo_core.train.packable import check_packable
from grpo_core.train.policy import row_logprobs
from grpo_core.train.recurrent import install_tree_recurrence, trie_parents

VOCAB = 97
HYBRID = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=1024,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    initializer_range=0.1,
)
QWEN3_NEXT = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def tiny_hybrid(model_type: str):
    register_tree_attention()
    extra = QWEN3_NEXT if model_type == "qwen3_next" else {}
    cfg = AutoConfig.for_model(model_type, **HYBRID, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=TREE_ATTENTION, dtype=torch.float32)
    assert install_tree_recurrence(model) == 2
    return model.eval()


def workload(rng):
    """Two groups sharing a system prompt, completions forking at random depths (some longer than
    the 64-token kernel chunk), two-turn conversations that continue or fork a first turn, a duplicate."""
    system = rng.integers(0, VOCAB, 7).tolist()
    samples = []

    def add(ids, mask, group):
        samples.append(Sample.build(ids, mask, sample_id=len(samples), group_id=group, advantage=1.0))

    for g in range(2):
        prompt = system + rng.integers(0, VOCAB, int(rng.integers(3, 9))).tolist()
        stem = rng.integers(0, VOCAB, 4).tolist()
        for _ in range(3):
            completion = stem[: int(rng.integers(0, 5))] + rng.integers(0, VOCAB, int(rng.integers(1, 90))).tolist()
            add(prompt + completion, [0] * len(prompt) + [1] * len(completion), g)
    first = samples[1]
    tool = rng.integers(0, VOCAB, 5).tolist()
    for _ in range(2):  # the second turn of `first`: once continuing it, once forking after the tool result
        turn = rng.integers(0, VOCAB, int(rng.integers(3, 20))).tolist()
        add(list(first.input_ids) + tool + turn, list(first.completion_mask) + [0] * 5 + [1] * len(turn), 0)
    samples.append(samples[0])
    return samples


def alone_logprobs(model, samples):
    """Each sample's trained-token log-probs from transformers' own forward (SDPA attention, the
    layer's own convolution and chunked delta rule), the samples right-padded into one batch:
    causal layers never let a padded position reach an earlier one, so each row is its sample alone."""
    length = max(s.num_tokens for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : s.num_tokens] = torch.as_tensor(s.input_ids)
        mask[i, : s.num_tokens] = 1
    model.config._attn_implementation = "sdpa"
    try:
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    finally:
        model.config._attn_implementation = TREE_ATTENTION
    out = []
    for i, s in enumerate(samples):
        t = np.nonzero(s.completion_mask)[0]
        out.append(logp[i, t - 1, ids[i, t]])
    return out


def packed_logprobs(model, row, length):
    n = row.num_forwarded
    input_ids = torch.zeros(length, dtype=torch.long)
    input_ids[:n] = torch.from_numpy(row.column("input_ids"))
    position_ids = torch.arange(length)
    position_ids[:n] = torch.from_numpy(row.column("position_ids"))
    mask = TreeMask(pad_subtree_end(torch.from_numpy(row.column("subtree_end")), length))
    return row_logprobs(
        model,
        input_ids,
        position_ids,
        mask,
        torch.from_numpy(row.column("token_index")).long(),
        torch.from_numpy(row.column("target_id")).long(),
        chunk_size=13,
    ).logprobs


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type,pad", [("qwen3_5_text", 512), ("qwen3_next", None)])
def test_packed_logprobs_and_gradients_equal_each_sample_alone(model_type, pad):
    model = tiny_hybrid(model_type)
    samples = workload(np.random.default_rng(3))
    row = get_packer("rust").pack_row(samples, token_budget=4096)
    assert row.num_forwarded < row.num_raw  # prompts and first turns are shared
    packed = packed_logprobs(model, row, pad or row.num_forwarded)
    index = row.column("sample_index")
    alone = alone_logprobs(model, samples)
    worst = max(float((packed[torch.from_numpy(index == i)] - a).abs().max().detach()) for i, a in enumerate(alone))
    assert worst <= 1e-4, worst
    tree_grads = _grads(model, packed.sum())
    alone_grads = _grads(model, torch.cat(alone).sum())
    assert any("linear_attn.conv1d" in n for n in tree_grads) and any("A_log" in n for n in tree_grads)
    for name, g in alone_grads.items():  # fp32 sums over ~500 terms: compare relative to the largest entry
        assert float((tree_grads[name] - g).abs().max()) <= 1e-4 * float(g.abs().max()) + 1e-6, name


def test_trie_parents_match_the_visibility_definition():
    rng = np.random.default_rng(0)
    for seed in range(5):
        row = get_packer("rust").pack_row(workload(np.random.default_rng(seed)), token_budget=4096)
        end = pad_subtree_end(torch.from_numpy(row.column("subtree_end")), row.num_forwarded + 9).numpy()
        parents = trie_parents(end)
        for i in rng.choice(len(end), 60, replace=False):
            ancestors = [j for j in range(i) if end[j] > i]
            assert parents[i] == (max(ancestors) if ancestors else -1)


def _meta_model(model_type, **cfg):
    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = AutoConfig.for_model(model_type, **{**base, **cfg})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    "model_type,cfg,named",
    [
        ("gpt_oss", {"sliding_window": 8192}, "attention sinks"),
        ("gpt_oss", {}, "sliding_attention layers (window 128 < 4096"),
        ("mistral", {"sliding_window": 1024}, "sliding_attention layers (window 1024 < 4096"),
        ("gemma2", {"sliding_window": 8192}, "soft-capping"),
        ("jamba", {}, "JambaMambaDecoderLayer"),
        ("bamba", {}, "BambaMixer"),
        ("lfm2", {"layer_types": ["conv", "full_attention"]}, "'conv'"),
        ("minimax", {}, "MiniMaxLightningAttention"),
        ("falcon_h1", {}, "'hybrid'"),
    ],
)
def test_unpackable_layers_are_refused_with_the_layer_type_named(model_type, cfg, named):
    with pytest.raises(ConfigError, match="cannot be packed into tree rows") as err:
        check_packable(_meta_model(model_type, **cfg), model_type, 4096)
    assert named in str(err.value)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next", "qwen3", "llama", "mistral"])
def test_packable_models_pass(model_type):
    check_packable(_meta_model(model_type, **(QWEN3_NEXT if model_type == "qwen3_next" else {})), model_type, 4096)
