"""The ``grpo-train`` flow: the trainer (torchrun) starts while the servers start → rollout process → finalize.

Thin by design: every step calls ``grpo_core``; tasks get references (the run folder, URLs, the
MLflow run id), never payloads, and no task caches (the config is not hashed). Each flow run
works in ``<train.output_dir>/<flow run id>/``; a retry of the same flow run (flow retries, or
Retry in the UI) finds that folder, or the checkpoint in its MLflow run, and resumes.

The ``train`` task starts right after ``prepare``, before the servers are healthy: the trainer loads its model and
compiles while they start, then waits for the servers' URLs and the rollout's location, which the flow writes to
the run folder once both are up (``grpo_core.run.startup``; the start-up's events in ``startup.jsonl``). A server
that never becomes healthy fails ``provision_servers`` as before, and the flow stops the waiting trainer.

The ``rollout`` task lives as long as the rollout process: it is submitted to the flow's task
runner and stays Running beside ``train`` (the run graph shows both side by side), Completed when
the process exits 0 after the trainer shut it down, Failed when it exits otherwise, Cancelled when
the flow stopped it (training failed, or the run was cancelled). The GPU part of the run holds the
slots of the Prefect global concurrency limit ``flow.concurrency_limit`` (``gpu``), so a scheduled
run and a UI run wait for each other instead of sharing GPUs and ports. Prefect artifacts (a link
to the MLflow run, training progress, the summary table, the reward curve) are in ``flows.artifacts``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from prefect import flow, get_run_logger, runtime, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Cancelled

from flows import artifacts
from grpo_core.config import RunConfig
from grpo_core.errors import ChildDiedError, RolloutProcessError, TrainerError
from grpo_core.rollout.process import LOCATION_FILE
from grpo_core.run import layout, startup
from grpo_core.run.commands import LOCATION_TIMEOUT_S, run_slots, trainer_launch
from grpo_core.run.finalize import finalize_run
from grpo_core.run.prepare import SECRETS, prepare_run, run_child_env, run_config
from grpo_core.run.processes import REGISTRY, setup_logging, stream, wait_child, watch_servers
from grpo_core.run.retry import raise_if_rollout_failed, retry_can_cure, rollout_failed, trainer_failed
from grpo_core.tracking.report import eval_history

if TYPE_CHECKING:
    from prefect import Task
    from prefect.client.schemas.objects import TaskRun
    from prefect.futures import PrefectFuture
    from prefect.states import State


RESOLVED_CONFIG = layout.RUN_CONFIG


@task(name="prepare", cache_policy=NO_CACHE, persist_result=False)
def prepare(config: RunConfig, flow_run_id: str, deployment: str | None) -> dict:
    """Check the config, lay out the run folder, open the MLflow run (its link as an artifact), fetch and check the
    checkpoint it resumes from (:func:`grpo_core.run.prepare.prepare_run`).

    Returns:
        ``{"run_dir", "mlflow_run_id", "mlflow_url", "resume_state"}`` (paths as strings; resume_state None = fresh).
    """
    run = prepare_run(
        config,
        flow_run_id,
        deployment,
        run_name=runtime.flow_run.name,
        log=get_run_logger(),
        on_mlflow_run=artifacts.publish_mlflow_link,
    )
    return dataclasses.asdict(run)


def server_start_failed(task: Task, task_run: TaskRun, state: State) -> bool:  # noqa: ARG001 - retry_condition_fn
    """Retry ``provision_servers`` only when a replica failed to start (``ServerStartError``: exited during
    start-up, or not healthy in time); config errors, missing files and server/config mismatches fail at once."""
    from grpo_core.errors import ServerStartError

    return isinstance(state.result(raise_on_failure=False), ServerStartError)


@task(
    name="provision_servers",
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=server_start_failed,
)
def provision_servers(run_dir: str) -> list[str]:
    """Start the generation server replicas (vLLM on GPUs, else embedded), or have ``server.deployment`` start them
    in a flow run on another work pool (``flows.grpo_servers``), or wait for the external ones of ``server.urls``;
    start the router in front of them when ``server.router_port`` is set; returns the URLs.

    Retried (``server.start_retries`` times, see :func:`server_start_failed`) when a replica fails to start.
    """
    from grpo_core.serving.launch import choose_backend, provision
    from grpo_core.serving.replicas import wait_external
    from grpo_core.serving.router.server import start_router

    log, procs, cfg = get_run_logger(), REGISTRY[run_dir], run_config(run_dir)
    if cfg.server.deployment:  # replicas in a flow run of their own, on the servers' work pool
        from flows.grpo_servers import ServerRun

        server_run = ServerRun(cfg, str(runtime.flow_run.id), procs.token, SECRETS.get(run_dir, {}), log)
        procs.servers.append(server_run)  # stopped (its flow run cancelled) with the run's processes
        urls = server_run.start()
        log.info("replicas of %s healthy: %s", cfg.server.deployment, ", ".join(urls))
    elif cfg.server.urls:
        urls = wait_external(cfg.server, cfg.tls.client_ca())
        log.info("external generation servers healthy: %s", ", ".join(urls))
    else:
        backend = choose_backend(cfg)
        for i in range(cfg.server.num_replicas):
            procs.follow(cfg.server.log_dir / layout.replica_log(backend, i), log, f"[server {i}] ")
        handles = provision(cfg, token=procs.token)
        procs.servers.extend(handles)
        urls = [h.url for h in handles]
    if cfg.server.router_port is not None:
        procs.follow(cfg.server.log_dir / layout.ROUTER_LOG, log, "[router] ")
        procs.servers.append(start_router(cfg.server, urls, token=procs.token, tls=cfg.tls))
        log.info("the replicas answer as one OpenAI-compatible URL at %s", procs.servers[-1].url)
    watch_servers(procs)  # a server that dies fails the attempt now, not after server.control_timeout_s
    return urls


@task(name="rollout", cache_policy=NO_CACHE, persist_result=False)
def rollout(run_dir: str, server_urls: list[str], resume_state: str | None):  # noqa: ANN201 - str or a State
    """Run the rollout process for the whole run; the task's state follows the process.

    Writes the process's Arrow Flight location to ``<run_dir>/rollout.location`` once it serves (the
    flow starts ``train`` then), and returns it when the process exits 0 (the trainer shut it down).

    A process that failed on its own (it wrote ``rollout_error.txt``; it then lingers until the trainer,
    seeing the error, fails and the flow stops everything) fails the task, even though the flow stopped it.

    Returns:
        The location (Completed), or a Cancelled state when the flow stopped a process that had not failed.

    Raises:
        RolloutProcessError: the process failed (its traceback's last line), exited before serving, or exited
            with a non-zero code (with its log's tail).
    """
    from grpo_core.errors import TransportError
    from grpo_core.rollout.process import LOG_FILE, start_rollout_process

    log, procs, root = get_run_logger(), REGISTRY[run_dir], Path(run_dir)
    procs.follow(root / LOG_FILE, log, "[rollout] ")
    started = start_rollout_process(
        root / RESOLVED_CONFIG,
        server_urls,
        root,
        resume=Path(resume_state) if resume_state else None,
        env=run_child_env(run_dir),
    )
    process = started.process
    procs.processes.append(process)
    try:
        location = started.wait_location(timeout_s=LOCATION_TIMEOUT_S)
    except TransportError as exc:
        raise_if_rollout_failed(started.error_path, started.log_path, exc)
        if procs.stopping:
            return Cancelled(message=f"rollout process stopped by the flow before it served ({exc})")
        raise RolloutProcessError(str(exc)) from None
    log.info("rollout process %d serves samples at %s", process.pid, location)
    code = wait_child(process, procs, "rollout", started.log_path)  # a death stops the trainer now
    raise_if_rollout_failed(started.error_path, started.log_path, f"exited with code {code}")
    if procs.stopping:
        return Cancelled(message=f"rollout process stopped by the flow (exit code {code})")
    if code != 0:
        raise RolloutProcessError(
            f"rollout process exited with code {code}; log {started.log_path}:\n{started.log_tail()}"
        )
    log.info("rollout process %d finished", process.pid)
    return location


def _await_location(run_dir: str, rollout_run: PrefectFuture, trainer_run: PrefectFuture | None = None) -> str:
    """The rollout process's Flight location once it serves; raises the rollout task's error if it ended first, and
    the train task's if the trainer ended first (it failed while loading or compiling)."""
    location_file = Path(run_dir) / LOCATION_FILE
    while True:
        if location_file.is_file() and location_file.read_text().strip():
            return location_file.read_text().strip()
        if rollout_run.wrapped_future.done():
            rollout_run.result()  # raises the task's failure
            raise RolloutProcessError("the rollout task ended before the rollout process served")
        if trainer_run is not None and trainer_run.wrapped_future.done():
            trainer_run.result()  # raises the task's failure
            raise TrainerError("the trainer ended before the rollout process served")
        time.sleep(0.2)


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def train(run_dir: str):  # noqa: ANN201 - str or a State
    """Run the trainer under torchrun until ``train.max_steps`` (a progress artifact follows its steps); returns the
    latest checkpoint folder. Started before the servers are healthy: the trainer loads and compiles, then waits for
    the servers' URLs and the rollout's location the flow writes (``grpo_core.run.startup``).

    Returns:
        The checkpoint folder (Completed), or a Cancelled state when the flow stopped a trainer that had not failed
        (e.g. a server never became healthy: the flow's error names it).

    Raises:
        TrainerError: torchrun exited non-zero (the message holds its output's tail, with the traceback).
        ChildDiedError: the rollout process, a server replica or the router died, so the flow stopped the trainer
            (names the child, its exit code and its log's tail).
    """
    from grpo_core.tracking.report import read_trainer_error
    from grpo_core.train.checkpoint import latest_checkpoint

    log, root, procs = get_run_logger(), Path(run_dir), REGISTRY[run_dir]
    cmd, env = trainer_launch(run_dir, log)
    progress = artifacts.TrainingProgress(root / layout.METRICS, run_config(run_dir).train.max_steps)
    progress.start()
    try:
        code, tail = stream(cmd, log, "[trainer] ", env, pid_file=root / layout.TRAINER_PID, register=procs)
    finally:
        progress.stop()
    failure, failure_log = procs.failure, procs.failure_log
    if code != 0 and failure:
        from grpo_core.run.children import log_tail

        raise ChildDiedError(
            f"{failure}; the trainer was stopped (exit code {code})"
            + (f"; log {failure_log}:\n{log_tail(failure_log)}" if failure_log else "")
        )
    if code != 0 and procs.stopping and not read_trainer_error(root):
        return Cancelled(message=f"trainer stopped by the flow (exit code {code})")
    if code != 0:
        raise trainer_failed(code, read_trainer_error(root), tail)
    return str(latest_checkpoint(root))


@task(name="finalize", cache_policy=NO_CACHE, persist_result=False)
def finalize(run_dir: str, mlflow_run_id: str | None, wall_s: float, resumed_from: str | None = None) -> dict:
    """Reward curve, summary, model card; the exported model to MLflow (a registered version with the alias)
    and to the Hub (``export.push_to_hub``); summary and reward-curve artifacts. Returns the summary (JSON-able).
    """
    summary = finalize_run(run_config(run_dir), run_dir, mlflow_run_id, wall_s, get_run_logger(), resumed_from)
    artifacts.publish_summary(summary)
    png = summary.get("reward_curve")
    artifacts.publish_reward_curve(Path(png) if png else None, summary)
    artifacts.publish_eval(eval_history(Path(run_dir) / layout.METRICS))
    return summary


def _no_more_retries(exc: BaseException) -> None:
    """Lower this flow run's retries to the attempts made, so the Failed state this attempt proposes is final (the
    server's retry rule reads the run's ``empirical_policy``); a later Retry from the UI still works."""
    from prefect.client.orchestration import get_client

    flow_run_id = runtime.flow_run.id
    if not flow_run_id:
        return
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        policy = run.empirical_policy
        if policy.retries is None or run.run_count > policy.retries:
            return  # no retry was left anyway
        client.update_flow_run(
            flow_run_id, empirical_policy=policy.model_copy(update={"retries": max(run.run_count - 1, 0)})
        )
    get_run_logger().error("not retrying the flow run: %s is not a failure a retry can cure", type(exc).__name__)


@contextlib.contextmanager
def _retry_only_curable() -> Iterator[None]:
    """Let the flow's retries (``@flow(retries=...)``) run only after a failure that :func:`retry_can_cure`."""
    try:
        yield
    except Exception as exc:
        if not retry_can_cure(exc):
            try:
                _no_more_retries(exc)
            except Exception as api_exc:  # noqa: BLE001 - the run's own error must surface, not this one
                get_run_logger().warning(
                    "could not stop the flow run's retries (%s); a retry may repeat: %s", api_exc, exc
                )
        raise


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM (cancellation by the worker) into an exception so ``finally`` stops every process."""

    def handler(signum: int, frame: object) -> NoReturn:  # noqa: ARG001 - the signal handler's signature
        raise KeyboardInterrupt("flow run terminated (SIGTERM)")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: the caller handles termination
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@flow(name="grpo-train", retries=1, retry_delay_seconds=2, log_prints=False, validate_parameters=True)
def grpo_train(config: RunConfig) -> dict:
    """Train a policy with asynchronous GRPO: servers, rollout process and FSDP2 trainer, tracked in MLflow.

    Args:
        config: the whole run config (the UI renders it as a form; invalid values fail the run
            before anything starts).

    Returns:
        The run summary: steps, first/last five rewards, throughputs (tokens/s), MLflow run id and
        URI, checkpoint and reward-curve paths.

    A failed attempt is retried (``retries``) only when a retry may cure it (:func:`retry_can_cure`).
    """
    setup_logging()
    with _retry_only_curable():
        return _attempt(config)


def _attempt(config: RunConfig) -> dict:
    """One attempt of :func:`grpo_train`."""
    flow_run_id = str(runtime.flow_run.id or f"local-{int(time.time())}")
    deployment = runtime.deployment.name
    run = prepare(config, flow_run_id, deployment)
    run_dir, mlflow_run_id = run["run_dir"], run["mlflow_run_id"]
    start, rollout_run, trainer_run = time.monotonic(), None, None
    try:
        with _sigterm_raises(), gpu_slots(config):
            root = Path(run_dir)
            startup.begin(run_dir, startup.command_start())  # the command's start, else now
            for old in (LOCATION_FILE, layout.TRAINER_INPUTS):  # a retried flow run's
                (root / old).unlink(missing_ok=True)
            trainer_run = train.submit(run_dir)  # loads and compiles while the servers start
            urls = provision_servers.with_options(retries=config.server.start_retries)(run_dir)
            startup.mark(run_dir, "servers_healthy", "flow")
            rollout_run = rollout.submit(run_dir, urls, run["resume_state"])
            try:
                location = _await_location(run_dir, rollout_run, trainer_run)
                startup.mark(run_dir, "rollout_serves", "flow")
                startup.write_inputs(root / layout.TRAINER_INPUTS, urls, location)
                trainer_run.result()  # raises the train task's failure
            except TrainerError as exc:  # the rollout's own failure, when it recorded one, is the root cause
                rollout_failed(run_dir, exc)
                raise
            rollout_run.result()  # the trainer shut the rollout down: its exit decides the task's state
    except BaseException:
        if mlflow_run_id:
            from grpo_core import tracking

            tracking.end_run(run_config(run_dir).tracking, mlflow_run_id, "FAILED")
        raise
    finally:
        _stop(run_dir)
        for run_ in (rollout_run, trainer_run):
            if run_ is not None:
                run_.wait(timeout=60)  # its state turns final (Cancelled when stopped here)
    resumed_from = str(Path(run["resume_state"]).parent) if run["resume_state"] else None
    return finalize(run_dir, mlflow_run_id, time.monotonic() - start, resumed_from)


@contextlib.contextmanager
def gpu_slots(config: RunConfig) -> Iterator[None]:
    """Hold ``run_slots(config)`` slots of the global concurrency limit ``flow.concurrency_limit`` (waiting for
    them); a limit the server does not have is not waited for (e.g. ``grpo train`` on the embedded API).

    Raises:
        ConfigError: the run needs more slots than the limit has (it would wait forever).
        SlotLeaseLost: inside the block, when the slots' lease is lost (``flows.slot_lease``): the run stops and the
            flow's retry (the error is curable) waits for the slots again.
    """
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
    from prefect.exceptions import ObjectNotFound

    from flows.slot_lease import hold_slots
    from grpo_core.errors import ConfigError

    name, log = config.flow.concurrency_limit, get_run_logger()
    if name is None:
        yield
        return
    try:
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        limit = None  # the run's body runs outside this handler: its errors are not chained to this 404
    if limit is None:
        log.info("no global concurrency limit %r on this Prefect server: not waiting for slots", name)
        yield
        return
    slots = run_slots(config)
    if slots > limit.limit:
        raise ConfigError(
            f"the run needs {slots} slots of the global concurrency limit {name!r}, which has "
            f"{limit.limit}; raise it (`prefect gcl update {name} --limit {slots}`) or set "
            "flow.concurrency_slots"
        )
    # Held under a lease renewed until it is really lost; then SlotLeaseLost stops the run (flows/slot_lease.py).
    hold = functools.partial(hold_slots, name, slots)
    with contextlib.ExitStack() as stack:
        # One attempt first: the "waiting" line is logged when the server really refuses the slots (423), not from a
        # read of the limit made before asking (two runs started together both read it free, and one then waited
        # silently).
        try:
            stack.enter_context(hold(max_retries=0))
        except ConcurrencySlotAcquisitionError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, httpx.HTTPStatusError) and cause.response.status_code == 423):
                raise
            with get_client(sync_client=True) as client:
                limit = client.read_global_concurrency_limit_by_name(name)
            log.info(
                "waiting for %d slot(s) of the global concurrency limit %r (%d of %d in use)",
                slots,
                name,
                limit.active_slots,
                limit.limit,
            )
            stack.enter_context(hold())
        log.info("holding %d slot(s) of the global concurrency limit %r", slots, name)
        yield


def _stop(run_dir: str) -> None:
    procs = REGISTRY.pop(run_dir, None)
    if procs is not None:
        procs.stop_all()
