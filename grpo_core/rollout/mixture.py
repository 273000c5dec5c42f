"""Prompt rows as the rollout reads them: a column mapping onto ``prompt`` and weighted mixtures of datasets.

:class:`PromptView` puts a dataset's prompt column (``prompt_column``) into ``prompt``, as chat messages: a plain
string becomes one user message, after a system message with ``system_prompt`` when one is set and the prompt
has none. Other columns are left as they are (they reach the reward functions).

:class:`Mixture` draws the prompts of an epoch from several datasets (``rollout.datasets``) in proportion to their
weights. Its order is a pure function of the seed, the weights, the sources' sizes and the epoch, so a resume at
any prompt position continues it exactly (``grpo_core.rollout.driver.prompt_stream``):

* epoch ``e`` has ``epoch_size`` positions; position ``k``'s source is drawn i.i.d. with probabilities
  ``weight / sum(weights)`` by NumPy's PCG64 from the seed sequence ``[seed, e, 1]``;
* each source is read as an endless stream of passes over its rows: the ``j``-th prompt the mixture takes from a
  source (counted from the first epoch) is row ``j mod n`` of pass ``j // n`` of it, the pass in a seeded order of
  its own (seed sequence ``[seed, source, pass, 2]``) with ``shuffle``, else in the source's order. A source of
  small weight is thus read through before any row repeats; a source of large weight is repeated pass by pass.

A row's index in a mixture is its index in the sources laid end to end (``offsets``); :meth:`Mixture.source_of`
names its source (the per-source metrics ``rollout/source/<name>/...``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from grpo_core.errors import ConfigError


def as_messages(prompt: Any, system_prompt: str | None) -> Any:
    """A prompt as chat messages: a string is one user message; ``system_prompt`` (when set) is put first unless
    the prompt opens with a system message already. Anything else is returned as is (preflight judges it)."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if system_prompt is None or not isinstance(prompt, list | tuple):
        return prompt
    first = prompt[0] if prompt else None
    if isinstance(first, dict) and first.get("role") == "system":
        return list(prompt)
    return [{"role": "system", "content": system_prompt}, *prompt]


class PromptView:
    """A dataset whose rows carry their ``prompt_column`` as ``prompt`` (chat messages, :func:`as_messages`).

    Map-style when the dataset is (``len``, ``[i]``); iterable always. A row without the column is passed on
    without ``prompt`` (preflight names it).
    """

    def __init__(self, dataset: Any, prompt_column: str = "prompt", system_prompt: str | None = None) -> None:
        self.dataset, self.prompt_column, self.system_prompt = dataset, prompt_column, system_prompt

    def map_row(self, row: Any) -> dict[str, Any]:
        """One row with ``prompt`` set from ``prompt_column``."""
        row = dict(row)
        if self.prompt_column in row:
            row["prompt"] = as_messages(row[self.prompt_column], self.system_prompt)
        return row

    def __len__(self) -> int:
        return len(self.dataset)  # TypeError for a streaming dataset, as num_rows expects

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.map_row(self.dataset[index])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self.map_row(row) for row in self.dataset)


def view(dataset: Any, prompt_column: str = "prompt", system_prompt: str | None = None) -> Any:
    """``dataset`` itself when nothing is mapped (the column is ``prompt``, no system prompt), else a
    :class:`PromptView` of it."""
    if prompt_column == "prompt" and system_prompt is None:
        return dataset
    return PromptView(dataset, prompt_column, system_prompt)


@dataclass(frozen=True)
class Source:
    """One dataset of a mixture: its name (metrics), rows (map-style) and weight (> 0)."""

    name: str
    rows: Any
    weight: float


class Mixture:
    """Several map-style datasets drawn by weight, epoch by epoch (module docstring).

    Attributes:
        sources: the datasets, in config order.
        epoch_size: prompts per epoch (the driver's ``num_rows`` of a mixture).
        seed: seed of the source draw and, with ``shuffle``, of each pass's order.
        offsets: ``int[num_sources + 1]``, where each source's rows start in the end-to-end index.
    """

    def __init__(self, sources: Sequence[Source], epoch_size: int | None, seed: int, shuffle: bool) -> None:
        """Raises:
        ConfigError: no source, a weight that is not positive and finite, or an empty source (names it)."""
        if not sources:
            raise ConfigError("rollout.datasets is empty; list at least one dataset")
        self.sources, self.seed, self.shuffle = list(sources), seed, shuffle
        self.sizes = [len(s.rows) for s in self.sources]
        for source, size in zip(self.sources, self.sizes, strict=True):
            if size == 0:
                raise ConfigError(f"rollout.datasets: {source.name!r} has no rows")
            if not (source.weight > 0 and np.isfinite(source.weight)):
                raise ConfigError(
                    f"rollout.datasets: {source.name!r} has weight {source.weight}; weights are finite and > 0"
                )
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64).tolist()
        self.epoch_size = epoch_size or self.offsets[-1]
        weights = np.asarray([s.weight for s in self.sources], dtype=np.float64)
        weights = weights / weights.max()  # before summing: weights near the float maximum would overflow the sum
        self.probabilities = weights / weights.sum()
        self._counts: list[np.ndarray] = []  # per epoch: prompts taken from each source
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def draws(self, epoch: int) -> np.ndarray:
        """``int64[epoch_size]``: the source of each position of ``epoch``."""
        rng = np.random.default_rng([self.seed, epoch, 1])
        return rng.choice(len(self.sources), size=self.epoch_size, p=self.probabilities)

    def _taken_before(self, epoch: int) -> np.ndarray:
        """``int64[num_sources]``: prompts taken from each source in the epochs before ``epoch``."""
        while len(self._counts) < epoch:
            self._counts.append(np.bincount(self.draws(len(self._counts)), minlength=len(self.sources)))
        taken = np.zeros(len(self.sources), np.int64)
        for counts in self._counts[:epoch]:
            taken += counts
        return taken

    def _pass_order(self, source: int, pass_: int) -> np.ndarray:
        """``int64[n]``: the rows of ``source`` in the order of its pass ``pass_``."""
        key = (source, pass_)
        if key not in self._orders:
            n = self.sizes[source]
            rng = np.random.default_rng([self.seed, source, pass_, 2])
            self._orders[key] = rng.permutation(n) if self.shuffle else np.arange(n)
        return self._orders[key]

    def epoch_rows(self, epoch: int) -> list[int]:
        """The end-to-end row index of each position of ``epoch``, in order."""
        draws, taken = self.draws(epoch), self._taken_before(epoch).copy()
        out = []
        for source in draws.tolist():
            j, n = int(taken[source]), self.sizes[source]
            taken[source] += 1
            out.append(self.offsets[source] + int(self._pass_order(source, j // n)[j % n]))
        return out

    def source_of(self, index: int) -> str:
        """The name of the source holding end-to-end row ``index``."""
        return self.sources[bisect.bisect_right(self.offsets, index) - 1].name

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, index: int) -> dict[str, Any]:
        source = bisect.bisect_right(self.offsets, index) - 1
        return dict(self.sources[source].rows[index - self.offsets[source]])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Every row of every source once, end to end (what preflight checks)."""
        for source in self.sources:
            yield from (dict(row) for row in source.rows)
