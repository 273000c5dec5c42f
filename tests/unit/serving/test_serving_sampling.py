"""The embedded server's sampler: draws follow the processed distribution; seeds repeat."""

import math

import pytest
import torch

from grpo_core.serving.embedded.sampling import RowSampling, sample_tokens


def _params(rows: int, **kw) -> RowSampling:
    full = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0} | kw
    return RowSampling(
        temperature=torch.full((rows,), full["temperature"]),
        top_k=torch.full((rows,), full["top_k"]),
        top_p=torch.full((rows,), full["top_p"]),
        min_p=torch.full((rows,), full["min_p"]),
        generators=[torch.Generator().manual_seed(i) for i in range(rows)],
    )


def _expected_probabilities(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """softmax(logits / T) restricted to the top-k tokens, then to the smallest most-likely prefix whose
    mass reaches top_p, renormalised: written from the definitions, in plain Python."""
    scaled = [x / temperature for x in logits]
    peak = max(scaled)
    weights = [math.exp(x - peak) for x in scaled]
    order = sorted(range(len(logits)), key=lambda i: -weights[i])
    keep = order[:top_k] if top_k else order
    total = sum(weights[i] for i in keep)
    nucleus, mass = [], 0.0
    for i in keep:  # most likely first: keep a token while the mass before it is below top_p
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += weights[i] / total
    total = sum(weights[i] for i in nucleus)
    return [weights[i] / total if i in nucleus else 0.0 for i in range(len(logits))]


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.8, 4, 1.0), (1.3, 0, 0.7), (1.0, 5, 0.8)])
def test_draw_frequencies_match_the_filtered_softmax(temperature, top_k, top_p):
    row = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]
    logits = torch.tensor([row]).repeat(20000, 1)
    tokens, logprobs = sample_tokens(logits, _params(20000, temperature=temperature, top_k=top_k, top_p=top_p))
    counts = torch.bincount(tokens, minlength=6).double() / len(tokens)
    expected = torch.tensor(_expected_probabilities(row, temperature, top_k, top_p), dtype=torch.float64)
    assert 0 < int((expected > 0).sum()) < 6  # the filter really removes tokens
    assert counts[expected == 0].sum() == 0, "a token outside the candidate set was drawn"
    torch.testing.assert_close(counts, expected, atol=0.015, rtol=0)
    # The reported (processed) log-probs are the same distribution: -inf outside the set.
    torch.testing.assert_close(logprobs[0].double().exp(), expected, atol=1e-5, rtol=0)


def test_greedy_rows_report_full_vocabulary_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.5]])
    tokens, logprobs = sample_tokens(logits, _params(1, temperature=0.0, top_k=1))
    assert tokens.item() == 0
    torch.testing.assert_close(logprobs[0], logits[0].log_softmax(-1))


def _seeded(seeds: list[int], **kw) -> RowSampling:
    params = _params(len(seeds), **kw)
    params.generators = [torch.Generator().manual_seed(s) for s in seeds]
    return params


def test_a_seed_repeats_its_draws_and_different_seeds_differ():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0))

    def draws(seeds):
        return torch.stack([sample_tokens(logits, p)[0] for p in [_seeded(seeds)] for _ in range(40)])

    first, again = draws(list(range(8))), draws(list(range(8)))
    assert torch.equal(first, again)  # 40 successive draws per row, same seeds: same tokens
    other = draws(list(range(100, 108)))
    assert (first != other).any(dim=0).all(), "every row's 40 draws changed with its seed"


def test_a_row_draws_the_same_whatever_the_other_rows_of_the_batch():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(1))
    batch, _ = sample_tokens(logits, _seeded([11, 12, 13, 14, 15, 16], top_k=50, top_p=0.9))
    for row, seed in enumerate([11, 12, 13, 14, 15, 16]):
        alone, _ = sample_tokens(logits[row : row + 1], _seeded([seed], top_k=50, top_p=0.9))
        assert alone.item() == batch[row].item()
    # ... and with different neighbours (greedy rows, other settings) in the batch.
    mixed = _seeded([11, 0, 13], top_k=50, top_p=0.9)
    mixed.temperature[1] = 0.0
    tokens, _ = sample_tokens(logits[[0, 3, 2]], mixed)
    assert tokens[0] == batch[0] and tokens[2] == batch[2] and tokens[1] == logits[3].argmax()
