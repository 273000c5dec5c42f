"""GPU slots of a Prefect global concurrency limit, held under a lease that the run stops without (issue 26, item 11).

Prefect's ``concurrency()`` renews its slot lease in a thread and, after three failed tries (a few seconds), stops
renewing and lets the run go on: once the lease runs out (``lease_s``, 300 s) the server frees the slots and another
run takes the same GPUs while this one still trains. :func:`hold_slots` renews the lease until it is really lost,
then stops the run: it keeps retrying a renewal that fails for a reason that may pass (API restarting or
unreachable) until the lease would have run out, and takes the lease as lost at once when the server says it no
longer has it (410 Gone: expired, revoked, or forgotten by a restarted server). Then it raises
:class:`SlotLeaseLost` in the thread that holds the slots (the flow's), whose ``finally`` stops every process of the
run; the error is curable, so the flow's retry waits for the slots again and resumes from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

#: Seconds a lease lasts without renewal (Prefect's default for ``concurrency()``).
SLOT_LEASE_S = 300.0
#: Share of the lease between two renewals.
RENEW_FRACTION = 0.25
#: Seconds between two tries while renewals fail.
RETRY_S = 2.0
_SIGNAL = signal.SIGUSR1


class SlotLeaseLost(RuntimeError):
    """The run's slot lease could not be renewed before it ran out, or the server no longer has it: another run may
    hold the same GPUs now, so this run stops (a flow retry waits for the slots again and resumes)."""


class _Renewer(threading.Thread):
    """Renews lease ``lease_id`` every ``RENEW_FRACTION`` of ``lease_s``; calls ``on_lost(reason)`` once it is lost."""

    def __init__(self, lease_id: object, lease_s: float, on_lost: Callable[[str], None]) -> None:
        super().__init__(name="slot-lease", daemon=True)
        self.lease_id, self.lease_s, self.on_lost = lease_id, lease_s, on_lost
        self.stop = threading.Event()
        self.num_failed_renewals = 0

    def run(self) -> None:
        import httpx
        from prefect.client.orchestration import get_client

        expires = time.monotonic() + self.lease_s
        pause = self.lease_s * RENEW_FRACTION
        with get_client(sync_client=True) as client:
            while not self.stop.wait(pause):
                try:
                    client.renew_concurrency_lease(lease_id=self.lease_id, lease_duration=self.lease_s)
                    expires, pause = time.monotonic() + self.lease_s, self.lease_s * RENEW_FRACTION
                    continue
                except httpx.HTTPStatusError as exc:
                    if exc.response.status_code in (404, 410):
                        self.on_lost(f"the Prefect server no longer has the lease ({exc.response.status_code})")
                        return
                    error: Exception = exc
                except Exception as exc:  # noqa: BLE001 - any failure to reach the API: retried until the lease ends
                    error = exc
                self.num_failed_renewals += 1
                left = expires - time.monotonic()
                if left <= 0:
                    self.on_lost(f"no renewal succeeded within the lease's {self.lease_s:.0f} s (last error: {error})")
                    return
                logger.warning("renewing the GPU slot lease failed (%s); trying again, %.0f s of it left", error, left)
                pause = min(RETRY_S, max(left, 0.05))


@contextlib.contextmanager
def hold_slots(
    name: str, slots: int, *, max_retries: int | None = None, lease_s: float | None = None
) -> Iterator[None]:
    """Hold ``slots`` slots of the global concurrency limit ``name`` (waiting for them) under a renewed lease.

    Args:
        name: the global concurrency limit.
        slots: slots to occupy.
        max_retries: acquisition retries while the limit is full (None = wait as long as it takes; 0 = one try).
        lease_s: the lease's duration; None = :data:`SLOT_LEASE_S`.

    Raises:
        ConcurrencySlotAcquisitionError: the limit does not exist, or is full and ``max_retries`` ran out
            (Prefect's, with the HTTP error as its cause).
        SlotLeaseLost: raised inside the ``with`` block, in the thread that entered it, when the lease is lost.
    """
    from prefect.concurrency._sync import acquire_concurrency_slots_with_lease, release_concurrency_slots_with_lease

    lease_s = lease_s or SLOT_LEASE_S
    response = acquire_concurrency_slots_with_lease(
        [name], slots, strict=True, lease_duration=lease_s, max_retries=max_retries
    )
    holder = threading.current_thread()
    lost: list[str] = []

    def raise_lost(signum: int = 0, frame: object = None) -> None:  # noqa: ARG001 - a signal handler's signature
        raise SlotLeaseLost(
            f"lost the lease of {slots} slot(s) of the global concurrency limit {name!r}: {lost[0]}; another run may "
            "hold these GPUs now, so this run stops (a retry waits for the slots and resumes from the last checkpoint)"
        )

    previous = None
    if holder is threading.main_thread():
        previous = signal.signal(_SIGNAL, raise_lost)

    def on_lost(reason: str) -> None:
        lost.append(reason)
        logger.error("GPU slot lease lost: %s; stopping the run", reason)
        if previous is not None:  # a signal interrupts a blocking wait (a child process, a sleep) at once
            signal.pthread_kill(holder.ident or 0, _SIGNAL)
        else:  # another thread: raised at its next Python instruction
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(holder.ident or 0), ctypes.py_object(SlotLeaseLost)
            )

    renewer = _Renewer(response.lease_id, lease_s, on_lost)
    renewer.start()
    try:
        yield
    except SlotLeaseLost as exc:
        if lost and not exc.args:  # the bare class raised in another thread: give it the message
            try:
                raise_lost()
            except SlotLeaseLost as full:
                raise full from None
        raise
    finally:
        renewer.stop.set()
        renewer.join(timeout=5)
        if previous is not None:
            signal.signal(_SIGNAL, previous)
        if not lost:
            try:
                release_concurrency_slots_with_lease(response.lease_id)
            except Exception as exc:  # noqa: BLE001 - the server frees them when the lease runs out
                logger.warning("releasing the GPU slot lease failed (%s); it frees itself in %.0f s", exc, lease_s)
