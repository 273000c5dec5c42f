"""An Arrow IPC file as a sample source: for tests, benchmarks and offline runs.

Serves the samples of a Sample-schema IPC file group by group, in file order,
with the same :class:`~grpo_core.transport.types.SampleSource` shape as the rollout
engine's Flight source, so the trainer cannot tell them apart.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from grpo_core.packing import read_samples_ipc
from grpo_core.transport.types import PulledBatch, ResumeState


class ArrowFileSource:
    """Samples from an Arrow IPC file (Sample schema), whole groups per pull.

    Args:
        path: the IPC file.
        max_staleness: kept for the interface; file samples are never stale.
        resume: prompts it marks done are skipped (as the rollout engine would).
    """

    def __init__(self, path: str | Path, *, max_staleness: int = 0, resume: ResumeState | None = None):  # noqa: ARG002
        batch = read_samples_ipc(path)
        if resume is not None:
            done = np.array([resume.is_done(int(p)) for p in batch.column("prompt_index").to_pylist()], dtype=bool)
            batch = batch.filter(pa.array(~done)) if len(done) else batch
        self._batch = batch
        self._groups = self._group_bounds(batch)
        self._next = 0
        self.reports: list[tuple[int, int]] = []

    @staticmethod
    def _group_bounds(batch: pa.RecordBatch) -> list[tuple[int, int]]:
        """``[start, end)`` of each run of equal group ids."""
        g = batch.column("group_id").to_numpy()
        if len(g) == 0:
            return []
        starts = np.concatenate([[0], np.nonzero(g[1:] != g[:-1])[0] + 1])
        ends = np.concatenate([starts[1:], [len(g)]])
        return list(zip(starts.tolist(), ends.tolist()))

    def pull(
        self,
        policy_version: int,  # noqa: ARG002 - the SampleSource interface: a file has no versions
        *,
        min_samples: int = 1,
        timeout_s: float | None = None,  # noqa: ARG002 - and never waits
    ) -> PulledBatch:
        """The next whole groups holding at least ``min_samples`` samples (fewer at the end)."""
        start = end = self._groups[self._next][0] if self._next < len(self._groups) else self._batch.num_rows
        while self._next < len(self._groups) and end - start < min_samples:
            end = self._groups[self._next][1]
            self._next += 1
        return PulledBatch(self._batch.slice(start, end - start), exhausted=self._next >= len(self._groups))

    def report(self, policy_version: int, tokens_consumed: int, held_tokens: int = 0) -> None:  # noqa: ARG002
        """Recorded for tests; a file has no pace to set."""
        self.reports.append((policy_version, tokens_consumed))

    def synced(self, policy_version: int) -> None:
        """Recorded for tests (as a report of no tokens); a file has no servers to wait for."""
        self.reports.append((policy_version, 0))

    def metrics(self) -> dict[str, float]:
        """No rollout-side metrics."""
        return {}

    def close(self) -> None:
        """Nothing to release."""
