"""Rank 0's data side: pull samples, plan micro-batches, track prompts.

The planner pulls from a :class:`~grpo_core.transport.types.SampleSource`, streams
the samples through the packer's token-budget batcher (one row per rank) and
hands out whole optimizer steps of micro-batches. It remembers every sample
pulled but not yet trained, so a checkpoint can store them as pending samples
and a resumed run can train them without regenerating or repeating a prompt.

Staleness is bounded where a sample is trained (DESIGN.md §5): a step assembled at policy
version ``v`` holds only samples with ``v - sample.policy_version <= max_staleness``. Samples
pulled, packed or restored from a checkpoint that fall behind before their step are dropped
when the step is assembled (the open rows are packed again without them), counted in
``sample/dropped_stale_count`` and settled like the rollout's stale groups: their prompts
count as done, so a resume neither regenerates nor skips them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from grpo_core.errors import NothingToTrainError
from grpo_core.packing import MicroBatch, get_packer, micro_batch_stats
from grpo_core.transport.types import SampleSource

from .checkpoint import PromptTracker

logger = logging.getLogger(__name__)


@dataclass
class UntrainableCounts:
    """What came back from the rollout side without a trainable sample (since a reset).

    Attributes:
        dropped_groups: prompts finished without a trained sample: every reward of the group equal
            (or fewer than two scored), a prompt ``filter_prompt`` rejected, or every sample older
            than ``rollout.max_staleness`` (when pulled, or when the step was assembled).
        oversize_groups: groups whose every sample was longer than the token budget.
        stale_samples: samples dropped as older than ``rollout.max_staleness`` (when pulled or when the
            step was assembled).
        oversize_samples: samples dropped as longer than the token budget.
    """

    dropped_groups: int = 0
    oversize_groups: int = 0
    stale_samples: int = 0
    oversize_samples: int = 0

    @property
    def groups(self) -> int:
        """Groups without a trainable sample, whatever the cause."""
        return self.dropped_groups + self.oversize_groups

    def add(self, other: UntrainableCounts) -> None:
        """Add another count."""
        self.dropped_groups += other.dropped_groups
        self.oversize_groups += other.oversize_groups
        self.stale_samples += other.stale_samples
        self.oversize_samples += other.oversize_samples


@dataclass
class PlannedStep:
    """The micro-batches of one optimizer step and what rank 0 knows about them."""

    micro_batches: list[MicroBatch]
    rollout_wait_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)


class Planner:
    """See module docs.

    Args:
        source: where samples come from.
        num_ranks: rows per micro-batch.
        token_budget: forwarded (and trained) tokens per row.
        backend: packer backend name.
        tracker: prompt bookkeeping (restored from a checkpoint on resume).
        pending: samples restored from a checkpoint, trained first.
        flush_after_s: when a pull brings nothing for this long and no micro-batch is
            ready, the open rows are closed and trained as they are (the rollout side
            may be waiting for this step's token report before it generates more).
        max_untrainable_groups: consecutive groups without a trainable sample after which
            :meth:`next_step` raises ``NothingToTrainError`` (``train.max_untrainable_groups``).
        hints: config values quoted in that error (``packing.token_budget``, ``rollout.max_staleness`` …).
        max_staleness: ``rollout.max_staleness``: a step at policy version ``v`` trains no sample older than
            ``v - max_staleness``; older ones are dropped when the step is assembled. None: no bound (a file of
            samples replayed offline).
    """

    def __init__(
        self,
        source: SampleSource,
        num_ranks: int,
        token_budget: int,
        backend: str,
        tracker: PromptTracker,
        pending: pa.RecordBatch | None = None,
        flush_after_s: float = 10.0,
        max_untrainable_groups: int = 256,
        hints: dict[str, object] | None = None,
        max_staleness: int | None = None,
    ):
        self.source = source
        self.max_staleness = max_staleness
        self.dropped_stale_count = 0  # samples dropped here as stale since the last take_dropped_stale_count()
        self.flush_after_s = flush_after_s
        self.max_untrainable_groups = max_untrainable_groups
        self.hints = dict(hints or {})
        self.streak = UntrainableCounts()  # consecutive, reset by any trainable sample
        self.total = UntrainableCounts()  # over the whole run
        self.num_trainable_samples = 0
        self.token_budget = token_budget
        self.backend, self.num_ranks = backend, num_ranks
        self.batcher = get_packer(backend).batcher(num_ranks, token_budget)
        self.tracker = tracker
        self.ready: list[MicroBatch] = []
        self.held: list[pa.RecordBatch] = []  # pulled batches with samples not yet trained
        self.trained: set[int] = set()  # trained sample ids of the held batches
        self.exhausted = False
        #: the last 256 things done, oldest first: ``("pull", samples)`` per pull, ``("micro_batch", i)`` when a step's
        #: micro-batch ``i`` is handed out (:meth:`stream_step`); a trainer adds its own (tests read the order)
        self.events: deque[tuple[str, int]] = deque(maxlen=256)
        self.dropped_oversize_count = 0
        #: replicas the last pull reported behind the run's policy version (``PulledBatch.servers_behind``)
        self.servers_behind: list[str] = []
        if pending is not None and pending.num_rows:
            self._push(pending)

    def _push(self, batch: pa.RecordBatch, policy_version: int | None = None) -> UntrainableCounts:
        """Hand a pulled batch to the batcher, less the samples over the budget and those too old to train at
        ``policy_version`` (None: no staleness check); returns what was dropped."""
        self.tracker.received(batch.column("prompt_index").to_pylist())
        groups_before = set(batch.column("group_id").to_pylist())
        stale_counts = UntrainableCounts()
        if policy_version is not None:
            batch, stale_counts = self._drop_stale(batch, policy_version)
        oversize = pc.list_value_length(batch.column("input_ids")).to_numpy() > self.token_budget
        if oversize.any():  # dropped here, so that their prompts still count as settled
            self.dropped_oversize_count += int(oversize.sum())
            self.tracker.trained_samples(batch.filter(pa.array(oversize)).column("prompt_index").to_pylist())
            logger.warning(
                "dropped %d samples longer than token_budget=%d; raise packing.token_budget",
                int(oversize.sum()),
                self.token_budget,
            )
            batch = batch.filter(pa.array(~oversize))
        if batch.num_rows:
            self.held.append(batch)
            self._emit(self.batcher.push(batch))
        self.num_trainable_samples += batch.num_rows
        lost = len(groups_before - set(batch.column("group_id").to_pylist()))
        return UntrainableCounts(
            dropped_groups=stale_counts.dropped_groups,
            oversize_groups=lost - stale_counts.dropped_groups,
            stale_samples=stale_counts.stale_samples,
            oversize_samples=int(oversize.sum()),
        )

    def _stale_mask(self, batch: pa.RecordBatch, policy_version: int) -> np.ndarray:
        """``[num_rows]`` bool: samples a step at ``policy_version`` may not train (``rollout.max_staleness``)."""
        if self.max_staleness is None or batch.num_rows == 0:
            return np.zeros(batch.num_rows, dtype=bool)
        versions = batch.column("policy_version").to_numpy(zero_copy_only=False).astype(np.int64)
        return policy_version - versions > self.max_staleness

    def _drop_stale(self, batch: pa.RecordBatch, policy_version: int) -> tuple[pa.RecordBatch, UntrainableCounts]:
        """``batch`` less its samples too old for a step at ``policy_version``, whose prompts are settled (their
        samples count as used, as the oversize ones do); returns it and the count (``stale_samples``, and
        ``dropped_groups``: groups left with no sample)."""
        stale = self._stale_mask(batch, policy_version)
        if not stale.any():
            return batch, UntrainableCounts()
        dropped = batch.filter(pa.array(stale))
        kept = batch.filter(pa.array(~stale))
        self.tracker.trained_samples(dropped.column("prompt_index").to_pylist())
        self.dropped_stale_count += len(dropped)
        groups = set(dropped.column("group_id").to_pylist()) - set(kept.column("group_id").to_pylist())
        logger.info(
            "dropped %d samples more than rollout.max_staleness=%d versions behind policy version %d",
            len(dropped),
            self.max_staleness,
            policy_version,
        )
        return kept, UntrainableCounts(dropped_groups=len(groups), stale_samples=len(dropped))

    def _drop_stale_held(self, policy_version: int) -> None:
        """Drop the held samples (open rows, planned micro-batches, restored pending samples) that a step at
        ``policy_version`` may not train; the rest are packed again, in the order they were pulled."""
        if self.max_staleness is None:
            return
        pending = self.pending_samples()
        if pending is None or not self._stale_mask(pending, policy_version).any():
            return  # nothing to drop: the rows stay as packed
        fresh, counts = self._drop_stale(pending, policy_version)
        self.held, self.trained, self.ready = [], set(), []
        self.batcher = get_packer(self.backend).batcher(self.num_ranks, self.token_budget)
        if fresh.num_rows:
            self.held.append(fresh)
            self._emit(self.batcher.push(fresh))
            if self.exhausted:
                self._emit(self.batcher.finish())
        self._count_untrainable(counts, trainable=fresh.num_rows > 0)

    def take_dropped_stale_count(self) -> int:
        """Samples dropped here as stale since the last call (for ``sample/dropped_stale_count``)."""
        count, self.dropped_stale_count = self.dropped_stale_count, 0
        return count

    def held_tokens(self) -> int:
        """Raw tokens (sum of sample lengths) of the samples pulled and neither trained nor dropped: what the
        trainer holds ahead of the rollout (reported to its token allowance)."""
        pending = self.pending_samples()
        if pending is None:
            return 0
        return int(pc.sum(pc.list_value_length(pending.column("input_ids"))).as_py() or 0)

    def _count_untrainable(self, counts: UntrainableCounts, trainable: bool) -> None:
        """Count a pull's groups without a trainable sample; raise after too many in a row."""
        self.total.add(counts)
        if trainable:
            self.streak = UntrainableCounts()
            return
        self.streak.add(counts)
        if self.streak.groups >= self.max_untrainable_groups:
            raise NothingToTrainError(
                self.explain(
                    f"the last {self.streak.groups} groups in a row brought no trainable sample "
                    f"(train.max_untrainable_groups={self.max_untrainable_groups})",
                    self.streak,
                )
            )

    def explain(self, what: str, counts: UntrainableCounts | None = None, fixes: list[str] | None = None) -> str:
        """A ``NothingToTrainError`` message: what happened, the counts by cause, the config keys to change.

        Args:
            what: what happened (first sentence).
            counts: the counts to quote (default: the whole run's).
            fixes: further changes to propose after those the counts call for.
        """
        c, hint = counts or self.total, self.hints
        parts = [
            what,
            f"Samples dropped before training: {c.dropped_groups} groups by the rollout (every reward "
            f"of the group equal, a filtered prompt, or every sample stale); {c.stale_samples} samples "
            f"older than rollout.max_staleness={hint.get('max_staleness')}; {c.oversize_samples} "
            f"samples ({c.oversize_groups} whole groups) longer than packing.token_budget="
            f"{self.token_budget}",
        ]
        rollout = {
            k: v
            for k, v in self.source.metrics().items()
            if k in ("frac_reward_zero_std", "reward", "completions/mean_length", "rollout/filtered_prompt_count")
        }
        if rollout:
            parts.append("Rollout metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(rollout.items())))
        todo = []
        if c.dropped_groups:
            todo.append(
                "make the rewards of a group differ: a reward that varies (rollout.reward_functions), more "
                f"exploration (rollout.temperature={hint.get('temperature')}) or more rollouts per group "
                f"(rollout.num_generations={hint.get('num_generations')}); or a filter_prompt that accepts "
                "prompts"
            )
        if c.oversize_samples:
            todo.append(
                "raise packing.token_budget or lower rollout.max_completion_length "
                f"(now {hint.get('max_completion_length')}) so samples fit a row"
            )
        if c.stale_samples:
            todo.append("raise rollout.max_staleness")
        todo += fixes or []
        return ". ".join(parts) + (". To change: " + "; ".join(todo) if todo else "")

    def _emit(self, micro_batches: list[MicroBatch]) -> None:
        self.ready.extend(micro_batches)

    def next_step(self, num_micro_batches: int, policy_version: int) -> PlannedStep | None:
        """Up to ``num_micro_batches`` micro-batches (fewer at the end); None when all is trained, or when a pull
        reported generation replicas behind the policy version while the step is not full (:attr:`servers_behind`
        is then set: the caller syncs them and asks again; what was pulled is kept)."""
        stream = self.stream_step(num_micro_batches, policy_version, eager=False)
        try:
            next(stream)  # not eager: only None (replicas behind) comes before the end
        except StopIteration as end:
            return end.value
        stream.close()
        return None

    def stream_step(
        self, num_micro_batches: int, policy_version: int, eager: bool = True
    ) -> Generator[MicroBatch | None, None, PlannedStep | None]:
        """Assemble a step as :meth:`next_step` does, handing out each micro-batch as soon as it is packed.

        Yields each micro-batch of the step (``eager``), in the order :meth:`next_step` would list them, before
        pulling for the next; or None when a pull reported replicas behind the policy version while the step is
        not full (:attr:`servers_behind` is set: the caller may sync them, then resumes the generator). The same
        pulls are made as by :meth:`next_step`, so a step holds the same micro-batches either way; every sample
        of it is checked against ``policy_version`` (``max_staleness``), the version it trains at.

        Args:
            num_micro_batches: the step's micro-batches (fewer at the end of the samples or after a flush).
            policy_version: the version the step trains at.
            eager: False: hand out nothing before the end (only None).

        Returns:
            (``StopIteration.value``) the :class:`PlannedStep` of every micro-batch handed out and those left, or
            None when there was nothing to train.
        """
        wait = 0.0
        self.servers_behind = []
        self._drop_stale_held(policy_version)
        taken: list[MicroBatch] = []

        def short() -> bool:
            return len(taken) + len(self.ready) < num_micro_batches

        while True:
            while eager and self.ready and len(taken) < num_micro_batches:
                taken.append(self.ready.pop(0))
                self.events.append(("micro_batch", len(taken) - 1))
                yield taken[-1]
            if not (short() and not self.exhausted):
                break
            t0 = time.perf_counter()
            pulled = self.source.pull(policy_version, timeout_s=self.flush_after_s)
            wait += time.perf_counter() - t0
            self.events.append(("pull", pulled.samples.num_rows))
            self.servers_behind = list(pulled.servers_behind)
            starved = not (pulled.samples.num_rows or pulled.consumed_prompt_indices or pulled.exhausted)
            if starved:  # train what there is rather than wait for rows the rollout may never fill
                self._emit(self.batcher.finish())
                if self.ready or taken:
                    break
            self.tracker.consumed(pulled.consumed_prompt_indices)
            before, counts = self.num_trainable_samples, UntrainableCounts()
            if pulled.samples.num_rows:
                counts = self._push(pulled.samples, policy_version)
            counts.dropped_groups += len(set(pulled.consumed_prompt_indices))
            counts.stale_samples += pulled.dropped_stale_count
            self._count_untrainable(counts, trainable=self.num_trainable_samples > before)
            if pulled.exhausted:
                self.exhausted = True
                self._emit(self.batcher.finish())
            if self.servers_behind and short() and not self.exhausted:
                yield None
        more = num_micro_batches - len(taken)
        rest, self.ready = self.ready[:more], self.ready[more:]
        for mb in rest if eager else []:
            taken.append(mb)
            self.events.append(("micro_batch", len(taken) - 1))
            yield mb
        step = taken + ([] if eager else rest)
        if not step:
            return None
        return PlannedStep(step, wait, self._stats(step))

    def _stats(self, step: list[MicroBatch]) -> dict[str, float]:
        per_mb = [micro_batch_stats(mb, self.token_budget) for mb in step]
        rows = [r for mb in step for r in mb]
        groups = {g for r in rows for g in r.samples.column("group_id").to_pylist()}
        forwarded = sum(s["forwarded_tokens"] for s in per_mb)
        trained = sum(s["trained_tokens"] for s in per_mb)
        raw = sum(s["raw_tokens"] for s in per_mb)
        return {
            "batch/forwarded_tokens_per_step": forwarded,
            "batch/trained_tokens_per_step": trained,
            "batch/raw_tokens_per_step": raw,
            "batch/samples_per_step": sum(r.num_samples for r in rows),
            "batch/groups_per_step": len(groups),
            "batch/microbatches_per_step": len(step),
            # forwarded positions that train nothing (prompts, masked tokens); a trie position shared by duplicate
            # completions trains once here, though each sample's term counts in trained_tokens_per_step
            "batch/masked_token_frac": 1 - sum(s["trained_positions"] for s in per_mb) / forwarded
            if forwarded
            else 0.0,
            "batch/packing_ratio": raw / forwarded if forwarded else 1.0,
            "batch/row_fill_frac": sum(s["row_fill_frac"] for s in per_mb) / len(per_mb),
            "batch/row_imbalance": sum(s["row_imbalance"] for s in per_mb) / len(per_mb),
            "batch/samples_per_row": sum(s["samples_per_row"] for s in per_mb) / len(per_mb),
            "batch/row_tokens_mean": sum(s["row_tokens_mean"] for s in per_mb) / len(per_mb),
            "batch/row_tokens_max": max(s["row_tokens_max"] for s in per_mb),
        }

    def step_trained(self, step: PlannedStep) -> list[int]:
        """Mark the step's samples trained; returns their prompt indices (one per sample)."""
        rows = [r.samples for mb in step.micro_batches for r in mb]
        prompts = [p for r in rows for p in r.column("prompt_index").to_pylist()]
        self.tracker.trained_samples(prompts)
        self.trained.update(i for r in rows for i in r.column("sample_id").to_pylist())
        self._prune()
        return prompts

    def _prune(self) -> None:
        """Forget held batches whose samples are all trained."""
        keep = []
        for b in self.held:
            ids = b.column("sample_id").to_pylist()
            if all(i in self.trained for i in ids):
                self.trained.difference_update(ids)
            else:
                keep.append(b)
        self.held = keep

    def pending_samples(self) -> pa.RecordBatch | None:
        """Samples pulled but not yet trained: in open rows, in planned micro-batches, or in a step in progress."""
        parts = []
        for b in self.held:
            mask = [i not in self.trained for i in b.column("sample_id").to_pylist()]
            if any(mask):
                parts.append(b.filter(pa.array(mask)))
        return pa.concat_batches(parts) if parts else None
