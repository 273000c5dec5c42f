"""Drives a :class:`RolloutLoop`: prompt order, epochs, resume, token allowance, concurrency polls.

``drive(loop)`` runs until the epochs are done (or forever with ``rollout.num_epochs: null``: the
trainer ends the run at ``train.max_steps``). Groups run as tasks of one ``asyncio.TaskGroup``, so a failing group (a
reward function raising, the server gone past its retries) fails the run at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from grpo_core.errors import RolloutError, ServingError

from .data import iter_rows, num_rows
from .loop import RolloutLoop
from .mixture import Mixture
from .usercode import running_after_timeout

logger = logging.getLogger(__name__)

ALLOWANCE_POLL_S = 0.02


def epoch_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    """The row indices of epoch ``epoch`` in shuffled order (``rollout.shuffle``): a permutation of
    ``range(num_rows)`` drawn by NumPy's PCG64 from the seed sequence ``[seed, epoch]``, so each epoch has its own
    order and the same ``(seed, epoch)`` always gives the same one (a resume continues it exactly)."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows).tolist()


def prompt_stream(
    dataset: Any, num_epochs: int | None, start: int = 0, shuffle_seed: int | None = None
) -> Iterator[tuple[int, int, int, dict]]:
    """``(epoch, row_index, prompt_index, row)`` in order, from prompt position ``start``.

    ``prompt_index = epoch * num_rows + k`` for the k-th prompt of the epoch, whose dataset row is ``row_index``:
    ``k`` itself in the dataset's order, ``epoch_order(num_rows, shuffle_seed, epoch)[k]`` with a
    ``shuffle_seed``. A :class:`~grpo_core.rollout.mixture.Mixture` has ``epoch_size`` prompts an epoch in its own
    order (``Mixture.epoch_rows``; ``row_index`` is the row's end-to-end index). Map-style datasets jump straight
    to ``start``; streaming ones are read from their first row and the rows before ``start`` skipped (no request is
    made for them), always in their order.
    ``num_epochs`` None = cycle forever.

    Raises:
        RolloutError: the dataset has no rows.
    """
    mixture = dataset if isinstance(dataset, Mixture) else None
    n = mixture.epoch_size if mixture is not None else num_rows(dataset)
    indexable = n is not None
    epoch = start // n if n else 0
    position = epoch * n if n else 0
    while num_epochs is None or epoch < num_epochs:
        if indexable:
            first = max(start - position, 0)
            if mixture is not None:  # its own seeded order (rollout.shuffle_seed), grpo_core.rollout.mixture
                order = mixture.epoch_rows(epoch)
            else:
                order = epoch_order(n, shuffle_seed, epoch) if shuffle_seed is not None else range(n)
            rows = ((order[k], dict(dataset[order[k]])) for k in range(first, n))
            position += first
        else:
            rows = enumerate(iter_rows(dataset))
        count = 0
        for row_index, row in rows:
            count += 1
            if position >= start:
                yield epoch, row_index, position, row
            position += 1
        if n is None:
            n = count
        if n == 0:
            raise RolloutError("the prompt dataset has no rows; check rollout.dataset")
        epoch += 1


def _cap_busy(loop: RolloutLoop) -> bool:
    """A new group's G rollouts do not fit under the concurrency cap beside the unfinished ones (one group always
    may start). Finished rollouts of a group still waiting for its slowest one hold no slot: counting whole groups
    left the server short of requests while each group's long tail ran."""
    g = loop.config.num_generations
    return loop.unfinished_rollouts + g > max(loop.cap.cap, g)


def _score_full(loop: RolloutLoop) -> bool:
    """``rollout.score_queue_maxsize`` finished groups wait for a scoring worker (the bounded scoring stage)."""
    return loop.unscored_groups >= loop.config.score_queue_maxsize


async def _wait_allowance(loop: RolloutLoop) -> None:
    """Wait until a new group may start. Time blocked by the token allowance is ``rollout/backpressure_s`` (one
    value per wait); time held by a full scoring queue is ``rollout/score_block_s``, one value per group start, 0
    when it was not held, so the window's mean is the seconds generation was held per group started."""
    allowance, blocked_s, score_block_s = loop.runtime.allowance, None, 0.0
    while True:
        busy, allowed, full = _cap_busy(loop), allowance.may_start_group(), _score_full(loop)
        if not busy and allowed and not full:
            break
        start = time.monotonic()
        await asyncio.sleep(ALLOWANCE_POLL_S)
        if not allowed and allowance.completed_groups:  # ahead of the trainer (not the first-group rule)
            blocked_s = (blocked_s or 0.0) + time.monotonic() - start
        if full:
            score_block_s += time.monotonic() - start
    if blocked_s is not None:
        loop.window.add("rollout/backpressure_s", blocked_s)
    loop.window.add("rollout/score_block_s", score_block_s)


