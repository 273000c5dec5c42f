"""Sync reward functions in worker processes, each call in a worker's main thread (``rollout.reward_workers``).

Math verifiers (``math_verify``, sympy-based graders) bound their own run time with ``signal.alarm`` and
``signal.signal``, which Python allows only in a process's main thread: in a worker thread of the rollout they
raise ``ValueError: signal only works in main thread of the main interpreter`` and every group fails. Here each
sync reward function call is sent (pickled) to one of a few worker processes started with ``forkserver`` (or
``spawn`` where there is none), whose main thread runs it. The rollout's ``rollout.reward_timeout_s`` holds as
before: a call past it is answered with :class:`TimeoutError` and its worker is killed (a process, unlike a
thread, can be stopped whatever it is blocked in) and replaced by a fresh one at the next call.

What crosses the process boundary is pickled: the function (by reference: define it at the top level of an
importable module), its keyword arguments and its answer. ``log_metric`` is recorded in the worker and replayed
into the rollout's metric window after the call; ``environments`` arrive as copies (what a reward function changes
on them is not seen by the rollout).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import signal
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from grpo_core.errors import RolloutError

#: How to lift the process boundary, named by every error about it.
_WAYS_OUT = (
    "make the function async (async functions run in the rollout's event loop), or set rollout.reward_workers: 0 "
    "to run sync reward functions in threads of the rollout process (signal-based timeouts do not work there)"
)


#: Seconds a worker may take to unpickle a call (a fresh worker imports the function's module, and what it imports)
#: when that is longer than ``rollout.reward_timeout_s``.
LOAD_TIMEOUT_S = 600.0


def pickling_error(what: str, func: Any) -> str | None:
    """Whether ``func`` can be sent to a reward worker process, pickled by reference as ``RewardProcessPool.payload``
    sends it. The one home of this check: the run's preflight (``check_reward_pickling``) asks it of every sync
    reward function before anything starts; the pool asks it of a call that would not pickle.

    Args:
        what: how the error names the function (e.g. ``"rollout.reward_functions: mod:score"``).
        func: the reward function.

    Returns:
        None when it pickles, else ``"{what} cannot be pickled (TypeName: message); define it as a top-level
        function of an importable module (not a lambda, a nested function or a local class)"``.
    """
    try:
        pickle.dumps(func, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - pickling raises many types (PicklingError, AttributeError, TypeError)
        return (
            f"{what} cannot be pickled ({type(exc).__name__}: {exc}); define it as a top-level function of an "
            "importable module (not a lambda, a nested function or a local class)"
        )
    return None


class WorkerRaised(Exception):
    """A reward function raised in its worker process; ``type_name`` is the type of what it raised.

    Attributes:
        type_name: the class name of the worker's exception (e.g. ``"ZeroDivisionError"``).
        worker_traceback: the traceback formatted in the worker.
    """

    def __init__(self, type_name: str, message: str, worker_traceback: str) -> None:
        super().__init__(message)
        self.type_name, self.worker_traceback = type_name, worker_traceback


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, context: Any) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child,), daemon=True, name="grpo-reward-worker")
        self.process.start()
        child.close()

    def load(self, payload: bytes) -> bytes:
        """Send one call and wait until the worker has unpickled it (its module imported): ``b"loaded"`` or the
        answer saying why not (blocking; run in a thread). Raises EOFError when the worker dies."""
        self.conn.send_bytes(payload)
        return self.conn.recv_bytes()

    def answer(self) -> bytes:
        """Wait for the answer of the loaded call (blocking; run in a thread). Raises EOFError when the worker dies."""
        return self.conn.recv_bytes()

    def kill(self) -> None:
        """Stop the process whatever it is doing (SIGKILL) and reap it. The pipe stays open: a thread may still be
        reading it, and sees EOF now."""
        self.process.kill()
        self.process.join(timeout=10)


class RewardProcessPool:
    """``workers`` processes that run sync reward functions in their main thread, one call at a time each.

    Processes start at their first call. Use from one event loop; :meth:`close` stops them.

    Args:
        workers: number of worker processes (``rollout.reward_workers``, >= 1).
        start_method: ``multiprocessing`` start method; default ``forkserver`` where it exists, else ``spawn``
            (never ``fork``: the rollout process runs threads and an event loop).
    """

    def __init__(self, workers: int, start_method: str | None = None) -> None:
        if workers < 1:
            raise ValueError(f"rollout.reward_workers must be >= 1 for a process pool, got {workers}")
        if start_method is None:
            start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        self.workers = workers
        self.context = multiprocessing.get_context(start_method)
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward-pool")
        self._idle: asyncio.Queue[_Worker | None] | None = None
        self._live: set[_Worker] = set()
        self._closed = False

    def _slots(self) -> asyncio.Queue[_Worker | None]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.workers):
                self._idle.put_nowait(None)  # a slot whose process starts at its first call
        return self._idle

    def payload(self, what: str, func: Any, kwargs: dict[str, Any], with_log_metric: bool) -> bytes:
        """The pickled call; a function or argument that cannot be pickled raises RolloutError naming it."""
        try:
            return pickle.dumps((func, kwargs, with_log_metric), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - pickling raises many types; each is named below
            cause = exc
        where = f"rollout.reward_workers={self.workers}"
        error = pickling_error("the function", func)
        if error is not None:
            raise RolloutError(f"{what} cannot be sent to a reward worker process ({where}): {error}, or {_WAYS_OUT}")
        for name, value in kwargs.items():
            try:
                pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001
                raise RolloutError(
                    f"{what} cannot be sent to a reward worker process ({where}): its argument {name!r} cannot be "
                    f"pickled ({type(exc).__name__}: {exc}); make that value picklable (a dataset column, an "
                    f"environment's attributes), or {_WAYS_OUT}"
                ) from None
        raise RolloutError(
            f"{what} cannot be sent to a reward worker process ({where}): {type(cause).__name__}: {cause}; {_WAYS_OUT}"
        ) from None

    async def call(self, what: str, func: Any, kwargs: dict[str, Any], timeout_s: float | None) -> Any:
        """``func(**kwargs)`` in a worker process's main thread, at most ``timeout_s`` seconds (None = no limit).

        The time limit starts when a worker has unpickled the call (waiting for a free worker, starting it and
        importing the function's module there do not count: those have :data:`LOAD_TIMEOUT_S` or ``timeout_s``,
        the longer). A
        ``log_metric`` argument is replaced by a recorder in the worker; what it recorded is passed to the given
        ``log_metric`` here after the call, also when the call raised.

        Args:
            what: the function as errors name it, e.g. ``"reward function 'accuracy'"``.
            func: a sync callable, picklable by reference.
            kwargs: its keyword arguments (picklable, but for ``log_metric``).
            timeout_s: seconds the call may take.

        Returns:
            What ``func`` returned.

        Raises:
            RolloutError: the function, an argument or the answer cannot be pickled, or the worker cannot load the
                function (names it and the way out).
            TimeoutError: the call took longer than ``timeout_s``, or its loading longer than its limit (its worker
                was killed).
            WorkerRaised: the function raised (its type name, message and the worker's traceback).
            RuntimeError: the worker process died during the call (its exit code).
        """
        if self._closed:
            raise RuntimeError("the reward worker pool is closed")
        log_metric = kwargs.get("log_metric")
        sent = {k: v for k, v in kwargs.items() if k != "log_metric"}
        payload = self.payload(what, func, sent, log_metric is not None)
        slots = self._slots()
        worker = await slots.get()
        try:
            if worker is None or not worker.process.is_alive():
                if worker is not None:
                    self._discard(worker)
                worker = await asyncio.get_running_loop().run_in_executor(self._threads, _Worker, self.context)
                self._live.add(worker)
            running = asyncio.get_running_loop()
            try:
                # Loading (a fresh worker imports the function's module: seconds, more with torch) has its own limit.
                load_limit = None if timeout_s is None else max(timeout_s, LOAD_TIMEOUT_S)
                answer = await asyncio.wait_for(
                    running.run_in_executor(self._threads, worker.load, payload), load_limit
                )
                if answer == _LOADED:
                    answer = await asyncio.wait_for(running.run_in_executor(self._threads, worker.answer), timeout_s)
            except EOFError:
                worker.process.join(timeout=10)
                code = worker.process.exitcode
                self._discard(worker)
                worker = None
                raise RuntimeError(f"its reward worker process died during the call (exit code {code})") from None
            except BaseException:  # a timeout or a cancelled group: the worker may be mid-call, stop it
                self._discard(worker)
                worker = None
                raise
        finally:
            slots.put_nowait(worker)
        kind, *rest = pickle.loads(answer)
        if kind == "load":
            raise RolloutError(
                f"{what} cannot be loaded in its reward worker process: {rest[0]}; it must be importable there "
                f"(a top-level function of a module on sys.path), or {_WAYS_OUT}"
            )
        *rest, metrics = rest
        if log_metric is not None:
            for name, value in metrics:
                log_metric(name, value)
        if kind == "unsendable":
            raise RolloutError(
                f"{what} returned a value that cannot be sent back from its reward worker process ({rest[0]}); "
                "return a list of floats (None where it does not apply)"
            )
        if kind == "raised":
            type_name, message, worker_traceback = rest
            raise WorkerRaised(type_name, message, worker_traceback)
        return rest[0]

    def _discard(self, worker: _Worker) -> None:
        self._live.discard(worker)
        worker.kill()

    def close(self) -> None:
        """Stop every worker process (a call in progress ends with EOF); later calls raise RuntimeError."""
        self._closed = True
        for worker in list(self._live):
            self._discard(worker)
        self._threads.shutdown(wait=False, cancel_futures=True)


def _worker_main(conn: Connection) -> None:
    """A worker process: answer calls until the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the rollout stops its workers; Ctrl-C is the parent's to handle
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            call = pickle.loads(payload)
        except BaseException as exc:  # noqa: BLE001 - e.g. the function's module is not importable here
            conn.send_bytes(pickle.dumps(("load", f"{type(exc).__name__}: {exc}")))
            continue
        conn.send_bytes(_LOADED)
        conn.send_bytes(_answer(*call))


#: A worker's first reply to a call it could unpickle (a pickle never equals it).
_LOADED = b"loaded"


def _answer(func: Any, kwargs: dict[str, Any], with_log_metric: bool) -> bytes:
    """Run one unpickled call; the pickled answer: ``("ok", result, metrics)``, ``("raised", type name, message,
    traceback, metrics)`` or ``("unsendable", why, metrics)``."""
    metrics: list[tuple[str, float]] = []
    if with_log_metric:
        kwargs["log_metric"] = lambda name, value: metrics.append((str(name), float(value)))
    try:
        result = func(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the group
        return pickle.dumps(("raised", type(exc).__name__, str(exc), traceback.format_exc(), metrics))
    try:
        return pickle.dumps(("ok", result, metrics), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001
        return pickle.dumps(("unsendable", f"{type(result).__name__}: {type(exc).__name__}: {exc}", metrics))
