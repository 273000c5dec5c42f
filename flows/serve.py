"""A Prefect server and process workers on loopback, as one object (``grpo deploy``, ``make serve``, tests).

The server requires a basic-auth string (``PREFECT_SERVER_API_AUTH_STRING``: the environment's, or a fresh
random one written to ``<home>/api_auth_string`` with mode 0600 for the UI's login); the worker, the
deployments and the flow runs send it (``PREFECT_API_AUTH_STRING``). The port is checked free first and
the server is used only once it proves to be the process started here (``flows.local_api.verify_own_server``).
Both run in their own process group (``start_new_session``), so stopping the stack stops the
server, the worker and the flow-run processes the worker started; their logs go to
``<home>/server.log`` and ``<home>/worker.log``. The work pool and the global concurrency limit
``gpu`` (one slot per GPU of this host, 1 without GPUs; every ``grpo-train`` run holds the slots
of the GPUs it uses) are created through Prefect's client.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from grpo_core.run.children import free_port, start_child, stop_child

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient


logger = logging.getLogger(__name__)

WORK_POOL = "grpo-process"
SERVER_POOL = "grpo-gpu"
"""Work pool of the ``grpo-servers`` deployment (``server.work_pool``'s default)."""
GPU_LIMIT = "gpu"


def visible_gpu_count() -> int:
    """CUDA devices visible here (0 without a GPU or without a CUDA build of torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class PrefectStack:
    """Start with ``with PrefectStack(port, home) as stack:``; everything stops on exit.

    Args:
        port: server port on 127.0.0.1 (0 = a free port).
        home: ``PREFECT_HOME`` of the server (its SQLite database) and of the worker.
        pool: process work pool the worker serves (created when missing).
        server_pool: a second process pool with its own worker, for the ``grpo-servers`` deployment
            (``server.work_pool``); None = none.
        worker_poll_s: seconds between the worker's polls for scheduled runs.
        extra_env: environment added for the server, the worker and its flow runs.
        gpu_slots: slots of the global concurrency limit ``gpu``; None = the GPUs visible here (at least 1).
    """

    def __init__(
        self,
        port: int = 4200,
        home: Path = Path("runs/prefect"),
        pool: str = WORK_POOL,
        worker_poll_s: float = 2.0,
        startup_timeout_s: float = 240.0,
        extra_env: dict[str, str] | None = None,
        gpu_slots: int | None = None,
        server_pool: str | None = SERVER_POOL,
    ):
        self.port = port or free_port()
        self.home, self.pool, self.server_pool = Path(home).resolve(), pool, server_pool
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.ui_url = f"http://127.0.0.1:{self.port}"
        self.worker_poll_s, self.startup_timeout_s = worker_poll_s, startup_timeout_s
        self.extra_env = dict(extra_env or {})
        self.gpu_slots = gpu_slots
        self.processes: list[subprocess.Popen] = []
        self.workers: dict[str, subprocess.Popen] = {}
        """The worker process of each pool (its flow runs are its descendants)."""
        from flows.local_api import AUTH_SERVER_ENV, local_auth_env

        self._auth_env = local_auth_env()
        self.auth_string = self._auth_env[AUTH_SERVER_ENV]
        """``user:password`` the server requires (basic auth; the UI asks for it): never log it."""
        self.auth_file = self.home / "api_auth_string"
        """Where ``start`` writes the auth string (mode 0600) for the UI login."""

    def env(self) -> dict[str, str]:
        """Environment of the server, the worker and anything that talks to them."""
        return {
            **os.environ,
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_WORKER_QUERY_SECONDS": str(self.worker_poll_s),
            "PREFECT_LOGGING_EXTRA_LOGGERS": "grpo_core",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
            **self._auth_env,
            **self.extra_env,
        }

    def auth_headers(self) -> dict[str, str]:
        """The ``Authorization`` header a plain HTTP client needs for this stack's API."""
        import base64

        return {"Authorization": "Basic " + base64.b64encode(self.auth_string.encode()).decode()}

    def ui_login_script(self) -> str:
        """JavaScript that logs a browser page into this stack's UI (for ``page.add_init_script`` in Playwright):
        the UI sends ``localStorage["prefect-password"]`` (the base64 auth string) with every API call."""
        encoded = self.auth_headers()["Authorization"].split(" ", 1)[1]
        return f"window.localStorage.setItem('prefect-password', '{encoded}');"

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen:
        self.home.mkdir(parents=True, exist_ok=True)
        with (self.home / log_name).open("ab") as log:
            process = start_child([sys.executable, "-m", "prefect", *args], stdout=log, env=self.env())
        self.processes.append(process)
        return process

    def start(self) -> PrefectStack:
        """Start the server, wait for its API, create the work pool, start the worker.

        Raises:
            ConfigError: the home folder or its database cannot be created or opened (path and cause).
            PortInUseError: the port is taken by another process.
            PrefectApiError: another server answers on the port.
            RuntimeError: the server did not answer within ``startup_timeout_s`` (with its log's tail).
        """
        from flows.local_api import prepare_home, verify_own_server
        from grpo_core.security.auth import check_port_free

        prepare_home(self.home, self.env())
        check_port_free("127.0.0.1", self.port, "the Prefect server's port (grpo deploy --port)")
        self.auth_file.touch(mode=0o600)
        self.auth_file.chmod(0o600)
        self.auth_file.write_text(self.auth_string + "\n")
        server = self._spawn(["server", "start", "--host", "127.0.0.1", "--port", str(self.port)], "server.log")
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                if server.poll() is None and httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                tail = (self.home / "server.log").read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"Prefect server did not start on {self.api_url}:\n{tail}")
            time.sleep(0.5)
        try:
            verify_own_server(self.api_url, self.auth_string, server, f"grpo deploy (port {self.port})")
        except BaseException:
            self.stop()
            raise
        pools = [self.pool] + ([self.server_pool] if self.server_pool and self.server_pool != self.pool else [])
        for pool in pools:
            self.ensure_pool(pool)
        self.ensure_gpu_limit()
        for pool in pools:
            self.workers[pool] = self._spawn(
                ["worker", "start", "--pool", pool, "--type", "process", "--name", f"{pool}-worker"],
                "worker.log" if pool == self.pool else f"worker-{pool}.log",
            )
        logger.info("Prefect server at %s, process workers on pools %s", self.ui_url, ", ".join(pools))
        return self

    def client(self) -> SyncPrefectClient:
        """A synchronous Prefect client on this stack's API (whatever ``PREFECT_API_URL`` this process has)."""
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.api_url, auth_string=self.auth_string)

    def ensure_pool(self, pool: str | None = None) -> None:
        """Create a process work pool (default ``pool``) with Prefect's client (kept as it is when it exists)."""
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.exceptions import ObjectAlreadyExists

        with self.client() as client:
            try:
                client.create_work_pool(WorkPoolCreate(name=pool or self.pool, type="process"))
            except ObjectAlreadyExists:
                logger.info("work pool %s exists", pool or self.pool)

    def ensure_gpu_limit(self) -> None:
        """Create (or resize) the global concurrency limit ``gpu`` with ``gpu_slots`` slots.

        Every ``grpo-train`` flow run holds the slots of the GPUs it uses (``flow.concurrency_slots``)
        from provisioning to the end of training, so a scheduled run and a UI run never share GPUs or
        ports: the later one waits. Raise it with ``prefect gcl update gpu --limit N`` (or in the UI:
        Concurrency → Global).
        """
        slots = self.gpu_slots if self.gpu_slots is not None else max(visible_gpu_count(), 1)
        with self.client() as client:
            client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, slots)
        logger.info("global concurrency limit %r: %d slot(s)", GPU_LIMIT, slots)

    def register(self, demo_config: Path, cron: str | None = None, overrides: list[str] | None = None) -> None:
        """Register ``grpo-train/demo`` and ``grpo-train/nightly-retrain`` (in a child process, on this server);
        ``cron`` None keeps the nightly deployment's schedules (``deployments.deploy.nightly_schedules``)."""
        cmd = [sys.executable, "-m", "deployments.deploy", "--config", str(demo_config), "--pool", self.pool]
        if cron is not None:
            cmd += ["--cron", cron]
        for item in overrides or []:
            cmd += ["--set", item]
        done = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"registering deployments failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")

    def wait(self) -> None:
        """Block until the server or the worker exits (or Ctrl-C)."""
        while all(p.poll() is None for p in self.processes):
            time.sleep(1.0)

    def stop(self) -> None:
        """Stop the worker (and its flow runs), then the server: SIGTERM to each group, SIGKILL after 15 s."""
        for process in reversed(self.processes):
            stop_child(process, timeout_s=15.0)
        self.processes, self.workers = [], {}

    def __enter__(self) -> PrefectStack:
        return self if self.processes else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
