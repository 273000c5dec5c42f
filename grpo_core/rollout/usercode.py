"""Calling user code (reward functions, tools, environment methods) from the rollout's event loop.

Sync functions run in the loop's thread pool, async ones are awaited; each call can carry a time
limit (``rollout.reward_timeout_s``, ``rollout.tool_timeout_s``).

A sync call past its limit (or whose caller was cancelled) is interrupted: its worker thread gets an
exception raised asynchronously (CPython's ``PyThreadState_SetAsyncExc``, the one way to stop Python code
running in another thread), which stops Python code at its next bytecode, so a function looping in Python
stops consuming the run. Code blocked inside a C call (``time.sleep``, a socket read, a C extension) sees it
only when that call returns; until then it holds its worker thread, and :func:`running_after_timeout` counts
it (``rollout/timed_out_calls_running_max``).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import inspect
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from grpo_core.errors import RolloutError, UserCodeError, UserCodeTimeout

from .window import MetricWindow


def is_async(func: Callable[..., Any]) -> bool:
    """Whether calling ``func`` gives a coroutine (async functions, partials of them, async ``__call__``)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))  # noqa: B004 - the method itself


class _Interrupted(BaseException):
    """Raised inside a sync user call's thread at its timeout (a BaseException: a user's ``except Exception``
    does not swallow it)."""


_stuck_lock = threading.Lock()
#: Sync calls interrupted at their timeout that have not returned yet, by ``id`` of the executor that runs them
#: (a stuck call holds its executor, so the id is not reused while it counts); zero counts are removed.
_stuck: dict[int, int] = {}


def running_after_timeout(executor: Executor | None = None) -> int:
    """Sync user calls interrupted at their timeout (or cancelled) that are still running: blocked in a C call.

    Args:
        executor: count only the calls of this executor (the one given to :func:`call_user`); None counts those
            of every executor in the process.
    """
    with _stuck_lock:
        return sum(_stuck.values()) if executor is None else _stuck.get(id(executor), 0)


def _async_raise(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next bytecode (None withdraws one not raised yet)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )


class _SyncCall:
    """One sync user call for a worker thread, which :meth:`interrupt` can stop while (and only while) it runs."""

    def __init__(self, func: Callable[..., Any], kwargs: dict[str, Any], executor: Executor) -> None:
        self.func, self.kwargs, self.executor = func, kwargs, executor
        self.lock = threading.Lock()
        self.state = "queued"  # → running → done, or → cancelled (before it ran), or running → interrupted → done
        self.thread_id = 0

    def __call__(self) -> Any:
        with self.lock:
            if self.state == "cancelled":
                raise TimeoutError("the call timed out before a worker thread took it")
            self.state, self.thread_id = "running", threading.get_ident()
        try:
            return self.func(**self.kwargs)
        except _Interrupted:
            raise TimeoutError("interrupted at its timeout") from None
        finally:
            self._leave()

    def _leave(self) -> None:
        """Mark the call done; an interrupt sent but not raised yet is withdrawn (one raised here is retried over)."""
        while True:
            try:
                with self.lock:
                    if self.state == "interrupted":
                        _async_raise(self.thread_id, None)  # first: nothing can be raised here after it
                        with _stuck_lock:
                            key = id(self.executor)
                            _stuck[key] -= 1
                            if not _stuck[key]:
                                del _stuck[key]
                    self.state = "done"
                return
            except _Interrupted:
                continue

    def interrupt(self) -> None:
        """Stop the call: never start it if no thread took it yet, else raise ``_Interrupted`` in its thread."""
        with self.lock:
            if self.state == "queued":
                self.state = "cancelled"
            elif self.state == "running":
                self.state = "interrupted"
                with _stuck_lock:
                    _stuck[id(self.executor)] = _stuck.get(id(self.executor), 0) + 1
                _async_raise(self.thread_id, _Interrupted)


async def call_user(
    func: Callable[..., Any], kwargs: dict[str, Any], executor: Executor, timeout_s: float | None = None
) -> Any:
    """``func(**kwargs)``: awaited when async, else in ``executor``; at most ``timeout_s`` seconds (None = no limit).

    Raises:
        TimeoutError: the call took longer than ``timeout_s``. An async call is cancelled; a sync call is
            interrupted in its thread (see the module docs: Python code stops at once, a blocking C call when it
            returns).
        Exception: whatever ``func`` raised.
    """
    if is_async(func):
        return await asyncio.wait_for(func(**kwargs), timeout_s)
    call = _SyncCall(func, kwargs, executor)
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(executor, call), timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        call.interrupt()
        raise


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
        raise RolloutError(
            f"{what} cannot take the arguments it gets ({sorted(kwargs)}): {exc}; fix its "
            "signature (add **kwargs to accept the ones it does not use)"
        ) from None


async def call_environment(
    env: object,
    method: str,
    kwargs: dict[str, Any],
    executor: Executor,
    window: MetricWindow,
    timeout_s: float | None,
    field: str,
) -> Any:
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
        window.add(
            f"rewards/{type(env).__name__}/timeout_count" if method == "get_reward" else "env/reset_timeout_count", 1
        )
        raise UserCodeTimeout(f"{name} took longer than {field}={timeout_s:g} s") from None
    except Exception as exc:  # user code: the group fails, charged to rollout.max_failed_groups
        raise UserCodeError(f"{name} raised {type(exc).__name__}: {exc}") from exc
