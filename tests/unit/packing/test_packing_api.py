"""The packing API: Sample ↔ Arrow and IPC round trips, zero-copy columns, bad input
raising PackingError (never a panic), backend selection and third-party entry points,
and a small row worked out by hand.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pyarrow as pa
import pytest
import torch

from grpo_core.errors import ConfigError, PackingError
from grpo_core.packing import (
    Sample,
    TokenLists,
    available_packers,
    base,
    get_packer,
    read_samples_ipc,
    sample_schema,
    samples_from_arrow,
    samples_to_arrow,
    write_samples_ipc,
)

RUST, PYTHON = get_packer("rust"), get_packer("python")
BOTH = [pytest.param(RUST, id="rust"), pytest.param(PYTHON, id="python")]


def _samples() -> list[Sample]:
    """Three samples, two with top-k / sampling-mask lists; every value exact in the schema's dtypes."""
    a = Sample.build(
        [1, 2, 3, 4, 5],
        [0, 0, 1, 1, 1],
        [0, 0, -0.5, -1.25, -2.0],
        sample_id=2**40,
        group_id=7,
        prompt_index=3,
        advantage=0.75,
        policy_version=4,
    )
    a.sampler_topk = TokenLists(
        np.array([0, 0, 0, 2, 3, 3], np.int32), np.array([3, 8, 4], np.int32), np.array([-0.5, -1.5, -1.25], np.float32)
    )
    b = Sample.build(
        [1, 2, 3, 6, 2**31 - 1],
        [0, 0, 1, 1, 1],
        [0, 0, -0.5, -3.0, -0.125],
        sample_id=-1,
        group_id=7,
        prompt_index=3,
        advantage=-1.5,
        policy_version=2**31 - 1,
    )
    b.sampling_mask = TokenLists(np.array([0, 1, 1, 1, 4, 4], np.int32), np.array([9, 6, 7, 8], np.int32))
    c = Sample.build([9, 2], [0, 1], [0, -0.25], sample_id=5, group_id=8, prompt_index=4, advantage=0.0)
    return [a, b, c]


def test_sample_arrow_round_trip_is_exact():
    samples = _samples()
    batch = samples_to_arrow(samples)
    assert batch.schema == sample_schema(with_topk=True, with_mask=True)
    assert batch.column("sampler_topk_ids").is_null().to_pylist() == [False, True, True]
    assert batch.column("sampling_mask").is_null().to_pylist() == [True, False, True]
    assert batch.column("sampler_topk_ids")[0].as_py() == [[], [], [3, 8], [4], []]
    assert batch.column("input_ids")[1].as_py() == [1, 2, 3, 6, 2**31 - 1]
    back = samples_from_arrow(batch)
    assert back == samples
    assert back[0].input_ids.dtype == np.int32 and back[0].completion_mask.dtype == np.int8
    assert back[2].sampler_topk is None and back[2].sampling_mask is None
    plain = samples_to_arrow(samples[2:])
    assert plain.schema == sample_schema() and samples_from_arrow(plain) == samples[2:]


def test_advantage_round_trips_when_not_float32_exact():
    s = Sample.build([1, 2], [0, 1], advantage=0.1)
    assert samples_from_arrow(samples_to_arrow([s])) == [s]


def test_ipc_file_round_trip(tmp_path):
    samples = _samples()
    path = tmp_path / "samples.arrow"
    write_samples_ipc(path, samples)
    batch = read_samples_ipc(path)
    assert batch.equals(samples_to_arrow(samples))
    assert samples_from_arrow(batch) == samples
    with pa.ipc.open_file(path) as f:  # a plain Arrow IPC file, readable by pyarrow alone
        assert f.read_all().to_batches()[0].equals(batch)
    write_samples_ipc(tmp_path / "from_batch.arrow", batch)
    assert read_samples_ipc(tmp_path / "from_batch.arrow").equals(batch)
    with pytest.raises(PackingError, match="missing.arrow"):
        read_samples_ipc(tmp_path / "missing.arrow")


def test_packed_columns_reach_numpy_and_torch_without_copies():
    row = RUST.pack_row(_samples(), 64)
    for part, name, dtype in (
        ("tokens", "input_ids", np.int32),
        ("kv", "kv_index", np.int32),
        ("loss", "sampler_logprob", np.float32),
    ):
        arr = getattr(row, part).column(name)
        view = arr.to_numpy(zero_copy_only=True)
        assert view.dtype == dtype and not view.flags.owndata and view.base is not None
        assert view.ctypes.data == arr.buffers()[1].address + arr.offset * view.itemsize
        assert np.shares_memory(view, row.column(name))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns that the Arrow buffer is read-only
            tensor = torch.from_numpy(view)
        assert tensor.data_ptr() == view.ctypes.data
        assert tensor.tolist() == arr.to_pylist()


