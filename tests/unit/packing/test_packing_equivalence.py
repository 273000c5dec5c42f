"""Property tests of packing: the rust and python backends agree on random inputs,
and every packed row passes an independent checker written here from DESIGN.md §5
(it uses no grpo_core code, only the raw arrays of the rows).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_core.errors import PackingError
from grpo_core.packing import Sample, TokenLists, get_packer, samples_to_arrow

RUST, PYTHON = get_packer("rust"), get_packer("python")
SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# Random sample sets: groups sharing a prompt, a common system prompt, identical samples,
# one-token completions, multi-turn masks, optional top-k / sampling-mask lists.


def _token_lists(rng: np.random.Generator, num_tokens: int, with_logprobs: bool) -> TokenLists:
    counts = rng.integers(0, 4, num_tokens)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    ids = rng.integers(0, 50, int(offsets[-1])).astype(np.int32)
    logprobs = -rng.random(len(ids)).astype(np.float32) * 5 if with_logprobs else None
    return TokenLists(offsets, ids, logprobs)


@st.composite
def sample_sets(draw, max_groups: int = 6, vocab: int = 4) -> list[Sample]:
    """Samples with plenty of sharing (tiny vocabulary), unique ``sample_id``s in stream order."""
    tokens = st.lists(st.integers(0, vocab - 1), min_size=0, max_size=6)
    system = draw(st.lists(st.integers(0, vocab - 1), max_size=5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    with_topk, with_mask = draw(st.booleans()), draw(st.booleans())
    samples: list[Sample] = []
    for group in range(draw(st.integers(1, max_groups))):
        prompt = system + draw(tokens)
        prompt = prompt or [draw(st.integers(0, vocab - 1))]  # completion_mask[0] must be 0
        advantage = float(np.float32(rng.standard_normal()))
        for _ in range(draw(st.integers(1, 4))):
            completion = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8))
            mask = [0] * len(prompt) + [1] * len(completion)
            if len(completion) > 2 and draw(st.booleans()):  # a multi-turn tool output, not trained
                a = draw(st.integers(1, len(completion) - 1))
                for j in range(a, min(a + draw(st.integers(1, 2)), len(completion))):
                    mask[len(prompt) + j] = 0
            copies = 2 if draw(st.integers(0, 5)) == 0 else 1  # identical samples
            for _ in range(copies):
                ids = prompt + completion
                logprobs = np.where(np.array(mask) == 1, -rng.random(len(ids)) * 3, 0).astype(np.float32)
                s = Sample.build(
                    ids,
                    mask,
                    logprobs,
                    sample_id=len(samples),
                    group_id=group,
                    prompt_index=group * 10,
                    advantage=advantage,
                    policy_version=int(rng.integers(0, 5)),
                )
                if with_topk and rng.random() < 0.7:
                    s.sampler_topk = _token_lists(rng, len(ids), True)
                if with_mask and rng.random() < 0.7:
                    s.sampling_mask = _token_lists(rng, len(ids), False)
                samples.append(s)
    order = draw(st.permutations(range(len(samples))))
    samples = [samples[i] for i in order]
    for i, s in enumerate(samples):
        s.sample_id = i
    return samples


@st.composite
def batcher_cases(draw):
    """Samples, a budget around their lengths (exactly fits, one short, ...), ranks and push chunks."""
    samples = draw(sample_sets())
    lengths = sorted({s.num_tokens for s in samples})
    budget = draw(st.sampled_from([*lengths, lengths[-1] - 1, lengths[-1] + 7, 2 * lengths[-1], 64]))
    budget = max(budget, 1)
    num_ranks = draw(st.integers(1, 8))
    cuts = sorted(draw(st.lists(st.integers(0, len(samples)), max_size=4)))
    chunks = [samples[a:b] for a, b in zip([0, *cuts], [*cuts, len(samples)])]
    return samples, budget, num_ranks, chunks


# ---------------------------------------------------------------------------------------------
# The independent checker.


def _np(batch: pa.RecordBatch, name: str) -> np.ndarray:
    return np.asarray(batch.column(name).to_pylist())


def _ancestors(subtree_end: np.ndarray, q: int) -> list[int]:
    """Keys visible to query q: the j <= q with q < subtree_end[j], in order (root first)."""
    return [j for j in range(q + 1) if q < subtree_end[j]]


def _entry(lists: TokenLists | None, t: int) -> tuple[list, list]:
    if lists is None:
        return [], []
    a, b = int(lists.offsets[t]), int(lists.offsets[t + 1])
    return lists.ids[a:b].tolist(), [] if lists.logprobs is None else lists.logprobs[a:b].tolist()


def check_row(row, samples: list[Sample], token_budget: int | None) -> None:
    """Assert every DESIGN.md §5 invariant of ``row`` holding exactly ``samples`` (in row order)."""
    ids, pos, end = (_np(row.tokens, c) for c in ("input_ids", "position_ids", "subtree_end"))
    n = len(ids)
    assert row.num_forwarded == n and row.num_samples == len(samples)
    paths = []
    for q in range(n):
        assert q < end[q] <= n
        anc = _ancestors(end, q)
        assert pos[q] == len(anc) - 1  # position = depth
        if q > 0:  # pre-order: q's parent is the deepest ancestor, and q's subtree nests in it
            assert len(anc) == 1 or end[q] <= end[anc[-2]]
        paths.append(tuple(ids[anc].tolist()))
    # The trie holds each distinct prefix of the samples exactly once, and nothing else.
    prefixes = {tuple(s.input_ids[: t + 1].tolist()) for s in samples for t in range(s.num_tokens)}
    assert len(set(paths)) == n and set(paths) == prefixes
    assert row.load == sum(int(p) + 1 for p in pos)

    # Segments: cu_seqlens_q tiles [0, n); each segment's keys are exactly its last token's ancestors,
    # and with bottom-right causal alignment every query sees its own ancestor path.
    cu_q, cu_k, kv = _np(row.segments, "cu_seqlens_q"), _np(row.segments, "cu_seqlens_k"), _np(row.kv, "kv_index")
    assert cu_q[0] == 0 and cu_q[-1] == n and np.all(np.diff(cu_q) > 0) and cu_k[0] == 0 and cu_k[-1] == len(kv)
    for a, b, ka, kb in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        keys = kv[ka:kb].tolist()
        assert keys == _ancestors(end, b - 1)
        for q in range(a, b):
            assert keys[: len(keys) - (b - 1 - q)] == _ancestors(end, q)

    # Loss terms: each trained token of each sample exactly once, with its own target and sampler values.
    loss = row.loss
    index, target, lp, adv, si = (
        _np(loss, c) for c in ("token_index", "target_id", "sampler_logprob", "advantage", "sample_index")
    )
    seen = Counter()
    for m in range(loss.num_rows):
        s = samples[si[m]]
        prefix = tuple(ids[_ancestors(end, int(index[m]))].tolist())
        t = len(prefix)
        assert prefix == tuple(s.input_ids[:t].tolist())  # the ancestors rebuild input_ids[:t]
        assert s.completion_mask[t] == 1 and target[m] == s.input_ids[t]
        assert np.float32(lp[m]) == s.sampler_logprobs[t] and np.float32(adv[m]) == np.float32(s.advantage)
        if "sampler_topk_ids" in loss.schema.names:
            want_ids, want_lp = _entry(s.sampler_topk, t)
            assert loss.column("sampler_topk_ids")[m].as_py() == want_ids
            assert np.array_equal(np.float32(loss.column("sampler_topk_logprobs")[m].as_py()), np.float32(want_lp))
        else:
            assert all(x.sampler_topk is None for x in samples)
        if "sampling_mask" in loss.schema.names:
            assert loss.column("sampling_mask")[m].as_py() == _entry(s.sampling_mask, t)[0]
        else:
            assert all(x.sampling_mask is None for x in samples)
        seen[(int(si[m]), t)] += 1
    want = Counter((i, t) for i, s in enumerate(samples) for t in np.flatnonzero(s.completion_mask).tolist())
    assert seen == want
    assert row.num_trained == loss.num_rows == sum(s.num_trained for s in samples)

    # Counts, budget and the per-sample table.
    assert row.num_raw == sum(s.num_tokens for s in samples) >= n
    if token_budget is not None:
        assert n <= token_budget and row.num_trained <= token_budget
    meta = row.samples.to_pydict()
    for key in ("sample_id", "group_id", "prompt_index", "policy_version"):
        assert meta[key] == [getattr(s, key) for s in samples]
    assert meta["num_tokens"] == [s.num_tokens for s in samples]
    assert meta["num_trained"] == [s.num_trained for s in samples]


def check_stream(micro_batches, dropped: int, samples: list[Sample], budget: int, num_ranks: int, closed: int) -> None:
    """Assert batcher invariants; ``closed`` = number of micro-batches closed before ``finish``."""
    by_id = {s.sample_id: s for s in samples}
    placed = []
    for k, mb in enumerate(micro_batches):
        assert len(mb) == num_ranks
        if k < closed:
            assert all(r.num_samples > 0 for r in mb)  # closed mid-stream: no empty row
        for row in mb:
            ids = row.samples.column("sample_id").to_pylist()
            assert ids == sorted(ids)  # stream order inside a row
            check_row(row, [by_id[i] for i in ids], budget)
            placed += ids
    oversize = {s.sample_id for s in samples if s.num_tokens > budget}
    assert dropped == len(oversize)
    assert sorted(placed) == sorted(set(by_id) - oversize)  # nothing lost, nothing twice


# ---------------------------------------------------------------------------------------------
# Tests.


def _stream(backend, samples_or_batches, budget: int, num_ranks: int, arrow: bool):
    b = backend.batcher(num_ranks, budget)
    out = []
    for chunk in samples_or_batches:
        out += b.push(samples_to_arrow(chunk)) if arrow else b.push_samples(chunk)
    closed = len(out)
    out += b.finish()
    assert b.finish() == []
    return out, b.dropped_oversize_count, closed


def _same(a, b) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(r.equals(s) for r, s in zip(x, y)) for x, y in zip(a, b))


@SETTINGS
@given(sample_sets())
def test_pack_row_backends_agree_and_pass_the_checker(samples):
    budget = sum(s.num_tokens for s in samples)
    rust, python = RUST.pack_row(samples, budget), PYTHON.pack_row(samples, budget)
    assert rust.equals(python)
    check_row(rust, samples, budget)
    assert RUST.pack_row(samples, budget).equals(rust)  # deterministic


@SETTINGS
@given(sample_sets(max_groups=3), st.integers(1, 40))
def test_pack_row_backends_agree_on_what_does_not_fit(samples, budget):
    outcomes = []
    for backend in (RUST, PYTHON):
        try:
            outcomes.append(backend.pack_row(samples, budget))
        except PackingError as e:
            assert "token_budget" in str(e)
            outcomes.append(None)
    assert (outcomes[0] is None) == (outcomes[1] is None)
    if outcomes[0] is not None:
        assert outcomes[0].equals(outcomes[1])
        check_row(outcomes[0], samples, budget)


@SETTINGS
@given(batcher_cases())
def test_batchers_agree_on_arrow_and_sample_streams(case):
    samples, budget, num_ranks, chunks = case
    rust_arrow = _stream(RUST, chunks, budget, num_ranks, arrow=True)
    check_stream(*rust_arrow[:2], samples, budget, num_ranks, rust_arrow[2])
    for other in (
        _stream(RUST, chunks, budget, num_ranks, arrow=False),
        _stream(PYTHON, chunks, budget, num_ranks, arrow=True),
        _stream(PYTHON, chunks, budget, num_ranks, arrow=False),
        _stream(RUST, [samples], budget, num_ranks, arrow=True),
    ):  # chunking does not matter
        assert _same(rust_arrow[0], other[0])
        assert rust_arrow[1:] == other[1:]


@settings(max_examples=60, deadline=None)
@given(sample_sets(max_groups=12, vocab=3), st.integers(1, 8))
def test_many_groups_under_a_tight_budget(samples, num_ranks):
    budget = max(s.num_tokens for s in samples)  # the longest samples are exactly budget length
    out = _stream(RUST, [samples], budget, num_ranks, arrow=True)
    check_stream(*out[:2], samples, budget, num_ranks, out[2])
    assert _same(out[0], _stream(PYTHON, [samples], budget, num_ranks, arrow=True)[0])


@pytest.mark.parametrize("backend", [RUST, PYTHON], ids=lambda b: b.name)
def test_oversize_and_one_token_completions(backend):
    samples = [
        Sample.build([5, 1], [0, 1], sample_id=0, group_id=0),
        Sample.build([5, 2], [0, 1], sample_id=1, group_id=0),
        Sample.build([7, 7, 7, 7, 7], [0, 0, 1, 1, 1], sample_id=2, group_id=1),  # budget + 1: dropped
        Sample.build([7, 7, 7, 7], [0, 0, 1, 1], sample_id=3, group_id=1),  # exactly the budget
    ]
    out, dropped, closed = _stream(backend, [samples], 4, 2, arrow=True)
    assert dropped == 1 and closed == 0
    check_stream(out, dropped, samples, 4, 2, closed)
    rows = out[0]
    assert [r.samples.column("sample_id").to_pylist() for r in rows] == [[0, 1], [3]]
    assert rows[0].column("input_ids").tolist() == [5, 1, 2]
    assert rows[0].column("token_index").tolist() == [0, 0]  # both predicted by the shared 5
    assert rows[0].column("target_id").tolist() == [1, 2]


def test_fewer_samples_than_ranks_leave_empty_rows_in_the_last_micro_batch():
    samples = [Sample.build([i + 1, 2], [0, 1], sample_id=i, group_id=i) for i in range(3)]
    for backend in (RUST, PYTHON):
        out, dropped, closed = _stream(backend, [samples], 10, 5, arrow=False)
        assert closed == 0 and dropped == 0 and len(out) == 1
        assert [r.num_samples for r in out[0]] == [1, 1, 1, 0, 0]
        assert out[0][4].num_forwarded == 0 and out[0][4].loss.num_rows == 0


def _corrupt(row, part: str, column: str, edit):
    batch = getattr(row, part)
    values = batch.column(column).to_pylist()
    edit(values)
    array = pa.array(values, batch.schema.field(column).type)
    fixed = batch.set_column(batch.schema.get_field_index(column), column, array)
    return dataclasses.replace(row, **{part: fixed})


@pytest.mark.parametrize(
    "part, column, edit",
    [
        ("tokens", "subtree_end", lambda v: v.__setitem__(3, 7)),  # 4 would see 6 and 7
        ("tokens", "position_ids", lambda v: v.__setitem__(5, 4)),
        ("tokens", "input_ids", lambda v: v.__setitem__(6, 8)),
        ("kv", "kv_index", lambda v: v.__setitem__(4, 5)),
        ("loss", "token_index", lambda v: v.__setitem__(5, 3)),  # predicts 7 from 4, not 6
        ("loss", "sampler_logprob", lambda v: v.reverse()),
        ("loss", "target_id", lambda v: v.__setitem__(0, 4)),
    ],
)
def test_the_checker_rejects_corrupted_rows(part, column, edit):
    samples = [
        Sample.build([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [0, 0, -0.1, -0.2, -0.3], sample_id=0),
        Sample.build([1, 2, 3, 6, 7], [0, 0, 1, 1, 1], [0, 0, -0.4, -0.5, -0.6], sample_id=1),
        Sample.build([9, 2], [0, 1], [0, -0.7], sample_id=2, group_id=1),
    ]
    row = RUST.pack_row(samples, 16)
    check_row(row, samples, 16)
    with pytest.raises(AssertionError):
        check_row(_corrupt(row, part, column, edit), samples, 16)
