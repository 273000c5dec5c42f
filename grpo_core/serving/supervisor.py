"""The restart policy of a run's generation replicas, apart from whoever drives it (no Prefect here).

``flows/grpo_servers.py`` polls Prefect (its own state, the train run's, the lifeline) and calls
:meth:`ReplicaSupervisor.check` on every pass. A replica that exits is started again on its port
(:func:`grpo_core.serving.launch.relaunch`, on the caller's thread: vLLM dies with the thread that launched it) while
``server.start_retries`` lasts; the wait for it to serve (up to ``server.startup_timeout_s``, minutes for a large
model) runs on a worker thread, so the caller keeps polling meanwhile. The supervisor gives up only when every replica
is dead with its restarts spent.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from grpo_core.errors import ServerStartError, ServingError

logger = logging.getLogger(__name__)


class ReplicaSupervisor:
    """Keeps the replicas of ``servers`` serving (see module docs).

    Args:
        server: the run's ``ServerConfig`` (``start_retries``, ``startup_timeout_s``, ``log_dir``).
        servers: the launched replicas (``ServerHandle``); a restarted one replaces its entry in place.
        token: the run's bearer token (a restarted replica requires it too).
        serves_lora: the run syncs LoRA adapters (a restarted full-weight replica refuses later policy versions
            until a weight sync reaches it, which its log line says).
        log: where the lines for the user go (the Prefect run logger).
    """

    def __init__(
        self, server: Any, servers: list[Any], token: str, serves_lora: bool = False, log: Any = logger
    ) -> None:
        self.server, self.servers, self.token, self.serves_lora, self.log = server, servers, token, serves_lora, log
        self.restarts = [0] * len(servers)
        self.starting: dict[int, Future] = {}  # replica -> its wait_healthy after a relaunch
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(servers)), thread_name_prefix="replica-start")

    def check(self) -> None:
        """One pass: collect the finished waits of restarted replicas, relaunch the replicas that exited.

        Raises:
            ServerStartError: every replica exited and ``server.start_retries`` restarts each are spent.
        """
        for i, handle in enumerate(self.servers):
            if i in self.starting:
                self._collect(i, handle)
            elif handle.process.poll() is not None and handle.url and self.restarts[i] < self.server.start_retries:
                self._relaunch(i, handle)
        if not self.starting and all(
            h.process.poll() is not None and n >= self.server.start_retries
            for h, n in zip(self.servers, self.restarts, strict=True)
        ):
            raise ServerStartError(
                f"every replica exited and server.start_retries ({self.server.start_retries}) restarts each are "
                f"spent; logs in {self.server.log_dir}"
            )

    def close(self) -> None:
        """Stop waiting (a wait still going ends within 0.5 s of the teardown stopping its replica)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _collect(self, i: int, handle: Any) -> None:
        if not self.starting[i].done():
            return
        try:
            self.starting.pop(i).result()
        except ServerStartError as exc:  # its process is stopped; tried again on a later pass while restarts last
            self._failed_start(i, exc)
            return
        later = "" if self.serves_lora else " (it refuses later policy versions until a weight sync reaches it)"
        self.log.info("replica %d serves again at %s%s", i, handle.url, later)

    def _relaunch(self, i: int, handle: Any) -> None:
        from grpo_core.serving import launch

        self.restarts[i] += 1
        self.log.warning(
            "replica %d exited with code %s; starting it again on %s (%d of %d)",
            i,
            handle.process.returncode,
            handle.url,
            self.restarts[i],
            self.server.start_retries,
        )
        try:
            self.servers[i] = launch.relaunch(handle, self.token)
        except ServingError as exc:  # nothing started (its log cannot be written)
            self._failed_start(i, exc)
            return
        self.starting[i] = self._pool.submit(  # no generation check follows: a fenced replica is adopted
            launch.wait_healthy, self.servers[i], self.server.startup_timeout_s, self.token, fenced_ok=True
        )

    def _failed_start(self, i: int, exc: Exception) -> None:
        self.log.warning(
            "replica %d did not start again (%d of %d): %s", i, self.restarts[i], self.server.start_retries, exc
        )