# --- bad input --------------------------------------------------------------------------------


def _sample(**fields) -> Sample:
    s = Sample.build([1, 2, 3], [0, 1, 1], [0, -0.5, -0.5], sample_id=11)
    for k, v in fields.items():
        setattr(s, k, v)
    return s


BAD_SAMPLES = {
    "short_mask": (dict(completion_mask=np.array([0, 1], np.int8)), "completion_mask"),
    "short_logprobs": (dict(sampler_logprobs=np.zeros(4, np.float32)), "sampler_logprobs"),
    "empty": (
        dict(
            input_ids=np.zeros(0, np.int32),
            completion_mask=np.zeros(0, np.int8),
            sampler_logprobs=np.zeros(0, np.float32),
        ),
        "input_ids",
    ),
    "no_trained_token": (dict(completion_mask=np.array([0, 0, 0], np.int8)), "completion_mask"),
    "first_token_trained": (dict(completion_mask=np.array([1, 1, 1], np.int8)), "completion_mask[0]"),
    "mask_value_2": (dict(completion_mask=np.array([0, 2, 1], np.int8)), "completion_mask[1]"),
}


def _apis(backend, sample: Sample):
    """Every entry point that takes a sample object."""
    return {
        "pack_row": lambda: backend.pack_row([sample], 16),
        "push_samples": lambda: backend.batcher(2, 16).push_samples([_sample(sample_id=1), sample]),
    }


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("case", BAD_SAMPLES)
def test_invalid_samples_raise_packing_error_naming_the_field(backend, case):
    fields, field = BAD_SAMPLES[case]
    field = re.escape(field)
    for call in _apis(backend, _sample(**fields)).values():
        with pytest.raises(PackingError, match=f"sample 11: `{field}`"):
            call()
    with pytest.raises(PackingError, match=f"`{field}`"):
        samples_to_arrow([_sample(**fields)])
    s = _sample(**fields)  # the same sample built with pyarrow alone reaches the batcher's decoder
    bad = pa.RecordBatch.from_pylist(
        [
            {
                "sample_id": 11,
                "group_id": 0,
                "prompt_index": 0,
                "input_ids": s.input_ids.tolist(),
                "completion_mask": s.completion_mask.tolist(),
                "sampler_logprobs": s.sampler_logprobs.tolist(),
                "advantage": 0.0,
                "policy_version": 0,
            }
        ],
        schema=sample_schema(),
    )
    with pytest.raises(PackingError, match=f"`{field}`"):
        backend.batcher(1, 16).push(bad)


#: The Rust core's error variant and field for each bad sample (packer_rs/src/error.rs, sample.rs ``validate``).
BAD_SAMPLE_KINDS = {
    "short_mask": ("LengthMismatch", "completion_mask"),
    "short_logprobs": ("LengthMismatch", "sampler_logprobs"),
    "empty": ("EmptySample", "input_ids"),
    "no_trained_token": ("NoTrainedToken", "completion_mask"),
    "first_token_trained": ("FirstTokenTrained", "completion_mask"),
    "mask_value_2": ("BadMask", "completion_mask"),
}


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("case", BAD_SAMPLES)
def test_both_backends_raise_one_structured_packing_error(backend, case):
    kind, field = BAD_SAMPLE_KINDS[case]
    for call in [
        *_apis(backend, _sample(**BAD_SAMPLES[case][0])).values(),
        lambda: samples_to_arrow([_sample(**BAD_SAMPLES[case][0])]),
    ]:
        with pytest.raises(PackingError) as err:
            call()
        assert type(err.value) is PackingError, "never packer_rs's own exception class"
        assert (err.value.kind, err.value.field, err.value.sample_id) == (kind, field, 11)


