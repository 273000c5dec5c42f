"""The rollout side's logging windows: the metric window and the completion sample, thread-safe.

The rollout loop adds values from its event loop while the Flight server drains the window
from its own threads (the ``metrics`` and ``completions`` actions); the aggregation rules
(DESIGN.md §7) are the shared ones of ``grpo_core.tracking.metrics``.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable
from typing import Any

from grpo_core.tracking.metrics import MetricWindow as _Window


class MetricWindow(_Window):
    """Thread-safe :class:`grpo_core.tracking.metrics.MetricWindow` with a few conveniences."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def add(self, name: str, value: float) -> None:
        """Record one value (per rollout, sample or call; or a count)."""
        with self._lock:
            super().add(name, value)

    def add_many(self, name: str, values: Iterable[float]) -> None:
        """Record several values of one name."""
        with self._lock:
            for v in values:
                super().add(name, v)

    def add_rate(self, name: str, amount: float, seconds: float) -> None:
        """Add to a rate reported as total amount / total seconds."""
        with self._lock:
            super().rate(name, amount, seconds)

    def drain(self) -> dict[str, float]:
        """The aggregated window, then start a new one."""
        with self._lock:
            return super().flush()


class CompletionSample:
    """A uniform sample of at most ``size`` completion rows per logging window (reservoir sampling).

    Algorithm R (J. S. Vitter, "Random sampling with a reservoir", ACM TOMS 11(1), 1985): the
    i-th row offered (0-based) replaces a random kept row with probability ``size / (i + 1)``, so
    every row of the window is kept with the same probability whatever the window's length, in
    O(size) memory.

    Args:
        size: rows kept per window (``tracking.num_completions_to_print``); None = every row.
        seed: seed of the sampling decisions.
    """

    def __init__(self, size: int | None, seed: int = 0) -> None:
        self.size = size
        self._rng = random.Random(seed)
        self._rows: list[dict[str, Any]] = []
        self._seen = 0
        self._lock = threading.Lock()

    def offer(self, row: dict[str, Any]) -> None:
        """Consider one row for the current window's sample."""
        with self._lock:
            if self.size is None or len(self._rows) < self.size:
                self._rows.append(row)
            else:
                j = self._rng.randrange(self._seen + 1)
                if j < self.size:
                    self._rows[j] = row
            self._seen += 1

    def drain(self) -> list[dict[str, Any]]:
        """The window's sample (in the order rows were kept); a new window starts."""
        with self._lock:
            rows, self._rows, self._seen = self._rows, [], 0
            return rows
