"""Host several simulated engines in one process: one app and one port per engine, one event loop.

* :func:`serve`: a coroutine serving engines on given sockets until cancelled (the entry point uses it).
* :class:`SimulatedServers`: start them in a background thread of this process (tests, benchmarks) with
  ``with SimulatedServers(...) as sim: sim.urls``; :meth:`SimulatedServers.call` runs a coroutine on their loop
  (to read an engine's state between its steps).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

import uvicorn

from grpo_core.errors import ServerStartError
from grpo_core.serving.embedded.server import bind_socket
from grpo_core.serving.simulated.app import create_app
from grpo_core.serving.simulated.cost import CostModel
from grpo_core.serving.simulated.engine import EngineSettings, SimEngine

T = TypeVar("T")


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening TCP sockets on ``host``: ports ``port .. port + count - 1``, or free ones when ``port``
    is 0.

    Raises:
        ServerStartError: a port is taken (names it).
    """
    sockets = []
    for i in range(count):
        try:
            sock = bind_socket(host, port + i if port else 0)
        except OSError as exc:
            for s in sockets:
                s.close()
            raise ServerStartError(
                f"simulated engine {i}: cannot bind {host}:{port + i} ({exc}); pick another --port"
            ) from None
        sock.setblocking(False)
        sockets.append(sock)
    return sockets


def make_engines(num_engines: int, cost: CostModel, settings: EngineSettings) -> list[SimEngine]:
    """``num_engines`` engines with the same settings and seeds ``settings.seed + i``."""
    return [SimEngine(cost, replace(settings, seed=settings.seed + i)) for i in range(num_engines)]


async def serve(
    engines: list[SimEngine],
    sockets: list[socket.socket],
    on_ready: Callable[[list[uvicorn.Server]], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve ``engines[i]`` on ``sockets[i]`` until ``stop`` is set or the task is cancelled (engines started here;
    on the way out they stop first, so requests still waiting are answered with ``finish_reason: "abort"``)."""
    servers = [
        uvicorn.Server(
            uvicorn.Config(
                create_app(engine, i),
                log_level="warning",
                lifespan="off",
                access_log=False,
                timeout_keep_alive=60,
                timeout_graceful_shutdown=5,
            )
        )
        for i, engine in enumerate(engines)
    ]
    for server in servers:
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    for engine in engines:
        engine.start()
    tasks = [asyncio.create_task(server.serve(sockets=[sock])) for server, sock in zip(servers, sockets, strict=True)]
    try:
        while not all(s.started for s in servers):
            if any(t.done() for t in tasks):
                raise ServerStartError("a simulated engine's HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        if on_ready is not None:
            on_ready(servers)
        stopped = asyncio.create_task((stop or asyncio.Event()).wait())
        await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
    finally:
        for engine in engines:
            await engine.stop()
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


def urls_of(sockets: list[socket.socket]) -> list[str]:
    """``http://host:port`` of each bound socket."""
    out = []
    for sock in sockets:
        host, port = sock.getsockname()[:2]
        out.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
    return out


class SimulatedServers:
    """Simulated engines served from a background thread of this process.

    Args:
        num_engines: engines (one port each).
        cost: the step cost model (default: the ``h200`` calibration).
        settings: the engines' settings (engine ``i`` seeds ``settings.seed + i``).
        host: interface to bind (loopback by default).
        port: first port; 0 = free ports.
        start_timeout_s: seconds to wait for the servers to listen.
    """

    def __init__(
        self,
        num_engines: int = 1,
        cost: CostModel | None = None,
        settings: EngineSettings | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        start_timeout_s: float = 30.0,
    ) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.num_engines, self.cost, self.settings = num_engines, cost or CostModel(), settings or EngineSettings()
        self.host, self.port, self.start_timeout_s = host, port, start_timeout_s
        self.engines: list[SimEngine] = []
        self.urls: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> SimulatedServers:
        """Start the thread and wait until every server listens.

        Raises:
            ServerStartError: a port is taken, or the servers did not start within ``start_timeout_s``.
        """
        sockets = bind_sockets(self.host, self.port, self.num_engines)
        self.urls = urls_of(sockets)
        self._thread = threading.Thread(target=self._run, args=(sockets,), name="simulated-engines", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._ready.wait(0.05):
            if self._error is not None or time.monotonic() > deadline or not self._thread.is_alive():
                self.stop()
                raise ServerStartError(f"simulated engines did not start: {self._error or 'timed out'}")
        return self

    def _run(self, sockets: list[socket.socket]) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._main = asyncio.current_task()
            self.engines = make_engines(self.num_engines, self.cost, self.settings)
            self._stop = asyncio.Event()
            await serve(self.engines, sockets, lambda _servers: self._ready.set(), self._stop)

        try:
            asyncio.run(main())
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
        finally:
            for sock in sockets:
                sock.close()

    def call(self, make: Callable[[], Coroutine[Any, Any, T]], timeout_s: float = 30.0) -> T:
        """Run the coroutine ``make()`` on the engines' loop and return its result."""
        assert self._loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(make(), self._loop).result(timeout_s)

    def stats(self, index: int = 0) -> dict[str, float]:
        """:meth:`SimEngine.stats` of engine ``index``, read on its loop."""

        async def read() -> dict[str, float]:
            return self.engines[index].stats()

        return self.call(read)

    def stop(self) -> None:
        """Stop the servers and the engines, and join the thread."""
        if self._loop is not None and self._stop is not None and self._main is not None and not self._main.done():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=30.0)

    def __enter__(self) -> SimulatedServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