async def produce(loop: RolloutLoop, tasks: asyncio.TaskGroup) -> None:
    """Walk the prompts: skip trained ones, filter, and start one group task per accepted prompt.

    Raises:
        RolloutError: ``filter_prompt`` rejected every prompt of an epoch.
    """
    cfg, resume = loop.config, loop.runtime.resume
    start = resume.first_untrained_prompt_index if resume else 0
    done = set(resume.trained_above) if resume else set()
    epochs = cfg.num_epochs  # None: cycle until the trainer stops the run at train.max_steps
    current, offered, accepted = -1, 0, 0
    dataset, seed = loop.runtime.dataset, cfg.shuffle_seed if cfg.shuffle else None
    mixture = dataset if isinstance(dataset, Mixture) else None
    if seed is not None and num_rows(dataset) is None:
        logger.warning("rollout.shuffle: the dataset is streaming (no length); its prompts are read in its order")
    for epoch, row_index, prompt_index, row in prompt_stream(dataset, epochs, start, seed):
        if epoch != current:
            _check_epoch(current, offered, accepted)
            current, offered, accepted = epoch, 0, 0
        if prompt_index in done:
            continue
        offered += 1
        if not loop.filter_prompt(row_index, row, epoch):
            loop.runtime.queue.consumed(prompt_index)
            loop.window.add("rollout/filtered_prompt_count", 1)
            continue
        accepted += 1
        if mixture is not None:
            loop.window.add(f"rollout/source/{mixture.source_of(row_index)}/prompt_count", 1)
        await _wait_allowance(loop)
        tasks.create_task(loop.run_group(prompt_index, row_index, epoch, row))
        await asyncio.sleep(0)
    _check_epoch(current, offered, accepted)


def _check_epoch(epoch: int, offered: int, accepted: int) -> None:
    if offered and not accepted:
        raise RolloutError(
            f"filter_prompt rejected all {offered} prompts of epoch {epoch}: no sample can reach the "
            "trainer; relax the filter or stop the run"
        )


async def poll_concurrency(loop: RolloutLoop, first: bool = False) -> None:
    """One ``/metrics`` poll of every healthy replica; adjusts the cap and logs the server load."""
    cap, window = loop.cap, loop.window
    try:
        snaps = await loop.runtime.server.metrics()
    except ServingError as exc:  # the server is down: keep the cap, the requests retry
        logger.warning("/metrics poll failed: %s", exc)
        return
    if any(s is None for s in snaps):
        await cap.set_cap(cap.ceiling)
    else:
        usage = max(s.kv_cache_usage_frac for s in snaps)
        waiting = sum(s.num_requests_waiting for s in snaps)
        if first:
            kv = sum(s.kv_cache_size_tokens or 0 for s in snaps) or None
            await cap.set_cap(cap.initial_cap(kv, loop.runtime.max_model_len))
        else:
            await cap.update(usage, waiting)
        window.add("rollout/vllm_kv_cache_usage_frac", usage)
        window.add("rollout/vllm_running_requests", sum(s.num_requests_running for s in snaps))
        window.add("rollout/vllm_queued_requests", waiting)
        preemptions = sum(s.num_preemptions for s in snaps)
        window.add("rollout/vllm_preemption_count", max(preemptions - getattr(loop, "_preemptions", 0.0), 0.0))
        loop._preemptions = preemptions  # noqa: SLF001 - the driver's own mark on the loop
    window.add("rollout/concurrency_cap", cap.cap)
    window.add("rollout/concurrency", cap.in_flight)
    window.add("rollout/timed_out_calls_running_max", running_after_timeout())  # blocked in C past their limit


async def _poll_forever(loop: RolloutLoop) -> None:
    retries = 0
    while True:
        await asyncio.sleep(loop.config.concurrency_poll_s)
        await poll_concurrency(loop)
        total = loop.runtime.server.retry_count
        loop.window.add("rollout/vllm_retry_count", total - retries)
        retries = total


async def _heartbeat(loop: RolloutLoop, main: asyncio.Task | None) -> None:
    """Tick for the trainer's stall detection; cancel ``main`` when the process that started this one is gone."""
    from grpo_core.run import lifeline

    while True:
        loop.runtime.queue.beat()
        why = lifeline.orphaned()
        if why and main is not None:
            logger.error("%s; stopping the rollout", why)
            main.cancel()
            return
        await asyncio.sleep(0.5)


async def drive(loop: RolloutLoop) -> None:
    """Run the loop to the end of its epochs (``setup`` first, ``close`` always)."""
    await loop.setup()
    background: list[asyncio.Task] = []
    try:
        background = [asyncio.create_task(_heartbeat(loop, asyncio.current_task()))]
        await poll_concurrency(loop, first=True)
        background.append(asyncio.create_task(_poll_forever(loop)))
        try:
            async with asyncio.TaskGroup() as tasks:
                await produce(loop, tasks)
        except BaseExceptionGroup as group:
            raise _first(group) from None
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await loop.close()
        loop.executor.shutdown(wait=False, cancel_futures=True)
        if loop.reward_pool is not None:
            loop.reward_pool.close()


def _first(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
