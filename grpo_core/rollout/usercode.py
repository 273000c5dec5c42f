"""Calling user code (reward functions, tools, environment methods) from the rollout's event loop.

Sync functions run in the loop's thread pool, async ones are awaited; each call can carry a time
limit (``rollout.reward_timeout_s``, ``rollout.tool_timeout_s``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any


def is_async(func: Callable[..., Any]) -> bool:
    """Whether calling ``func`` gives a coroutine (async functions, partials of them, async ``__call__``)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


async def call_user(func: Callable[..., Any], kwargs: dict[str, Any], executor: Executor,
                    timeout_s: float | None = None) -> Any:
    """``func(**kwargs)``: awaited when async, else in ``executor``; at most ``timeout_s`` seconds (None = no limit).

    Raises:
        TimeoutError: the call took longer than ``timeout_s``. An async call is cancelled; a sync call
            keeps its worker thread until it returns (Python cannot stop a thread).
        Exception: whatever ``func`` raised.
    """
    if is_async(func):
        call = func(**kwargs)
    else:
        call = asyncio.get_running_loop().run_in_executor(executor, functools.partial(func, **kwargs))
    return await asyncio.wait_for(call, timeout_s)