@pytest.mark.parametrize("backend", BOTH)
def test_budget_ranks_fit_schema_and_type_errors_are_structured(backend):
    def raised(call):
        with pytest.raises(PackingError) as err:
            call()
        return err.value.kind, err.value.field, err.value.sample_id

    assert raised(lambda: backend.batcher(2, 0)) == ("BadBudget", "token_budget", None)
    assert raised(lambda: backend.batcher(0, 16)) == ("BadRanks", "num_ranks", None)
    assert raised(
        lambda: backend.pack_row(
            [
                _sample(
                    sample_id=5,
                    input_ids=np.arange(1, 9, dtype=np.int32),
                    completion_mask=np.array([0] + [1] * 7, np.int8),
                    sampler_logprobs=np.zeros(8, np.float32),
                )
            ],
            4,
        )
    ) == ("DoesNotFit", "token_budget", 5)
    no_ids = samples_to_arrow([_sample()]).drop_columns(["input_ids"])
    assert raised(lambda: backend.batcher(1, 16).push(no_ids)) == ("Schema", "input_ids", None)
    assert raised(lambda: backend.pack_row([_sample(input_ids=np.array([1, 2, 3], np.int64))], 16)) == (
        "BadInput",
        "input_ids",
        None,
    )
    lists = TokenLists(np.array([0, 2, 1, 2], np.int32), np.array([1, 2], np.int32), np.zeros(2, np.float32))
    assert raised(lambda: backend.pack_row([_sample(sampler_topk=lists)], 16)) == ("BadTokenLists", "sampler_topk", 11)


def test_the_row_layout_is_the_rust_cores():
    with pytest.raises(PackingError, match="`rows` is not a packed-row part") as err:
        base.row_schema("rows")
    assert (err.value.kind, err.value.field) == ("Schema", "rows")
    assert list(base.ROW_PARTS) == ["tokens", "segments", "kv", "loss", "samples"]
    assert base.ROW_COUNTS == ("num_forwarded", "num_trained", "num_raw", "num_samples", "load")
    assert base.row_schema("loss", with_topk=True, with_mask=True).names == [
        *base.ROW_PARTS["loss"],
        "sampler_topk_ids",
        "sampler_topk_logprobs",
        "sampling_mask",
    ]
    for backend in (RUST, PYTHON):  # both backends' rows follow the one schema, part by part
        row = backend.pack_row(_samples(), 64)
        for part in base.ROW_PARTS:
            with_topk = "sampler_topk_ids" in getattr(row, part).schema.names
            with_mask = "sampling_mask" in getattr(row, part).schema.names
            assert getattr(row, part).schema.equals(base.row_schema(part, with_topk, with_mask)), (backend.name, part)


@pytest.mark.parametrize("backend", BOTH)
def test_bad_budget_and_ranks(backend):
    for budget in (0, -3):
        with pytest.raises(PackingError, match=f"`token_budget` must be a positive number of tokens, got {budget}"):
            backend.batcher(2, budget)
        for samples in (_samples(), []):
            with pytest.raises(PackingError, match="`token_budget`"):
                backend.pack_row(samples, budget)
    with pytest.raises(PackingError, match="`num_ranks` must be at least 1, got 0"):
        backend.batcher(0, 16)
    with pytest.raises(PackingError, match="token_budget"):  # a sample that does not fit its row
        backend.pack_row(_samples(), 4)


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(input_ids=np.array([1, 2, 3], np.int64)), "input_ids"),
        (dict(completion_mask=np.array([0, 1, 1], np.float32)), "completion_mask"),
        (dict(sampler_logprobs=np.array([0, -0.5, -0.5], np.float64)), "sampler_logprobs"),
    ],
    ids=["int64_ids", "float_mask", "float64_logprobs"],
)
def test_wrong_dtypes_raise_packing_error(backend, fields, field):
    for call in _apis(backend, _sample(**fields)).values():
        with pytest.raises(PackingError, match=f"`{field}`"):
            call()


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize(
    "attr, lists",
    [
        (
            "sampler_topk",
            TokenLists(np.array([0, 2, 1, 2], np.int32), np.array([1, 2], np.int32), np.zeros(2, np.float32)),
        ),
        ("sampling_mask", TokenLists(np.array([0, 1, 2], np.int32), np.array([1, 2], np.int32))),
    ],
    ids=["decreasing_offsets", "too_few_entries"],
)
def test_bad_token_lists_raise_packing_error(backend, attr, lists):
    for call in _apis(backend, _sample(**{attr: lists})).values():
        with pytest.raises(PackingError, match=f"`{attr}`"):
            call()


def _replace(batch: pa.RecordBatch, name: str, array: pa.Array) -> pa.RecordBatch:
    return batch.set_column(batch.schema.get_field_index(name), name, array)


