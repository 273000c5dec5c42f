"""Metric logging windows with the aggregation rules of DESIGN.md §7, and sinks.

Within one window (everything recorded since the last flush):

* a name whose last path part has the word ``count`` (between ``_``) is summed;
* a name whose last part has the word ``max`` / ``min`` keeps the extreme;
* a rate (``*_per_s``) is total/total: record it with :meth:`MetricWindow.rate`
  (numerator and seconds), and the window divides the sums;
* anything else is the mean of the recorded values.

Sinks receive ``(step, {name: value})``; the JSON-lines sink here has no
dependency, the MLflow sink lives in ``grpo_core.tracking.mlflow_sink``.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

from grpo_core.run.durable import JsonlAppender, read_jsonl


def aggregation(name: str) -> str:
    """``"sum"``, ``"max"``, ``"min"`` or ``"mean"`` for a metric name (DESIGN.md §7): by the words of its last path
    part, split at ``_`` (the seed manual's rule names the word: ``completions/mean_terminated_length`` is a mean,
    though "terminated" holds the letters "min")."""
    words = name.rsplit("/", 1)[-1].split("_")
    if "count" in words:
        return "sum"
    if "max" in words:
        return "max"
    if "min" in words:
        return "min"
    return "mean"


class MetricWindow:
    """Accumulates metric values until :meth:`flush` (one logging window)."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = defaultdict(list)
        self._rates: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])

    def add(self, name: str, value: float) -> None:
        """Record one value of ``name`` (NaN values are ignored)."""
        value = float(value)
        if not math.isnan(value):
            self._values[name].append(value)

    def update(self, values: Mapping[str, float]) -> None:
        """Record several values."""
        for k, v in values.items():
            self.add(k, v)

    def rate(self, name: str, amount: float, seconds: float) -> None:
        """Record ``amount`` over ``seconds`` for a rate metric (total/total)."""
        acc = self._rates[name]
        acc[0] += float(amount)
        acc[1] += float(seconds)

    def flush(self) -> dict[str, float]:
        """The window's aggregated metrics; the window starts empty again."""
        out: dict[str, float] = {}
        for name, values in self._values.items():
            how = aggregation(name)
            if how == "sum":
                out[name] = sum(values)
            elif how == "max":
                out[name] = max(values)
            elif how == "min":
                out[name] = min(values)
            else:
                out[name] = sum(values) / len(values)
        for name, (amount, seconds) in self._rates.items():
            if seconds > 0:
                out[name] = amount / seconds
        self._values.clear()
        self._rates.clear()
        return out


def merge(windows: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Combine already-aggregated dicts with the same rules (means are averaged)."""
    w = MetricWindow()
    for d in windows:
        w.update(d)
    return w.flush()


#: ``eval@12/pass_at_4``: a metric of step 12 carried in a later window (the head's ``@N`` names the step).
_AT_STEP = re.compile(r"^([^/@]+)@(\d+)/(.+)$")


def at_step(name: str, step: int) -> str:
    """``name`` tagged with the step it belongs to, for a window drained at a later step: ``eval/pass_at_4`` of step
    12 becomes ``eval@12/pass_at_4`` (its last part, and so its aggregation, unchanged). The trainer logs it at step 12
    as ``eval/pass_at_4`` (:func:`split_at_step`)."""
    head, sep, tail = name.partition("/")
    if not sep or "@" in head:
        raise ValueError(f"at_step needs a name 'section/metric' without '@' in its section; got {name!r}")
    return f"{head}@{step}/{tail}"


def split_at_step(metrics: Mapping[str, float]) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """Split a drained window into its own metrics and those tagged by :func:`at_step`: ``(plain, {step: {name:
    value}})`` with the names untagged."""
    plain: dict[str, float] = {}
    tagged: dict[int, dict[str, float]] = defaultdict(dict)
    for name, value in metrics.items():
        m = _AT_STEP.match(name)
        if m is None:
            plain[name] = value
        else:
            tagged[int(m[2])][f"{m[1]}/{m[3]}"] = value
    return plain, dict(tagged)


class MetricsSink(Protocol):
    """Where flushed metric windows go (JSON lines, MLflow, …)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of optimizer step ``step``."""
        ...

    def close(self) -> None:
        """Flush and release resources."""
        ...


class JsonlSink:
    """Appends one JSON object per logged step to a file: ``{"step": N, ...metrics}``.

    Appending (not truncating) lets a resumed run continue the same file; each line is fsynced, and a
    torn last line left by a killed writer is cut off on open (:class:`grpo_core.run.durable.JsonlAppender`).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._out = JsonlAppender(self.path)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write one line and make it durable."""
        self._out.write({"step": step, **metrics})

    def close(self) -> None:
        """Close the file."""
        self._out.close()

    @staticmethod
    def read(path: str | Path) -> list[dict]:
        """All records of a JSON-lines metrics file (a torn last line is skipped with a warning)."""
        return read_jsonl(path)
