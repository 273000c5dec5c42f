"""Waiting for a state in tests: poll with a deadline, never a bare ``sleep`` (issue 29).

A plain module (no pytest, no project imports): helper modules that spawned processes import may use it too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str, timeout_s: float = 60.0, interval_s: float = 0.05) -> T:
    """Poll ``condition`` until it returns something truthy; returns that value.

    Args:
        condition: called every ``interval_s`` seconds (first at once).
        what: the state waited for, in the failure's message ("the server answers /health").
        timeout_s: the deadline in seconds from now.
        interval_s: seconds between calls.

    Raises:
        AssertionError: ``condition`` stayed falsy for ``timeout_s`` seconds (the message names ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}: it never happened")
        time.sleep(interval_s)


async def async_wait_until(
    condition: Callable[[], Awaitable[T]], what: str, timeout_s: float = 60.0, interval_s: float = 0.05
) -> T:
    """:func:`wait_until` for an event loop: awaits ``condition()`` until it is truthy, sleeping on the loop.

    Raises:
        AssertionError: ``condition`` stayed falsy for ``timeout_s`` seconds (the message names ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}: it never happened")
        await asyncio.sleep(interval_s)
