"""The trainer's side of held-out evaluation (``eval``, ``grpo_core.rollout.evaluate``): log each evaluation the
rollout's metric window carries at the step it evaluated, and wait for the last ones when training ends."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from grpo_core.errors import TransportError
from grpo_core.tracking.metrics import MetricsSink, split_at_step

logger = logging.getLogger(__name__)

POLL_S = 0.5


class EvalLog:
    """Logs ``eval/*`` records at their own step.

    Args:
        sink: the trainer's metrics sink (None: nothing is logged).
        every_steps: ``eval.every_steps`` (None = only at the end).
        final_step: ``train.max_steps`` when ``eval.at_end``, else None.
        timeout_s: ``eval.final_timeout_s``: how long :meth:`wait` waits at the end.
        first_step: the step training starts from (a resumed run's checkpoint step): later steps are awaited.
    """

    def __init__(
        self,
        sink: MetricsSink | None,
        every_steps: int | None,
        final_step: int | None,
        timeout_s: float,
        first_step: int,
    ) -> None:
        self.sink, self.every_steps, self.final_step = sink, every_steps, final_step
        self.timeout_s, self.first_step = timeout_s, first_step
        self.logged: set[int] = set()

    def split(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """Log the step-tagged evaluations of a drained rollout window (``grpo_core.tracking.metrics.at_step``); returns
        the window's own metrics."""
        plain, tagged = split_at_step(metrics)
        for step in sorted(tagged):
            if self.sink is not None:
                self.sink.log(step, tagged[step])
            self.logged.add(step)
        return plain

    def expected(self, last_step: int) -> set[int]:
        """The steps after ``first_step`` up to ``last_step`` the rollout evaluates: the multiples of ``every_steps``
        and ``final_step`` when training reached it."""
        due = set(range(self.first_step + 1, last_step + 1)) if self.every_steps else set()
        due = {s for s in due if self.every_steps and s % self.every_steps == 0}
        if self.final_step is not None and last_step == self.final_step > self.first_step:
            due.add(last_step)
        return due

    def wait(self, pull: Callable[[], Mapping[str, float]], last_step: int) -> set[int]:
        """Pull the rollout's window (``pull``, the source's ``metrics``) until every expected evaluation up to
        ``last_step`` is logged or ``timeout_s`` passed; returns the steps still missing (warned about)."""
        missing = self.expected(last_step) - self.logged
        deadline = time.monotonic() + self.timeout_s
        while missing:
            try:
                self.split(pull())
            except TransportError as exc:  # the rollout is gone or failed: training itself is done
                logger.warning("could not collect the evaluations of steps %s: %s", sorted(missing), exc)
                return missing
            missing -= self.logged
            if not missing:
                break
            if time.monotonic() > deadline:
                logger.warning(
                    "the evaluations of steps %s did not finish within eval.final_timeout_s=%.0f s; the run ends "
                    "without them",
                    sorted(missing),
                    self.timeout_s,
                )
                break
            time.sleep(POLL_S)
        return missing
