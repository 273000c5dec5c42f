"""The embedded server on the real SmolLM2-135M-Instruct (float32, CPU), through the client.

Log-probs of concurrently batched (left-padded) requests are checked against an independent
unbatched forward pass with tolerance 5e-4 (absolute, natural log): 30 float32 layers with
different padding and batch shapes accumulate ~1e-5 of reduction-order noise.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from serving_helpers import embedded_server, reference_logprobs, run

from grpo_core.config import ModelConfig
from grpo_core.models import load_model
from grpo_core.serving.client import GenerationClient

SMOL = "smollm2-135m-instruct"
ATOL = 5e-4
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What is 2 + 2? Answer briefly.",
    "Write one word that rhymes with cat.",
]


@pytest.fixture(scope="module")
def smol():
    torch.set_num_threads(1)
    return load_model(ModelConfig(name=SMOL))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with embedded_server(tmp_path_factory.mktemp("smol-server"), model=SMOL, max_model_len=512) as handle:
        yield handle


def _prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=True
    )["input_ids"]


def test_batched_processed_logprobs_match_independent_forward(server, smol):
    model, tokenizer = smol
    prompts = [_prompt(tokenizer, q) for q in QUESTIONS]
    sampling = {"temperature": 0.8, "top_k": 40, "top_p": 0.95}

    async def go():
        async with GenerationClient(server.url, max_connections=8, timeout_s=120) as c:
            return await asyncio.gather(
                *(
                    c.complete(p, model=SMOL, max_tokens=10, seed=i, num_logprobs=5, **sampling)
                    for i, p in enumerate(prompts)
                )
            )

    for prompt, (out,) in zip(prompts, run(go()), strict=True):
        ref = reference_logprobs(model, prompt, out.token_ids, **sampling)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=ATOL, rtol=0)
        assert all(len(top) in (5, 6) for top in out.top_logprobs)


def test_greedy_chat_answer_stops_at_im_end(server, smol):
    _, tokenizer = smol

    async def go():
        async with GenerationClient(server.url, timeout_s=120) as c:
            return await c.complete(_prompt(tokenizer, QUESTIONS[0]), model=SMOL, max_tokens=40, temperature=0)

    (out,) = run(go())
    assert "Paris" in out.text
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    else:
        assert len(out.token_ids) == 40
