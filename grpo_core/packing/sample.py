"""The training sample (DESIGN.md §6) as Python objects, and its Arrow encoding.

A :class:`Sample` holds numpy arrays; a list of samples encodes to one Arrow
``RecordBatch`` of the Sample schema (one row per sample) and back exactly.
The encoding itself runs in packer_rs; this module is its typed face.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

import numpy as np
import pyarrow as pa

import packer_rs

from ..errors import PackingError


@dataclass(eq=False)
class TokenLists:
    """A ragged list of candidate tokens per token of a sample (CSR layout).

    Entry ``t`` is ``ids[offsets[t]:offsets[t + 1]]`` (and the same slice of
    ``logprobs``). Holds the sampler's top-k log-probs per token (score
    centering) or the sampling mask, the candidate set of top-k / top-p / min-p.

    Attributes:
        offsets: ``int32[num_tokens + 1]``, starts at 0, non-decreasing.
        ids: ``int32[num_entries]`` token ids.
        logprobs: ``float32[num_entries]`` natural-log probabilities, or None
            for a sampling mask.
    """

    offsets: np.ndarray
    ids: np.ndarray
    logprobs: np.ndarray | None = None

    def entry(self, t: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Token ``t``'s candidates ``(ids, logprobs)``."""
        a, b = int(self.offsets[t]), int(self.offsets[t + 1])
        return self.ids[a:b], None if self.logprobs is None else self.logprobs[a:b]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenLists):
            return NotImplemented
        same_lp = (self.logprobs is None) == (other.logprobs is None) and (
            self.logprobs is None or other.logprobs is None or np.array_equal(self.logprobs, other.logprobs)
        )
        return np.array_equal(self.offsets, other.offsets) and np.array_equal(self.ids, other.ids) and same_lp


@dataclass(eq=False)
class Sample:
    """One training sample: tokens, which of them are trained, and the sampler's view.

    Per-token arrays have one entry per token (``num_tokens``). Token ``t`` is
    trained iff ``completion_mask[t] == 1``; it is predicted from token
    ``t - 1``, so ``completion_mask[0]`` must be 0.

    Attributes:
        sample_id: unique id of the sample in the run.
        group_id: the group (G rollouts of one prompt) it belongs to.
        prompt_index: index of the prompt in the training dataset.
        input_ids: ``int32[num_tokens]`` token ids (prompt and completion).
        completion_mask: ``int8[num_tokens]``, 1 = trained, 0 = context.
        sampler_logprobs: ``float32[num_tokens]`` sampler log-prob per token
            (vLLM ``processed_logprobs``; 0 where not trained).
        advantage: group-normalised advantage of every trained token.
        policy_version: number of weight syncs before it was generated.
        sampler_topk: optional sampler top-k log-probs per token.
        sampling_mask: optional candidate set per token (top-k / top-p / min-p).
    """

    sample_id: int
    group_id: int
    prompt_index: int
    input_ids: np.ndarray
    completion_mask: np.ndarray
    sampler_logprobs: np.ndarray
    advantage: float
    policy_version: int = 0
    sampler_topk: TokenLists | None = field(default=None)
    sampling_mask: TokenLists | None = field(default=None)

    def __post_init__(self) -> None:
        # The schema stores float32: keep the value it will round-trip to.
        self.advantage = float(np.float32(self.advantage))

    @classmethod
    def build(
        cls,
        input_ids: Sequence[int] | np.ndarray,
        completion_mask: Sequence[int] | np.ndarray,
        sampler_logprobs: Sequence[float] | np.ndarray | None = None,
        *,
        sample_id: int = 0,
        group_id: int = 0,
        prompt_index: int = 0,
        advantage: float = 0.0,
        policy_version: int = 0,
    ) -> Sample:
        """A sample from any array-likes, converted to the schema's dtypes.

        ``sampler_logprobs`` defaults to zeros.
        """
        ids = np.asarray(input_ids, dtype=np.int32)
        logprobs = np.zeros(len(ids), np.float32) if sampler_logprobs is None else sampler_logprobs
        return cls(
            sample_id=sample_id,
            group_id=group_id,
            prompt_index=prompt_index,
            input_ids=ids,
            completion_mask=np.asarray(completion_mask, dtype=np.int8),
            sampler_logprobs=np.asarray(logprobs, dtype=np.float32),
            advantage=float(advantage),
            policy_version=policy_version,
        )

    @property
    def num_tokens(self) -> int:
        """Tokens in the sample."""
        return len(self.input_ids)

    @property
    def num_trained(self) -> int:
        """Trained tokens (loss terms)."""
        return int(np.count_nonzero(self.completion_mask))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        scalars = (
            "sample_id",
            "group_id",
            "prompt_index",
            "advantage",
            "policy_version",
            "sampler_topk",
            "sampling_mask",
        )
        arrays = ("input_ids", "completion_mask", "sampler_logprobs")
        return all(getattr(self, k) == getattr(other, k) for k in scalars) and all(
            np.array_equal(getattr(self, k), getattr(other, k)) for k in arrays
        )


def sample_schema(with_topk: bool = False, with_mask: bool = False) -> pa.Schema:
    """The Sample schema; the optional top-k and sampling-mask columns on request."""
    return packer_rs.sample_schema(with_topk, with_mask)


def _rust(call: Callable[..., Any], *args: Any) -> Any:
    """Call into packer_rs; its ``PackingError`` surfaces as ``grpo_core.errors.PackingError`` with the same
    ``kind``, ``field`` and ``sample_id``."""
    try:
        return call(*args)
    except packer_rs.PackingError as e:
        raise PackingError(str(e), kind=e.kind, field=e.field, sample_id=e.sample_id) from None


def samples_to_arrow(samples: Iterable[Sample]) -> pa.RecordBatch:
    """Encode samples as one RecordBatch of the Sample schema.

    Raises:
        PackingError: a sample is invalid (the message names the field).
    """
    return _rust(packer_rs.encode_samples, list(samples))


def _lists(d: dict | None) -> TokenLists | None:
    return None if d is None else TokenLists(**d)


def samples_from_arrow(batch: pa.RecordBatch) -> list[Sample]:
    """Decode a RecordBatch of the Sample schema (exact inverse of :func:`samples_to_arrow`).

    Raises:
        PackingError: a column is missing or mistyped, or a sample is invalid.
    """
    out = []
    for d in _rust(packer_rs.decode_samples, batch):
        d["sampler_topk"] = _lists(d["sampler_topk"])
        d["sampling_mask"] = _lists(d["sampling_mask"])
        out.append(Sample(**d))
    return out


def write_samples_ipc(path: str | PathLike[str], samples: pa.RecordBatch | Iterable[Sample]) -> None:
    """Write samples (a Sample-schema RecordBatch or Sample objects) to an Arrow IPC file."""
    batch = samples if isinstance(samples, pa.RecordBatch) else samples_to_arrow(samples)
    _rust(packer_rs.write_samples_ipc, path, batch)


def read_samples_ipc(path: str | PathLike[str]) -> pa.RecordBatch:
    """Read every sample of an Arrow IPC file of the Sample schema into one RecordBatch.

    Raises:
        PackingError: the file is missing, unreadable or not of the Sample schema.
    """
    return _rust(packer_rs.read_samples_ipc, path)
