"""Pace of the rollout: token allowance (staleness) and adaptive concurrency (DESIGN.md §5).

- :class:`TokenAllowance`: the trainer reports the tokens it used per step; the rollout may
  hold at most ``(max_staleness + 1) x`` that many tokens queued + in flight + pulled by the
  trainer and not yet trained (the step being trained counts until its report), and starts a
  new group only while under it: a group started at policy version ``v`` then has at most
  ``max_staleness + 1`` steps of tokens ahead of it, the steps that train versions ``v`` to
  ``v + max_staleness`` (one sync per step). The hard bound is the trainer's: it drops a sample
  older than ``max_staleness`` when it assembles a step; this pacing keeps such drops rare
  instead of letting pulled samples pile up in the trainer. Before the first report it assumes ``first_step_tokens``
  (full rows); until the first group completes it starts one group at a time (seed manual,
  "concurrency"). A group in flight counts the tokens it may *queue*: a group whose rewards all
  tie is dropped and never reaches the trainer, so it cannot make anything stale
  (see :meth:`TokenAllowance.expected_group_tokens`).
- :class:`ConcurrencyCap`: a live limit on rollouts in flight, adjusted from the server's
  ``/metrics``: start at KV-cache tokens / max_model_len; usage < 60% with nothing waiting
  -> x1.25 (at most once per cap's worth of finished rollouts); usage > 80% -> x0.7; no
  ``/metrics`` -> ``max_concurrent_rollouts``; never above ``max_concurrent_rollouts``.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import deque
from collections.abc import Callable

#: Completed groups whose queued tokens estimate what a group in flight will queue (recent ones: the share of
#: dropped groups changes as the policy learns).
YIELD_WINDOW_GROUPS = 64


def kept_fraction_upper(kept: int, total: int, z: float = 2.0) -> float:
    """Upper end of the Wilson score interval of a proportion: ``kept`` of ``total`` groups were queued.

    E. B. Wilson, "Probable inference, the law of succession, and statistical inference", JASA 22 (1927):
    ``(p + z²/2n + z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)`` with ``p = kept / total``; ``z = 2`` is about a
    97.7% one-sided bound. 1 when ``total`` is 0.
    """
    if total <= 0:
        return 1.0
    p, n = kept / total, total
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z * z / n))


class TokenAllowance:
    """Thread-safe token accounting between the loop (asyncio thread) and the Flight server threads.

    Args:
        max_staleness: steps the rollout may run ahead of the trainer.
        first_step_tokens: tokens per step assumed before the first report.
    """

    def __init__(self, max_staleness: int, first_step_tokens: int) -> None:
        self.factor = max_staleness + 1
        self.step_tokens = first_step_tokens
        self.policy_version = 0
        # The newest policy version the servers are known to serve: fresh servers hold the base weights (0)
        # until the trainer says it synced (``synced``, or a step ``report``).
        self.served_version = 0
        self.trainer_step = 0  # optimizer steps done: one report per step (set from the resume state)
        self.queued_tokens = 0
        #: raw tokens the trainer pulled and has neither trained nor dropped: set by each report, raised by each pull
        self.held_tokens = 0
        self.in_flight_groups = 0
        self.completed_groups = 0
        self._recent: deque[tuple[int, bool]] = deque(maxlen=YIELD_WINDOW_GROUPS)  # (raw tokens, queued)
        self._lock = threading.Lock()
        #: called with ``(trainer_step, policy_version)`` after each report (the eval board's step trigger), or None
        self.on_report: Callable[[int, int], None] | None = None

    @property
    def limit(self) -> int:
        """Tokens that may be queued + in flight + held by the trainer."""
        return self.factor * self.step_tokens

    def report(self, policy_version: int, tokens_consumed: int, held_tokens: int = 0) -> None:
        """The trainer's feedback after each optimizer step (so reports also count the steps).

        Args:
            policy_version: the trainer's policy version after the step.
            tokens_consumed: raw tokens of the step's samples (0: keep the last step size).
            held_tokens: raw tokens the trainer still holds, pulled but neither trained nor dropped.
        """
        with self._lock:
            self.held_tokens = max(held_tokens, 0)
            self.trainer_step += 1
            self.policy_version = max(self.policy_version, policy_version)
            self.served_version = max(self.served_version, policy_version)
            if tokens_consumed > 0:
                self.step_tokens = tokens_consumed
            step, version = self.trainer_step, self.policy_version
        if self.on_report is not None:
            self.on_report(step, version)

    def synced(self, policy_version: int) -> None:
        """The trainer pushed ``policy_version`` to every server outside a step (a resumed trainer's first sync)."""
        with self._lock:
            self.served_version = max(self.served_version, policy_version)

    def expected_group_tokens(self) -> float:
        """Tokens a group in flight may queue: the mean raw tokens of the last ``YIELD_WINDOW_GROUPS`` completed
        groups times an upper bound on the fraction of groups that are queued (:func:`kept_fraction_upper`).

        Only queued tokens can lag the trainer; a dropped group (its rewards all tie) never does. Counting
        every group in flight at full size held the rollout to ``limit x`` (share of groups kept) tokens of
        trainable work in flight, far below what the server could run. The upper bound (not the plain share)
        keeps the queue within the limit in all but unlikely runs of kept groups, and stays near 1 until enough
        groups have completed to say otherwise.
        """
        if not self._recent:
            return 0.0
        kept = sum(1 for _, queued in self._recent if queued)
        raw = sum(tokens for tokens, _ in self._recent) / len(self._recent)
        return raw * kept_fraction_upper(kept, len(self._recent))

    def in_flight_tokens(self) -> float:
        """Estimated tokens the groups still generating will queue."""
        return self.in_flight_groups * self.expected_group_tokens()

    def may_start_group(self) -> bool:
        """Whether a new group fits: one at a time before the first completes, then within the limit."""
        with self._lock:
            if self.completed_groups == 0:
                return self.in_flight_groups == 0
            needed = self.queued_tokens + self.held_tokens + self.in_flight_tokens() + self.expected_group_tokens()
            return needed <= self.limit or (self.queued_tokens == 0 and self.in_flight_groups == 0)

    def group_started(self) -> None:
        """Count a group whose rollouts started."""
        with self._lock:
            self.in_flight_groups += 1

    def group_finished(self, tokens: int, queued: bool) -> None:
        """A group finished generating; ``tokens`` enter the queue when ``queued``."""
        with self._lock:
            self.in_flight_groups -= 1
            self.completed_groups += 1
            self._recent.append((tokens, queued))
            if queued:
                self.queued_tokens += tokens

    def group_abandoned(self) -> None:
        """A started group ended without a result (dropped); it leaves the in-flight count only."""
        with self._lock:
            self.in_flight_groups -= 1

    def dequeued(self, tokens: int) -> None:
        """The trainer pulled ``tokens``: they leave the queue and count as held until the next report."""
        with self._lock:
            self.queued_tokens -= tokens
            self.held_tokens += tokens

    def requeued(self, tokens: int) -> None:
        """A pull the trainer never received came back to the queue: ``tokens`` count as queued again."""
        with self._lock:
            self.queued_tokens += tokens
            self.held_tokens = max(self.held_tokens - tokens, 0)


class ConcurrencyCap:
    """An adjustable semaphore over rollouts in flight.

    Args:
        max_concurrent_rollouts: the hard ceiling.
    """

    def __init__(self, max_concurrent_rollouts: int) -> None:
        self.ceiling = max_concurrent_rollouts
        self.cap = max_concurrent_rollouts
        self.in_flight = 0
        self.finished_since_raise = 0
        self._cond = asyncio.Condition()

    async def acquire(self) -> None:
        """Wait for a free slot under the current cap."""
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_flight < self.cap)
            self.in_flight += 1

    async def release(self) -> None:
        """Free a slot (a rollout finished)."""
        async with self._cond:
            self.in_flight -= 1
            self.finished_since_raise += 1
            self._cond.notify_all()

    async def set_cap(self, cap: int) -> None:
        """Set the number of concurrent rollouts (clamped to ``[1, ceiling]``); waiters are woken."""
        async with self._cond:
            self.cap = max(1, min(int(cap), self.ceiling))
            self._cond.notify_all()

    def initial_cap(self, kv_cache_size_tokens: int | None, max_model_len: int) -> int:
        """KV-cache tokens / max_model_len (requests that fit at full length), within [1, ceiling]."""
        if not kv_cache_size_tokens:
            return self.ceiling
        return max(1, min(self.ceiling, kv_cache_size_tokens // max(max_model_len, 1)))

    def next_cap(self, kv_usage_frac: float, num_waiting: float) -> int:
        """The cap after one ``/metrics`` poll (does not apply it)."""
        if kv_usage_frac > 0.8:
            return max(1, math.floor(self.cap * 0.7))
        if kv_usage_frac < 0.6 and num_waiting == 0 and self.finished_since_raise >= self.cap:
            return min(self.ceiling, max(self.cap + 1, math.ceil(self.cap * 1.25)))
        return self.cap

    async def update(self, kv_usage_frac: float, num_waiting: float) -> int:
        """Apply one poll's rule; returns the new cap."""
        new = self.next_cap(kv_usage_frac, num_waiting)
        if new > self.cap:
            self.finished_since_raise = 0
        await self.set_cap(new)
        return self.cap
