"""The rollout process: spawn it, check what it gets pickles, and its main function.

``start_rollout_process(job)`` spawns (multiprocessing ``spawn`` context, GPUs hidden with
``CUDA_VISIBLE_DEVICES=""``) a process that runs the rollout loop on its own asyncio event
loop and serves samples over Arrow Flight; it returns the process and the Flight location.
Everything in the job must pickle: the check runs before spawning and raises ``TypeError``
naming the object (lambdas and closures are the usual culprits; use module-level functions,
``functools.partial`` or callable class instances).

On failure the process writes its traceback to ``job.error_path``, keeps answering
heartbeats with it until the trainer shuts it down (or ``rollout_worker_timeout_s``
passes), and exits with code 1.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import queue
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_core.auth import ensure_run_token
from grpo_core.config import RunConfig
from grpo_core.errors import TransportError
from grpo_core.transport.types import ResumeState

logger = logging.getLogger(__name__)


@dataclass
class RolloutJob:
    """Everything the rollout process needs (all of it must pickle).

    Attributes:
        config: the run config (``rollout``, ``model`` for the tokenizer, ``server`` limits).
        server_urls: base URLs of the generation server replicas.
        resume: where to restart (None = from the first prompt).
        error_path: where a failure's traceback is written.
        dataset: prompt rows passed in code (overrides ``rollout.dataset``).
        reward_functions, tools: callables passed in code (added to those named in config).
        environment_factory: class or name -> class passed in code (overrides the config's).
        loop_class: ``RolloutLoop`` subclass passed in code (overrides ``rollout.loop_class``).
    """

    config: RunConfig
    server_urls: list[str]
    resume: ResumeState | None = None
    error_path: str | None = None
    dataset: Any = None
    reward_functions: list[Any] = field(default_factory=list)
    tools: list[Any] = field(default_factory=list)
    environment_factory: Any = None
    loop_class: Any = None


def check_picklable(job: RolloutJob) -> None:
    """Raise ``TypeError`` naming the first object of ``job`` that cannot be pickled."""
    named: list[tuple[str, Any]] = [("dataset", job.dataset), ("loop_class", job.loop_class),
                                    ("environment_factory", job.environment_factory)]
    named += [(f"reward_functions[{i}]", f) for i, f in enumerate(job.reward_functions)]
    named += [(f"tools[{i}]", f) for i, f in enumerate(job.tools)]
    for name, obj in named:
        try:
            pickle.dumps(obj)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(
                f"{name} ({getattr(obj, '__qualname__', type(obj).__name__)}) cannot be pickled for the spawned "
                f"rollout process: {exc}. Define it at module level (no lambda or closure), or use "
                "functools.partial or a callable class instance") from None


def start_rollout_process(job: RolloutJob, *, startup_timeout_s: float = 300.0) -> tuple[Any, str]:
    """Spawn the rollout process and wait for its Flight server.

    Returns:
        ``(process, location)``; hand both to ``grpo_core.transport.flight_client.FlightSource``.

    Raises:
        TypeError: something in ``job`` does not pickle.
        TransportError: the process died or did not report its port within ``startup_timeout_s``.
    """
    check_picklable(job)
    ensure_run_token()  # the child's Flight server and this process's RolloutSource share it (environment only)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    process = ctx.Process(target=process_main, args=(job, ready), name="grpo-rollout", daemon=True)
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # inherited by the child only: restored right after start
    try:
        process.start()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        try:
            return process, ready.get(timeout=0.5)
        except queue.Empty:
            if not process.is_alive():
                break
    tb = Path(job.error_path).read_text() if job.error_path and Path(job.error_path).is_file() else ""
    process.kill()
    raise TransportError(f"rollout process did not start (exit code {process.exitcode}){chr(10) + tb if tb else ''}")


def process_main(job: RolloutJob, ready: Any = None) -> None:
    """Body of the rollout process: Flight server + rollout loop until shut down (or its parent is gone)."""
    from grpo_core import lifeline

    lifeline.watch(parent=True)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    code = run_rollout(job, on_ready=ready.put if ready is not None else None)
    logging.shutdown()
    os._exit(code)  # skip interpreter teardown: gRPC and tokenizer threads may still hold locks


def run_rollout(job: RolloutJob, on_ready: Any = None) -> int:
    """Build the loop, serve it over Flight, run it; returns the process exit code.

    ``on_ready(location)`` is called once the Flight server listens.
    """
    from grpo_core.transport.flight_server import RolloutFlightServer, SampleQueue
    from .pace import TokenAllowance
    from .window import CompletionSample, MetricWindow

    rollout, tracking = job.config.rollout, job.config.tracking
    allowance = TokenAllowance(rollout.max_staleness, rollout.first_step_tokens)
    if job.resume is not None:
        allowance.policy_version = job.resume.policy_version
        allowance.trainer_step = job.resume.step
    queue = SampleQueue(allowance, with_topk=rollout.num_sampler_logprobs > 0)
    window = MetricWindow()
    completions = CompletionSample(tracking.num_completions_to_print, rollout.seed) if tracking.log_completions else None
    stop = threading.Event()
    state: dict[str, Any] = {}

    def shutdown() -> None:
        stop.set()
        loop = state.get("loop")
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])

    server = RolloutFlightServer(f"grpc://{rollout.flight_host}:{rollout.flight_port}", queue, window,
                                 lambda: state["rollout_loop"].generated_tokens if "rollout_loop" in state else 0,
                                 shutdown, completions)
    # Bound to every interface: advertise this host's name, which a trainer elsewhere can resolve.
    host = socket.getfqdn() if rollout.flight_host in ("0.0.0.0", "::", "") else rollout.flight_host
    location = f"grpc://{host}:{server.port}"
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
    """A resumed LoRA run samples from adapter ``{name}-v{N}``, which fresh servers get from the
    trainer's first sync: wait until every server lists it (heartbeats continue meanwhile)."""
    name = rollout_loop.served_model(queue.allowance.policy_version)
    if name == rollout_loop.runtime.model_name:
        return
    deadline = time.monotonic() + timeout_s
    for client in rollout_loop.runtime.server.clients:
        while name not in await _listed(client):
            if time.monotonic() > deadline:
                raise TransportError(f"servers never listed adapter {name!r} within {timeout_s:.0f} s; "
                                     "the trainer syncs it when it resumes")
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
    from grpo_core import lifeline

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
        await drive(rollout_loop)
    finally:
        await rollout_loop.runtime.server.aclose()
