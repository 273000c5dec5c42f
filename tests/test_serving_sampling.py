"""The embedded server's sampler: draws follow the processed distribution; seeds repeat."""

import torch

from grpo_core.serving.sampling import RowSampling, sample_tokens


def _params(rows: int, **kw) -> RowSampling:
    full = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0} | kw
    return RowSampling(temperature=torch.full((rows,), full["temperature"]), top_k=torch.full((rows,), full["top_k"]),
                       top_p=torch.full((rows,), full["top_p"]), min_p=torch.full((rows,), full["min_p"]),
                       generators=[torch.Generator().manual_seed(i) for i in range(rows)])


def test_draw_frequencies_match_processed_probabilities():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(20000, 1)
    tokens, logprobs = sample_tokens(logits, _params(20000, temperature=0.8, top_k=4))
    counts = torch.bincount(tokens, minlength=6).float() / len(tokens)
    expected = logprobs[0].exp()
    assert expected[4:].sum() == 0 and counts[4:].sum() == 0  # outside top-k: never drawn, log-prob -inf
    torch.testing.assert_close(counts, expected, atol=0.015, rtol=0)


def test_greedy_rows_report_full_vocabulary_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.5]])
    tokens, logprobs = sample_tokens(logits, _params(1, temperature=0.0, top_k=1))
    assert tokens.item() == 0
    torch.testing.assert_close(logprobs[0], logits[0].log_softmax(-1))


def test_same_seed_same_draws():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0))
    first, _ = sample_tokens(logits, _params(8, top_p=0.9, top_k=100))
    again, _ = sample_tokens(logits, _params(8, top_p=0.9, top_k=100))
    assert torch.equal(first, again)
