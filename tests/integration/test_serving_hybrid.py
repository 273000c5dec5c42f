"""The embedded server's engine on a Gated DeltaNet hybrid (tiny random Qwen3.5): continuous
batching with per-sequence convolution and recurrent states. Sequences join a running batch
(left-padded prefill merged into it) and leave it at different steps; every sampled token's
log-prob must equal an independent, unbatched, cache-free forward pass of transformers, and
full-weight updates in the checkpoint's names (vision tower included) must apply."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file
from serving_helpers import reference_logprobs

from grpo_core.config import ModelConfig
from grpo_core.models import load_model, resolve_model_dir
from grpo_core.serving.embedded.engine import Engine, Sequence
from grpo_core.serving.embedded.weights import WeightManager

MODEL = ModelConfig(name="tiny-qwen3.5")
# fp32 noise of the chunked delta rule: on this (deliberately peaky) model transformers' own cached
# decode differs from its full forward by up to 3.3e-5, and a left-padded prefill adds the padded
# steps' decay to each chunk's cumulative sum; a wrong state (another row's, or reset) is off by > 0.1.
ATOL = 2e-4


def _engine():
    torch.manual_seed(0)
    model = load_model(MODEL)[0]
    engine = Engine(model, eos_token_ids=set(), max_model_len=256, max_num_seqs=8, kv_cache_size_tokens=2048)
    return model, engine


def _drain(engine: Engine, seqs: list[Sequence], max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if all(s.future.done() for s in seqs):
            return
        engine._step()  # the decode thread's step, driven by hand so the batch changes are known
    raise AssertionError("sequences did not finish")


def test_hybrid_cache_under_continuous_batching_matches_independent_forward():
    model, engine = _engine()
    first = [
        Sequence(list(range(7, 7 + n)), max_tokens=m, seed=i, num_logprobs=2)
        for i, (n, m) in enumerate([(5, 9), (13, 4), (2, 12)])
    ]
    engine.submit(first)
    engine._step()  # prefill of three left-padded prompts
    engine._step()
    engine._step()
    assert len(engine._batch.rows) == 3 and len(first[1].output_ids) == 3
    late = [
        Sequence(list(range(300, 300 + n)), max_tokens=m, seed=10 + i, num_logprobs=2, temperature=0.8, top_k=30)
        for i, (n, m) in enumerate([(21, 6), (3, 10)])
    ]
    engine.submit(late)
    engine._step()  # the late prompts are prefilled and merged into the running batch
    assert len(engine._batch.rows) == 5
    _drain(engine, first + late)
    assert engine._batch is None
    for seq in first + late:
        assert len(seq.output_ids) == seq.max_tokens
        ref = reference_logprobs(model, seq.prompt_ids, seq.output_ids, temperature=seq.temperature, top_k=seq.top_k)
        torch.testing.assert_close(torch.tensor(seq.logprobs), ref, atol=ATOL, rtol=0)


def test_full_weights_in_checkpoint_names_update_the_language_model(tmp_path):
    model, engine = _engine()
    folder = resolve_model_dir(MODEL)
    weights = WeightManager(engine, model_path=folder)
    original = load_file(str(folder / "model.safetensors"))
    assert any(k.startswith("model.visual.") for k in original)  # the VLM checkpoint Qwen3.5 ships
    gen = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    save_file(perturbed, str(tmp_path / "model.safetensors"))
    num_language = sum(not k.startswith("model.visual.") for k in original)
    assert weights.load_full_weights(tmp_path) == num_language
    expected = load_model(MODEL)[0]
    missing, unexpected = expected.load_state_dict(
        {
            k.replace("model.language_model.", "model."): v
            for k, v in perturbed.items()
            if not k.startswith("model.visual.")
        },
        strict=False,
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    seq = Sequence([5, 17, 42, 99], max_tokens=8, temperature=0.0, num_logprobs=1)
    engine.submit([seq])
    _drain(engine, [seq])
    ref = reference_logprobs(expected, seq.prompt_ids, seq.output_ids, temperature=0.0)
    torch.testing.assert_close(torch.tensor(seq.logprobs), ref, atol=ATOL, rtol=0)
