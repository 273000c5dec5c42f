"""The rollout process: its one start path, and its main function.

:func:`start_rollout_process` runs ``python -m grpo_core.rollout`` (the command the flow's ``rollout``
task runs; tests and benchmarks use the same function) as a subprocess in its own session, with GPUs
hidden (``CUDA_VISIBLE_DEVICES=""``) and its output in a log file; :meth:`RolloutProcess.wait_location`
waits for the Arrow Flight location it writes once it serves. Everything the process runs is named
in the config (dataset, reward functions, tools, environments and loop class as ``module:attribute``),
so nothing crosses the process boundary but a JSON config, a JSON resume state and command-line flags.

On failure the process writes its traceback to its error file, keeps answering heartbeats with it
until the trainer shuts it down (or ``rollout_worker_timeout_s`` passes), and exits with code 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.config import RolloutProcessConfig, RunConfig
from grpo_core.errors import ConfigError, TransportError
from grpo_core.run.children import log_tail, start_child, stop_child
from grpo_core.run.layout import ROLLOUT_CONFIG as CONFIG_FILE
from grpo_core.run.layout import ROLLOUT_ERROR as ERROR_FILE
from grpo_core.run.layout import ROLLOUT_LOCATION as LOCATION_FILE
from grpo_core.run.layout import ROLLOUT_LOG as LOG_FILE
from grpo_core.run.layout import ROLLOUT_RESUME as RESUME_FILE
from grpo_core.security.auth import (
    CONTROL_KEY_ENV,
    MEMBER_KEY_ENV,
    ROLE_CONTROL,
    ROLE_MEMBER,
    ensure_run_token,
    role_env,
    without_keys,
)
from grpo_core.transport.types import ResumeState

logger = logging.getLogger(__name__)


@dataclass
class RolloutJob:
    """What the rollout loop runs on, inside the rollout process (built by ``python -m grpo_core.rollout``).

    Attributes:
        config: the rollout process's sub-config (``RunConfig.rollout_process()``).
        server_urls: base URLs of the generation server replicas.
        resume: where to restart (None = from the first prompt).
        error_path: where a failure's traceback is written.
    """

    config: RolloutProcessConfig
    server_urls: list[str]
    resume: ResumeState | None = None
    error_path: str | None = None


@dataclass
class RolloutProcess:
    """A started ``python -m grpo_core.rollout`` subprocess and its files.

    Attributes:
        process: the subprocess (leader of its own session: :meth:`stop` signals the whole group).
        run_dir: folder of its files: the Flight location, the failure traceback and the log.
    """

    process: subprocess.Popen
    run_dir: Path

    @property
    def location_path(self) -> Path:
        """File the process writes its Flight location (``grpc://host:port``) to once it serves."""
        return self.run_dir / LOCATION_FILE

    @property
    def error_path(self) -> Path:
        """File the process writes its traceback to when the rollout loop fails."""
        return self.run_dir / ERROR_FILE

    @property
    def log_path(self) -> Path:
        """The process's stdout and stderr."""
        return self.run_dir / LOG_FILE

    def log_tail(self, num_lines: int = 40) -> str:
        """The last lines of the process's log ('' before it wrote any)."""
        return log_tail(self.log_path, num_lines)

    def wait_location(self, timeout_s: float = 600.0) -> str:
        """Block until the process serves; returns its Flight location.

        Raises:
            TransportError: the process exited first, or did not serve within ``timeout_s`` (then it is
                stopped); the message holds the tail of its log.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.location_path.is_file() and (location := self.location_path.read_text().strip()):
                return location
            if self.process.poll() is not None:
                raise TransportError(
                    f"rollout process exited with code {self.process.returncode} before serving; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.2)
        self.stop()
        raise TransportError(
            f"rollout process did not serve within {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """Stop the process and all it started (:func:`grpo_core.run.children.stop_child`); returns the exit code."""
        return stop_child(self.process, timeout_s)


def start_rollout_process(
    config: RunConfig | Path,
    server_urls: list[str],
    run_dir: Path,
    *,
    resume: ResumeState | Path | None = None,
    env: dict[str, str] | None = None,
) -> RolloutProcess:
    """Start ``python -m grpo_core.rollout`` for ``server_urls``; returns at once
    (see :meth:`RolloutProcess.wait_location`).

    Args:
        config: the run config, or the path of a config file (a ``RunConfig`` is written to
            ``<run_dir>/rollout_config.json``).
        server_urls: base URLs of the generation server replicas.
        run_dir: folder for the process's files (created; an old location file is removed).
        resume: where to restart: a :class:`ResumeState` (written to ``<run_dir>/rollout_resume.json``) or a
            checkpoint's ``rollout_state.json``; None = from the first prompt.
        env: variables added to this process's environment (e.g. ``PYTHONPATH`` for ``module:attribute``
            names outside the installed packages). The child holds the control and membership keys only
            (``GRPO_CONTROL_KEY``, ``GRPO_MEMBER_KEY``: ``env``'s, else derived from the run's token); the run's
            token and the inference key are dropped from its environment.

    Raises:
        ConfigError: no server URL.
    """
    if not server_urls:
        raise ConfigError("the rollout process needs at least one generation server URL")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / CONFIG_FILE if isinstance(config, RunConfig) else Path(config)
    if isinstance(config, RunConfig):
        config_path.write_text(config.model_dump_json(indent=1))
    resume_path = run_dir / RESUME_FILE if isinstance(resume, ResumeState) else resume
    if isinstance(resume, ResumeState):
        resume_path.write_text(json.dumps(dataclasses.asdict(resume)))
    (run_dir / LOCATION_FILE).unlink(missing_ok=True)
    (run_dir / ERROR_FILE).unlink(missing_ok=True)  # a retried flow run's old failure
    cmd = [
        sys.executable,
        "-m",
        "grpo_core.rollout",
        "--config",
        str(config_path),
        "--location-file",
        str(run_dir / LOCATION_FILE),
        "--error-path",
        str(run_dir / ERROR_FILE),
    ]
    cmd += [arg for url in server_urls for arg in ("--server-url", url)]
    if resume_path is not None:
        cmd += ["--resume", str(resume_path)]
    # the child's Flight server and this process's FlightSource share the membership key; its generation clients
    # hold the control key; it gets these two keys only (environment only; ``env`` from the flow brings its own)
    keys = role_env(ensure_run_token(), ROLE_CONTROL, ROLE_MEMBER)
    from grpo_core.run import lifeline

    # owned by this process (lifeline: it ends within a second of this process's death, SIGKILL included)
    child_env = {
        **without_keys(os.environ),
        **lifeline.owner_env(),
        **keys,
        **without_keys(env or {}),
        **{name: value for name, value in (env or {}).items() if name in (CONTROL_KEY_ENV, MEMBER_KEY_ENV)},
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONUNBUFFERED": "1",
    }
    with (run_dir / LOG_FILE).open("ab") as log:
        process = start_child(cmd, env=child_env, stdout=log)
    logger.info("started the rollout process %d (log %s)", process.pid, run_dir / LOG_FILE)
    return RolloutProcess(process, run_dir)


def run_rollout(job: RolloutJob, on_ready: Any = None) -> int:
    """Build the loop, serve it over Flight, run it; returns the process exit code.

    ``on_ready(location)`` is called once the Flight server listens.
    """
    from grpo_core.transport.flight_server import RolloutFlightServer

    from .pace import TokenAllowance
    from .queue import SampleQueue
    from .window import CompletionSample, MetricWindow

    rollout = job.config.rollout
    allowance = TokenAllowance(rollout.max_staleness, rollout.first_step_tokens)
    if job.resume is not None:
        allowance.policy_version = job.resume.policy_version
        allowance.trainer_step = job.resume.step
    queue = SampleQueue(allowance, with_topk=rollout.num_sampler_logprobs > 0)
    state: dict[str, Any] = {}
    evaluation = job.config.eval
    if evaluation.enabled:  # the trainer's reports name the steps to evaluate (grpo_core.rollout.evaluate)
        from .evaluate import EvalBoard

        final_step = job.config.max_steps if evaluation.at_end else None
        state["eval_board"] = board = EvalBoard(evaluation.every_steps, final_step)
        allowance.on_report = board.on_report
    window = MetricWindow()
    completions = (
        CompletionSample(job.config.num_completions_to_print, rollout.seed or 0) if job.config.log_completions else None
    )
    stop = threading.Event()

    def shutdown() -> None:
        stop.set()
        loop = state.get("loop")
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])

    def servers_behind() -> list[str]:
        replicas = state["rollout_loop"].runtime.server if "rollout_loop" in state else None
        return [replicas.urls[i] for i in sorted(replicas.behind)] if hasattr(replicas, "behind") else []

    from grpo_core.security.auth import tls_files
    from grpo_core.serving.limits import warn_if_exposed

    cert_file, key_file, _ = tls_files()  # the run's tls section (run_child_env)
    server = RolloutFlightServer(
        f"grpc://{rollout.flight_host}:{rollout.flight_port}",
        queue,
        window,
        lambda: state["rollout_loop"].generated_tokens if "rollout_loop" in state else 0,
        shutdown,
        completions,
        servers_behind=servers_behind,
        tls=(cert_file, key_file) if cert_file and key_file else None,
    )
    warn_if_exposed(rollout.flight_host, "the rollout Flight server", tls=server.tls)
    # Bound to every interface: advertise this host's name, which a trainer elsewhere can resolve.
    host = socket.getfqdn() if rollout.flight_host in ("0.0.0.0", "::", "") else rollout.flight_host
    location = f"{'grpc+tls' if server.tls else 'grpc'}://{host}:{server.port}"
    logger.info("rollout Flight server listening at %s", location)
    code = 0
    try:
        if on_ready is not None:
            on_ready(location)
        asyncio.run(_main(job, queue, window, state, completions))
        queue.finish()
        logger.info("rollout loop finished every prompt; serving the rest until shutdown")
    except asyncio.CancelledError:
        logger.info("rollout loop cancelled by shutdown")
    except BaseException:  # noqa: BLE001 - any failure is reported to the trainer with its traceback
        tb = traceback.format_exc()
        logger.error("rollout loop failed:\n%s", tb)
        if job.error_path:
            Path(job.error_path).parent.mkdir(parents=True, exist_ok=True)
            Path(job.error_path).write_text(tb)
        queue.fail(tb)
        code = 1
    _linger(stop, rollout.rollout_worker_timeout_s if code else None)
    server.shutdown()
    return code


async def _wait_for_served_version(rollout_loop: Any, queue: Any, timeout_s: float) -> None:
    """A resumed run samples policy version N, which fresh servers get from the trainer's first sync (they start
    with the base weights): wait for it, heartbeats continuing meanwhile. A LoRA run waits until every server lists
    adapter ``{name}-v{N}``; a full-weight run, whose servers serve every version under one name, until the trainer
    says it synced (``FlightSource.synced``) — sampling before would tag base-weight tokens with version N.

    Raises:
        TransportError: the version did not arrive within ``timeout_s`` (``rollout.rollout_worker_timeout_s``).
    """
    allowance = queue.allowance
    name = rollout_loop.served_model(allowance.policy_version)
    deadline = time.monotonic() + timeout_s
    if name == rollout_loop.runtime.model_name:
        if allowance.served_version < allowance.policy_version:
            logger.info("waiting for the trainer to sync policy version %d to the servers", allowance.policy_version)
        while allowance.served_version < allowance.policy_version:
            if time.monotonic() > deadline:
                raise TransportError(
                    f"the trainer never synced policy version {allowance.policy_version} to the "
                    f"servers within {timeout_s:.0f} s; it does so when it resumes"
                )
            queue.beat()
            await asyncio.sleep(0.2)
        return
    for client in rollout_loop.runtime.server.clients:
        while name not in await _listed(client):
            if time.monotonic() > deadline:
                raise TransportError(
                    f"servers never listed adapter {name!r} within {timeout_s:.0f} s; "
                    "the trainer syncs it when it resumes"
                )
            queue.beat()
            await asyncio.sleep(1.0)
    logger.info("resuming from adapter %s", name)


async def _listed(client: Any) -> set[str]:
    """Model names one replica lists; empty while it does not answer (it may still be starting)."""
    from grpo_core.errors import ServingError

    try:
        return {m.get("id") for m in await client.models()}
    except ServingError:
        return set()


def _linger(stop: threading.Event, timeout_s: float | None) -> None:
    """Serve until the trainer asks to stop, the timeout passes, or the process that started this one is gone
    (``lifeline.orphaned``: judged against the parent recorded at start, not the parent of now)."""
    from grpo_core.run import lifeline

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not stop.wait(0.5):
        if lifeline.orphaned() or (deadline is not None and time.monotonic() > deadline):
            return


async def _main(job: RolloutJob, queue: Any, window: Any, state: dict[str, Any], completions: Any = None) -> None:
    from .build import build_loop

    state["loop"] = asyncio.get_running_loop()
    from .driver import drive

    rollout_loop = await build_loop(job, queue, window, completions)
    await _wait_for_served_version(rollout_loop, queue, job.config.rollout.rollout_worker_timeout_s)
    queue.beat()  # building (tokenizer, dataset) blocked the event loop: count from here
    queue.running = True
    state["rollout_loop"] = rollout_loop
    try:
        if "eval_board" not in state:
            await drive(rollout_loop)
            return
        await _drive_with_eval(job, rollout_loop, queue, state["eval_board"])
    finally:
        await rollout_loop.runtime.server.aclose()


async def _drive_with_eval(job: RolloutJob, rollout_loop: Any, queue: Any, board: Any) -> None:
    """``drive`` beside the held-out evaluation task (``eval``); once every prompt is generated the queue is
    finished and the evaluations go on (the trainer still trains the queued samples) until the shutdown.

    Raises:
        BaseException: the first failure of either task (not wrapped in an exception group).
    """
    from grpo_core.run import lifeline

    from .driver import drive
    from .evaluate import build_evaluator

    evaluator = build_evaluator(job.config.eval, job.config.rollout, rollout_loop, board)
    queue.beat()  # loading and rendering the eval prompts blocked the event loop
    try:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(evaluator.run())
            await drive(rollout_loop)
            queue.finish()
            logger.info("rollout loop finished every prompt; evaluating until shutdown")
            while not lifeline.orphaned():  # the trainer's stall detection still reads the ticks
                queue.beat()
                await asyncio.sleep(0.5)
            raise asyncio.CancelledError  # the process that started this one is gone
    except BaseExceptionGroup as group:
        exc: BaseException = group
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        raise exc from None