GOOD = samples_to_arrow([_sample()])
MISTYPED = {
    "int64_ids": (_replace(GOOD, "input_ids", pa.array([[1, 2, 3]], pa.list_(pa.int64()))), "input_ids"),
    "float_mask": (
        _replace(GOOD, "completion_mask", pa.array([[0.0, 1.0, 1.0]], pa.list_(pa.float32()))),
        "completion_mask",
    ),
    "int32_sample_id": (_replace(GOOD, "sample_id", pa.array([11], pa.int32())), "sample_id"),
    "string_ids": (_replace(GOOD, "input_ids", pa.array([["1", "2", "3"]])), "input_ids"),
}


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("column", ["input_ids", "completion_mask", "advantage", "sample_id"])
def test_missing_arrow_column_raises_packing_error(backend, column):
    with pytest.raises(PackingError, match=f"column `{column}` is missing"):
        backend.batcher(1, 16).push(GOOD.drop_columns([column]))


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("case", MISTYPED)
def test_mistyped_arrow_column_raises_packing_error(backend, case):
    batch, column = MISTYPED[case]
    with pytest.raises(PackingError, match=f"column `{column}` has type"):
        backend.batcher(1, 16).push(batch)


def test_mistyped_arrow_column_in_decoders():
    for batch, column in MISTYPED.values():
        with pytest.raises(PackingError, match=f"`{column}`"):
            samples_from_arrow(batch)


