"""Activation checkpointing policies (grpo_core.train.parallelize): every policy gives the
same gradients as keeping all activations, and each really recomputes what it says
(counted as matmuls executed in forward + backward), eager and compiled."""

import copy

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen3Config

from grpo_core.packing import Sample, get_packer
from grpo_core.train.attention import TREE_ATTENTION, register_tree_attention
from grpo_core.train.loss import LossSettings
from grpo_core.train.parallelize import apply_layer_wrappers, checkpointed_layers, decoder_layers
from grpo_core.train.policy import Policy
from grpo_core.train.rows import to_tensors

VOCAB, LAYERS = 61, 4
# Matmuls of a layer: q, k, v, o, gate, up, down. A recompute stops once everything the backward needs is
# back (torch.utils.checkpoint's early stop): the down projection's output is kept by nothing in the layer.
RECOMPUTED_PER_LAYER = 6


class MatmulCount(TorchDispatchMode):
    """Counts aten.mm executions (an op served from a selective-checkpointing cache never gets here)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def base_and_row():
    register_tree_attention()
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg, attn_implementation=TREE_ATTENTION)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, VOCAB, 9)
    samples = []
    for i in range(3):
        comp = rng.integers(0, VOCAB, int(rng.integers(3, 9)))
        ids = np.concatenate([prompt, comp]).astype(np.int32)
        lp = np.r_[np.zeros(9), -rng.exponential(3.0, len(comp))].astype(np.float32)
        samples.append(
            Sample.build(ids, [0] * 9 + [1] * len(comp), lp, sample_id=i, group_id=0, advantage=float(i - 1))
        )
    return lm, to_tensors(get_packer("python").pack_row(samples, 256), torch.device("cpu"))


def run(base, rt, mode, selective="op", compile_layers=False):
    """Gradients of every parameter and the matmuls executed, for one row through the fused head."""
    policy = Policy(copy.deepcopy(base), temperature=0.9)
    apply_layer_wrappers(policy, mode, selective, compile_layers, backend="aot_eager")
    counter = MatmulCount()
    with counter:
        res = policy.grpo_loss(rt, LossSettings(score_centering=False), float(rt.num_terms))
        res.loss.backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters()}, counter.n


@pytest.mark.parametrize(
    "mode, selective, recomputed",
    [
        ("full", "op", LAYERS * RECOMPUTED_PER_LAYER),  # every layer runs its forward again
        ("selective", "op", LAYERS * 3),  # k, o and up (every second matmul) are not kept
        ("selective", 2, LAYERS // 2 * RECOMPUTED_PER_LAYER),  # layers 2 and 4 run again
    ],
)
def test_checkpointing_policies_give_identical_gradients(base_and_row, mode, selective, recomputed):
    base, rt = base_and_row
    ref, mms_ref = run(base, rt, "none")
    grads, mms = run(base, rt, mode, selective)
    assert mms - mms_ref == recomputed
    assert ref.keys() == grads.keys()
    assert max(g.abs().max().item() for g in ref.values()) > 1e-3  # a real gradient
    for name, g in ref.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-6, msg=name)


def test_compiled_checkpointed_layers_give_the_same_gradients(base_and_row):
    base, rt = base_and_row
    ref, _ = run(base, rt, "none")
    for mode in ("full", "selective"):
        grads, _ = run(base, rt, mode, "op", compile_layers=True)
        for name, g in ref.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-5, msg=f"{mode} {name}")


def test_layer_plan_and_names_unchanged(base_and_row):
    assert checkpointed_layers(4, "selective", 3) == [None, None, "full", None]
    assert checkpointed_layers(2, "selective", "op") == ["op", "op"]
    with pytest.raises(ValueError, match="selective_checkpointing"):
        checkpointed_layers(2, "selective", 0)
    base, _ = base_and_row
    policy = Policy(copy.deepcopy(base))
    names = [n for n, _ in policy.named_parameters()]
    apply_layer_wrappers(policy, "full", compile_layers=True, backend="aot_eager")
    assert [n for n, _ in policy.named_parameters()] == names  # weight sync and checkpoints see the same names
    assert len(decoder_layers(policy)) == LAYERS


def test_mixed_precision_keeps_the_sampler_logprobs_fp32(base_and_row, tmp_path):
    """Under FSDP2 mixed precision (bf16 compute, the trainer's CUDA default) the fused head must see the
    sampler's log μ as given: the per-term ratio equals exp(log π − log μ) with the fp32 μ, not a bf16-rounded
    one (FSDP2 casts float inputs of a module's forward, dataclass fields included, unless told not to)."""

    import torch.distributed as dist

    from grpo_core.train.parallelize import shard

    base, rt = base_and_row
    mu = rt.sampler_logprob.clone()
    assert not torch.equal(mu.to(torch.bfloat16).float(), mu)  # bf16 would round these log-probs
    owned = not dist.is_initialized()
    if owned:  # a file store: a port given up by free_port could be taken by another worker before the store binds it
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        policy = shard(Policy(copy.deepcopy(base)), mixed_precision=True)
        res = policy.grpo_loss(rt, LossSettings(score_centering=False), float(rt.num_terms))
        assert policy.lm.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # sharded fp32 master
        expected = (res.logprobs.logprobs.double() - mu.double()).exp()
        torch.testing.assert_close(res.stats["ratio"].double(), expected, atol=1e-6, rtol=1e-6)
        res.loss.backward()
    finally:
        if owned:
            dist.destroy_process_group()
