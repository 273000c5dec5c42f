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

from grpo_core.errors import RolloutError, UserCodeError, UserCodeTimeout

from .window import MetricWindow


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


def check_arguments(what: str, func: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Raise ``RolloutError`` when ``func`` cannot be called with ``kwargs`` (a wrong signature: a
    misconfiguration that fails the run at once, unlike a failure inside the call).

    Args:
        what: the function as the message names it, e.g. ``"reward function 'accuracy'"``.
        func: the user function (a callable whose signature cannot be read is not checked).
        kwargs: the keyword arguments it will get.
    """
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise RolloutError(f"{what} cannot take the arguments it gets ({sorted(kwargs)}): {exc}; fix its "
                           "signature (add **kwargs to accept the ones it does not use)") from None


async def call_environment(env: object, method: str, kwargs: dict[str, Any], executor: Executor,
                           window: MetricWindow, timeout_s: float | None, field: str) -> Any:
    """``env.<method>(**kwargs)`` (``reset`` or ``get_reward``) within ``timeout_s`` seconds (the config key ``field``).

    Raises:
        RolloutError: the method cannot take ``kwargs`` (a wrong signature: the run fails).
        UserCodeTimeout: the call took longer than ``timeout_s`` (counted in ``rewards/<Env>/timeout_count`` for
            ``get_reward``, ``env/reset_timeout_count`` for ``reset``; the group fails).
        UserCodeError: the call raised (the group fails, charged to ``rollout.max_failed_groups``).
    """
    name = f"{type(env).__name__}.{method}()"
    func = getattr(env, method)
    check_arguments(name, func, kwargs)
    try:
        return await call_user(func, kwargs, executor, timeout_s)
    except TimeoutError:
        window.add(f"rewards/{type(env).__name__}/timeout_count" if method == "get_reward"
                   else "env/reset_timeout_count", 1)
        raise UserCodeTimeout(f"{name} took longer than {field}={timeout_s:g} s") from None
    except Exception as exc:  # user code: the group fails, charged to rollout.max_failed_groups
        raise UserCodeError(f"{name} raised {type(exc).__name__}: {exc}") from exc