@pytest.mark.parametrize("backend", BOTH)
def test_a_bad_batch_leaves_the_batcher_unchanged(backend):
    def stream(n: int, offset: int) -> pa.RecordBatch:
        return samples_to_arrow(
            [
                Sample.build([offset + i, 2, 3, 4], [0, 0, 1, 1], sample_id=offset + i, group_id=(offset + i) // 2)
                for i in range(n)
            ]
        )

    first, last = stream(5, 0), stream(6, 100)
    valid = stream(2, 50).to_pylist()
    oversize = dict(
        valid[0], sample_id=60, input_ids=list(range(40)), completion_mask=[0] + [1] * 39, sampler_logprobs=[0.0] * 40
    )
    invalid = dict(valid[1], sample_id=61, completion_mask=[0, 0, 0, 0])
    bad = pa.RecordBatch.from_pylist(valid + [oversize, invalid], schema=sample_schema())
    b, ref = backend.batcher(2, 12), backend.batcher(2, 12)
    got = b.push(first)
    with pytest.raises(PackingError, match="sample 61: `completion_mask`"):
        b.push(bad)
    assert b.dropped_oversize_count == 0
    got += b.push(last) + b.finish()
    want = ref.push(first) + ref.push(last) + ref.finish()
    assert len(got) == len(want) >= 2
    assert all(r.equals(s) for x, y in zip(got, want) for r, s in zip(x, y))
    assert sum(r.num_samples for mb in got for r in mb) == 11


def test_policy_version_out_of_int32_range_is_rejected():
    with pytest.raises(PackingError, match="policy_version"):
        samples_to_arrow([Sample.build([1, 2], [0, 1], policy_version=2**31)])


# --- backend selection ----------------------------------------------------------------------


def test_unknown_backend_lists_the_installed_ones():
    assert {"python", "rust"} <= set(available_packers())
    with pytest.raises(ConfigError, match=r"no packer named 'cuda'; installed: \[.*'python', 'rust'") as e:
        get_packer("cuda")
    assert isinstance(e.value, ValueError)
    assert get_packer().name == "rust" and get_packer("python").name == "python"


@pytest.fixture
def third_party_dist(tmp_path, monkeypatch):
    """A real installed distribution on sys.path whose entry points register two packers."""
    (tmp_path / "grpo_test_thirdparty.py").write_text(
        "from grpo_core.packing.python_backend import PythonPacker\n\n"
        "class ThirdPartyPacker(PythonPacker):\n    name = 'third-party'\n\n"
        "class NotAPacker:\n    pass\n"
    )
    info = tmp_path / "grpo_test_thirdparty-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: grpo-test-thirdparty\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[grpo_core.packers]\nthird-party = grpo_test_thirdparty:ThirdPartyPacker\n"
        "not-a-packer = grpo_test_thirdparty:NotAPacker\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    base._entry_points.cache_clear()
    yield
    monkeypatch.undo()
    base._entry_points.cache_clear()


def test_third_party_backend_is_found_through_its_entry_point(third_party_dist):
    assert {"third-party", "not-a-packer", "rust", "python"} <= set(available_packers())
    packer = get_packer("third-party")
    assert type(packer).__name__ == "ThirdPartyPacker" and packer.name == "third-party"
    assert packer.pack_row(_samples(), 64).equals(RUST.pack_row(_samples(), 64))
    with pytest.raises(ConfigError, match="'not-a-packer' .* does not implement grpo_core.packing.Packer"):
        get_packer("not-a-packer")


# --- a row worked out by hand -------------------------------------------------------------------


@pytest.mark.parametrize("backend", BOTH)
def test_three_sample_row_by_hand(backend):
    # Trie: 1-2-3 branches to 4-5 and 6-7 (group 0); 9-2 is a second root (group 1).
    # Depth-first:  pos 0 1 2 3 4 5 6 7 8
    #               tok 1 2 3 4 5 6 7 9 2
    samples = [
        Sample.build([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [0, 0, -1, -2, -3], sample_id=0, group_id=0, advantage=0.5),
        Sample.build([1, 2, 3, 6, 7], [0, 0, 1, 1, 1], [0, 0, -4, -5, -6], sample_id=1, group_id=0, advantage=-0.5),
        Sample.build([9, 2], [0, 1], [0, -7], sample_id=2, group_id=1, advantage=2.0),
    ]
    row = backend.pack_row(samples, 9)  # exactly the 9 forwarded tokens

    def col(name):
        return row.column(name).tolist()

    assert col("input_ids") == [1, 2, 3, 4, 5, 6, 7, 9, 2]
    assert col("position_ids") == [0, 1, 2, 3, 4, 3, 4, 0, 1]
    assert col("subtree_end") == [7, 7, 7, 5, 5, 7, 7, 9, 9]
    # Segments (chains ending at a branch or leaf): [0,3) [3,5) [5,7) [7,9); keys = root-to-end paths.
    assert col("cu_seqlens_q") == [0, 3, 5, 7, 9]
    assert col("kv_index") == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8]
    assert col("cu_seqlens_k") == [0, 3, 8, 13, 15]
    # Trained token t is predicted at the position of token t-1: 3<-2@1, 4<-3@2, 5<-4@3; 3<-2@1, 6<-3@2,
    # 7<-6@5; 2<-9@7.
    assert col("token_index") == [1, 2, 3, 1, 2, 5, 7]
    assert col("target_id") == [3, 4, 5, 3, 6, 7, 2]
    assert col("sampler_logprob") == [-1, -2, -3, -4, -5, -6, -7]
    assert col("advantage") == [0.5, 0.5, 0.5, -0.5, -0.5, -0.5, 2.0]
    assert col("sample_index") == [0, 0, 0, 1, 1, 1, 2]
    assert col("num_tokens") == [5, 5, 2] and col("num_trained") == [3, 3, 1]
    assert (row.num_forwarded, row.num_trained, row.num_raw, row.num_samples) == (9, 7, 12, 3)
    assert row.load == 1 + 2 + 3 + 4 + 5 + 4 + 5 + 1 + 2 == 27
    assert row.packing_ratio == 12 / 9
    with pytest.raises(PackingError, match="token_budget"):
        backend.pack_row(samples, 8)


@pytest.mark.parametrize("backend", BOTH)
def test_rows_cross_ranks_in_the_rust_layout_unchanged(backend):

    row = backend.pack_row(_samples(), 64)
    back = base.PackedRow.from_ipc(row.to_ipc())
    assert back.equals(row) and back.num_forwarded == row.num_forwarded == len(row.column("input_ids"))
    assert [getattr(back, c) for c in base.ROW_COUNTS] == [row.num_forwarded, row.num_trained, row.num_raw, 3, row.load]


@pytest.mark.parametrize("backend", ["python", "rust"])
def test_masked_token_frac_counts_a_trie_position_shared_by_duplicates_once(backend):
    """Two identical completions of one prompt share every trie position: p + c positions are forwarded, c of them
    (the last prompt token and the completion's first c - 1) predict a trained token, so 1 - c / (p + c) of the
    forwarded positions train nothing, though each sample's c loss terms count in trained_tokens (2 c)."""
    import numpy as np

    from grpo_core.packing import Sample, get_packer, micro_batch_stats

    p, c = 5, 3
    ids = np.arange(1, p + c + 1, dtype=np.int32)
    mask = np.array([0] * p + [1] * c, dtype=np.int8)
    logprobs = np.zeros(p + c, dtype=np.float32)
    samples = [Sample(i, 0, 0, ids.copy(), mask.copy(), logprobs.copy(), 1.0 - 2 * i) for i in range(2)]
    row = get_packer(backend).pack_row(samples, 64)
    stats = micro_batch_stats([row], 64)
    assert (stats["forwarded_tokens"], stats["trained_tokens"], stats["trained_positions"]) == (p + c, 2 * c, c)
    assert 0.0 <= 1 - stats["trained_positions"] / stats["forwarded_tokens"] == pytest.approx(1 - c / (p + c))
