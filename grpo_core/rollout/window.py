"""The rollout side's metric window: ``grpo_core.metrics.MetricWindow`` made thread-safe.

The rollout loop adds values from its event loop while the Flight server drains the window
from its own threads (the ``metrics`` action); the aggregation rules (DESIGN.md §7) are the
shared ones of ``grpo_core.metrics``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from grpo_core.metrics import MetricWindow as _Window


class MetricWindow(_Window):
    """Thread-safe :class:`grpo_core.metrics.MetricWindow` with a few conveniences."""

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
