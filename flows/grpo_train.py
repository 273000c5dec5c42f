"""The ``grpo-train`` flow: provision servers → rollout process beside the trainer (torchrun) → finalize.

Thin by design: every step calls ``grpo_core``; tasks get references (the run folder, URLs, the
MLflow run id), never payloads, and no task caches (the config is not hashed). Each flow run
works in ``<train.output_dir>/<flow run id>/``; a retry of the same flow run (flow retries, or
Retry in the UI) finds that folder, or the checkpoint in its MLflow run, and resumes.

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
import functools
import json
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from prefect import flow, get_run_logger, runtime, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Cancelled

from flows import artifacts
from flows.processes import REGISTRY, child_env, setup_logging, stream, wait_child, watch_servers
from grpo_core.auth import TOKEN_ENV
from grpo_core.config import RunConfig
from grpo_core.rollout.process import LOCATION_FILE
from grpo_core.run import layout

RESOLVED_CONFIG = layout.RUN_CONFIG
TRAIN_CONFIG = layout.TRAIN_CONFIG  # the trainer's sub-config (``RunConfig.trainer_process()``)


class RunChildError(RuntimeError):
    """A child process of the run failed. ``causes``: the class names of the exceptions that ended it, as it
    recorded them (empty when it recorded none: killed, or died without a traceback); they decide whether a
    retry may cure the failure (:func:`retry_can_cure`)."""

    def __init__(self, message: str, causes: list[str] | None = None) -> None:
        super().__init__(message)
        self.causes = list(causes or [])


class TrainerError(RunChildError):
    """The trainer process failed; the message holds the tail of its output."""


class RolloutProcessError(RunChildError):
    """The rollout process failed to start or exited with an error; the message holds its log's tail."""


class ChildDiedError(RuntimeError):
    """A child of the run (the rollout process, a generation server replica, the router) exited on its own, so
    the flow stopped the trainer; the message names the child, its exit code and its log's tail."""


#: Secret values of each run's config by run folder: kept in this process, never in the (redacted) run files.
_SECRETS: dict[str, dict[str, str]] = {}


def _config(run_dir: str) -> RunConfig:
    from grpo_core.redact import apply_secrets

    data = json.loads((Path(run_dir) / RESOLVED_CONFIG).read_text())
    return RunConfig.model_validate(apply_secrets(data, _SECRETS.get(run_dir, {})))


def _child_env(run_dir: str, secrets: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the run's rollout and trainer processes (``flows.processes.child_env``: owned by this process):
    the run's token and the config's secrets (``GRPO_RUN_SECRETS``; ``secrets``: those of a process's sub-config,
    else the run config's) travel here, never on a command line."""
    from grpo_core.redact import SECRETS_ENV

    extra = {TOKEN_ENV: REGISTRY[run_dir].token}
    secrets = _SECRETS.get(run_dir) if secrets is None else secrets
    if secrets:
        extra[SECRETS_ENV] = json.dumps(secrets)
    return child_env(extra)


@task(name="prepare", cache_policy=NO_CACHE, persist_result=False)
def prepare(config: RunConfig, flow_run_id: str, deployment: str | None) -> dict:
    """Check the config (code it names inside the allow-list ``GRPO_ALLOWED_MODULES`` before any import, then
    imports, dataset columns, Hub push), lay out the run folder (0700; the config file 0600 with its secrets
    redacted, kept in this process), open the MLflow run (and publish the link artifact to it), fetch a checkpoint
    and check it against its manifest.

    Returns:
        ``{"run_dir", "mlflow_run_id", "resume_state"}`` (paths as strings; resume_state None = fresh start).
    """
    from grpo_core import preflight
    from grpo_core.redact import mask_values, redact_logs, secret_values, write_private
    from grpo_core.run_lock import RunLock
    from grpo_core.train.checkpoint import STATE_FILE, latest_checkpoint
    from grpo_core.train.fingerprint import check_resume
    from grpo_core.train.manifest import verify_manifest

    secrets = secret_values(config)
    redact_logs(mask_values(secrets))
    log = get_run_logger()
    preflight.check_run(config)
    run_dir = (config.train.output_dir / flow_run_id).resolve()
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    run_dir.chmod(0o700)  # the run's files (logs, configs, checkpoints) are its owner's only
    _SECRETS[str(run_dir)] = secrets
    # an orphaned trainer of a killed attempt may still write the folder: wait for it, or fail naming its pid
    with RunLock(run_dir, "prepare", config.train.run_lock_timeout_s):
        pass
    cfg = config.model_copy(deep=True)
    cfg.train.output_dir = run_dir
    cfg.server.log_dir = run_dir / layout.SERVERS_DIR
    mlflow_run_id = None
    if cfg.tracking.enabled:
        from grpo_core import tracking

        mlflow_run_id, continued = tracking.start_run(cfg, flow_run_id, deployment, run_name=runtime.flow_run.name)
        cfg.tracking.run_id = mlflow_run_id
        if latest_checkpoint(run_dir) is None:  # a retry on a host without the run folder, or resume_from
            fetch_checkpoint(cfg, run_dir, continued)
    write_private(run_dir / RESOLVED_CONFIG, cfg.model_dump_json(indent=1))  # secrets redacted
    if mlflow_run_id:
        from grpo_core import tracking

        artifacts.publish_mlflow_link(tracking.run_url(cfg.tracking, mlflow_run_id), mlflow_run_id)
    latest = latest_checkpoint(run_dir)
    if latest is not None:
        verify_manifest(latest)  # a downloaded checkpoint is refused here, naming its tampered or missing file
        check_resume(cfg.trainer_process(), latest)  # a different run refuses here, before any server starts
        log.info("resuming from checkpoint %s", latest)
    log.info("run folder %s, MLflow run %s", run_dir, mlflow_run_id)
    return {
        "run_dir": str(run_dir),
        "mlflow_run_id": mlflow_run_id,
        "resume_state": str(latest / STATE_FILE) if latest is not None else None,
    }


def fetch_checkpoint(cfg: RunConfig, run_dir: Path, continued: bool) -> Path | None:
    """Fetch the checkpoint a run without a local one resumes from: its own MLflow run's (a retry on a host
    where the run folder is gone), else ``resume_from``'s; each the latest completely uploaded one.

    Returns:
        The local checkpoint folder, or None (a fresh start: neither run completed a checkpoint upload, and
        ``resume_from`` is unset).

    Raises:
        CheckpointError: a checkpoint exists but cannot be fetched (names the run, the checkpoint and why), or
            ``resume_from`` names a run without a completely uploaded checkpoint.
    """
    from grpo_core import tracking
    from grpo_core.errors import CheckpointError
    from grpo_core.train.checkpoint import verify

    fetched = None
    if continued:
        fetched = tracking.download_latest_checkpoint(cfg.tracking, cfg.tracking.run_id, run_dir, verify=verify)
    source = cfg.resume_from
    if fetched is None and source:
        fetched = tracking.download_latest_checkpoint(cfg.tracking, source, run_dir, verify=verify)
        if fetched is None:
            raise CheckpointError(
                f"resume_from={source}: MLflow run {source} has no completely uploaded checkpoint "
                f"(no tag {tracking.LATEST_STEP_TAG}); pick a run that saved one, or drop "
                "resume_from to start a new run"
            )
    return fetched


def server_start_failed(task, task_run, state) -> bool:  # noqa: ANN001, ARG001 - Prefect's retry_condition_fn
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
    from grpo_core.serving.router import start_router
    from grpo_core.serving.routing import wait_external
    from grpo_core.serving.vllm import choose_backend, provision

    log, procs, cfg = get_run_logger(), REGISTRY[run_dir], _config(run_dir)
    if cfg.server.deployment:  # replicas in a flow run of their own, on the servers' work pool
        from flows.grpo_servers import ServerRun

        server_run = ServerRun(cfg, str(runtime.flow_run.id), procs.token, _SECRETS.get(run_dir, {}), log)
        procs.servers.append(server_run)  # stopped (its flow run cancelled) with the run's processes
        urls = server_run.start()
        log.info("replicas of %s healthy: %s", cfg.server.deployment, ", ".join(urls))
    elif cfg.server.urls:
        urls = wait_external(cfg.server)
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
        procs.servers.append(start_router(cfg.server, urls, token=procs.token))
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
        env=_child_env(run_dir),
    )
    process = started.process
    procs.processes.append(process)
    try:
        location = started.wait_location(timeout_s=600)
    except TransportError as exc:
        _raise_if_failed(started.error_path, started.log_path, exc)
        if procs.stopping:
            return Cancelled(message=f"rollout process stopped by the flow before it served ({exc})")
        raise RolloutProcessError(str(exc)) from None
    log.info("rollout process %d serves samples at %s", process.pid, location)
    code = wait_child(process, procs, "rollout", started.log_path)  # a death stops the trainer now
    _raise_if_failed(started.error_path, started.log_path, f"exited with code {code}")
    if procs.stopping:
        return Cancelled(message=f"rollout process stopped by the flow (exit code {code})")
    if code != 0:
        raise RolloutProcessError(
            f"rollout process exited with code {code}; log {started.log_path}:\n{started.log_tail()}"
        )
    log.info("rollout process %d finished", process.pid)
    return location


def _raise_if_failed(error_file: Path, log_file: Path, how: object) -> None:
    """Raise RolloutProcessError when the rollout process reported its own failure in ``error_file``."""
    if not error_file.is_file():
        return
    lines = [line for line in error_file.read_text(errors="replace").splitlines() if line.strip()]
    cause = lines[-1] if lines else "no traceback"
    causes = [m.group(1)] if (m := re.match(r"([\w.]+)(?::|$)", cause)) else []  # `module.Type: message`
    raise RolloutProcessError(
        f"rollout process failed ({how}): {cause}; traceback in {error_file}, log {log_file}", causes
    )


def _await_location(run_dir: str, rollout_run) -> str:  # noqa: ANN001 - a PrefectFuture
    """The rollout process's Flight location once it serves; raises the rollout task's error if it ended first."""
    location_file = Path(run_dir) / LOCATION_FILE
    while True:
        if location_file.is_file() and location_file.read_text().strip():
            return location_file.read_text().strip()
        if rollout_run.wrapped_future.done():
            rollout_run.result()  # raises the task's failure
            raise RolloutProcessError("the rollout task ended before the rollout process served")
        time.sleep(0.2)


def trainer_command(cfg: RunConfig, config_path: Path, server_urls: list[str], node_rank: int = 0) -> list[str]:
    """The torchrun command of trainer host ``node_rank`` (the flow runs node 0; with ``train.nnodes`` > 1 every
    other trainer host runs this command with its own ``node_rank`` and a copy of ``config_path``).

    One host: ``grpo_core.train.launch`` (torchrun with its stores on loopback only). Several: torchrun's static
    rendezvous at ``train.rdzv_endpoint`` (node 0 hosts the store and holds global rank 0, the rank that pulls
    samples, syncs the servers and writes checkpoints); that store must be reachable from the other trainer hosts.

    Raises:
        ValueError: ``node_rank`` outside ``0 .. train.nnodes - 1``.
    """
    tc = cfg.train
    if not 0 <= node_rank < tc.nnodes:
        raise ValueError(
            f"node_rank={node_rank} is not a trainer host of train.nnodes={tc.nnodes} (0 to "
            f"{tc.nnodes - 1}); raise train.nnodes to add a host"
        )
    if tc.nnodes == 1:
        cmd = [sys.executable, "-m", "grpo_core.train.launch", "--nproc-per-node", str(tc.num_ranks)]
    else:
        host, _, port = tc.rdzv_endpoint.rpartition(":")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(tc.num_ranks),
            "--nnodes",
            str(tc.nnodes),
            "--node-rank",
            str(node_rank),
            "--master-addr",
            host or tc.rdzv_endpoint,
            "--master-port",
            port or "29400",
            "--rdzv-conf",
            f"timeout={tc.rdzv_timeout_s}",
        ]
    cmd += ["-m", "grpo_core.train", "--config", str(config_path)]
    return cmd + [arg for url in server_urls for arg in ("--server-url", url)]


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def train(run_dir: str, server_urls: list[str], rollout_location: str) -> str:
    """Run the trainer under torchrun until ``train.max_steps`` (a progress artifact follows its steps);
    returns the latest checkpoint folder.

    Raises:
        TrainerError: torchrun exited non-zero (the message holds its output's tail, with the traceback).
        ChildDiedError: the rollout process, a server replica or the router died, so the flow stopped the trainer
            (names the child, its exit code and its log's tail).
    """
    from grpo_core.redact import secret_values, write_private
    from grpo_core.report import TRAINER_ERROR, read_trainer_error
    from grpo_core.train.checkpoint import latest_checkpoint

    log, root = get_run_logger(), Path(run_dir)
    cfg = _config(run_dir)
    cfg.train.rollout_location = rollout_location
    (root / TRAINER_ERROR).unlink(missing_ok=True)
    config_path, sub = root / TRAIN_CONFIG, cfg.trainer_process()  # the trainer reads only its sub-config
    write_private(config_path, sub.model_dump_json(indent=1))  # secrets redacted; they travel in the environment
    cmd = trainer_command(cfg, config_path, server_urls)
    if cfg.train.nnodes > 1:  # torchrun says nothing while it waits for the other hosts
        from grpo_core.preflight import check_rendezvous_host

        check_rendezvous_host(cfg)
        log.info(
            "trainer host 0 of %d: waiting up to %d s (train.rdzv_timeout_s) at %s for trainer hosts 1..%d; on "
            "each run %s with its --node-rank and a copy of %s (docs/across-hosts.md)",
            cfg.train.nnodes,
            cfg.train.rdzv_timeout_s,
            cfg.train.rdzv_endpoint,
            cfg.train.nnodes - 1,
            " ".join(trainer_command(cfg, Path(TRAIN_CONFIG), server_urls, node_rank=1)[1:]),
            config_path,
        )
    env = _child_env(run_dir, secret_values(sub))
    if cfg.train.gpu_ids is not None:  # e.g. vLLM on GPU 0, the trainer on GPU 1 (NCCL weight transfer)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.train.gpu_ids[: cfg.train.num_ranks]))
    progress = artifacts.TrainingProgress(root / layout.METRICS, cfg.train.max_steps)
    progress.start()
    try:
        code, tail = stream(cmd, log, "[trainer] ", env, pid_file=root / layout.TRAINER_PID, register=REGISTRY[run_dir])
    finally:
        progress.stop()
    failure, failure_log = REGISTRY[run_dir].failure, REGISTRY[run_dir].failure_log
    if code != 0 and failure:
        from grpo_core.run.children import log_tail

        raise ChildDiedError(
            f"{failure}; the trainer was stopped (exit code {code})"
            + (f"; log {failure_log}:\n{log_tail(failure_log)}" if failure_log else "")
        )
    if code != 0:
        cause = read_trainer_error(root)
        causes = re.findall(r"^rank \d+: ([\w.]+):", cause, flags=re.M)  # `rank R: Type: message` per rank
        raise TrainerError(
            f"trainer exited with code {code}" + (f": {cause}" if cause else "") + f"\nlast output:\n{tail}", causes
        )
    return str(latest_checkpoint(root))


@task(name="finalize", cache_policy=NO_CACHE, persist_result=False)
def finalize(run_dir: str, mlflow_run_id: str | None, wall_s: float) -> dict:
    """Reward curve, summary, model card; the exported model to MLflow (a registered version with the alias)
    and to the Hub (``export.push_to_hub``); summary and reward-curve artifacts. Returns the summary (JSON-able).
    """
    from grpo_core import hub, report
    from grpo_core.train.checkpoint import latest_checkpoint
    from grpo_core.train.export import FINAL_MODEL_DIR

    cfg, root, log = _config(run_dir), Path(run_dir), get_run_logger()
    png = report.plot_reward_curve(root / layout.METRICS, root / layout.REWARD_CURVE)
    summary = {
        **report.summarize(root / layout.METRICS, wall_s),
        "run_dir": run_dir,
        "checkpoint": str(latest_checkpoint(root)),
        "reward_curve": str(png) if png else None,
        "mlflow_run_id": mlflow_run_id,
        "mlflow_uri": cfg.tracking.shown_tracking_uri(),
    }
    model_dir = root / FINAL_MODEL_DIR
    adapter = cfg.train.lora.enabled
    if model_dir.is_dir():
        hub.write_model_card(cfg, model_dir, summary, png, adapter=adapter)
        summary["model"] = str(model_dir)
    status = "FAILED"
    try:
        if mlflow_run_id:
            summary.update(_track_final(cfg, mlflow_run_id, png, model_dir if model_dir.is_dir() else None, summary))
        if cfg.export.push_to_hub and model_dir.is_dir():
            summary["hub_commit"] = hub.push_to_hub(cfg, model_dir)
        status = "FINISHED"
    finally:
        if mlflow_run_id:
            from grpo_core import tracking

            tracking.end_run(cfg.tracking, mlflow_run_id, status)
    artifacts.publish_summary(summary)
    artifacts.publish_reward_curve(png, summary)
    log.info("summary: %s", summary)
    if summary.get("stopped_early"):
        log.warning(
            "trained %s of %s steps: %s", summary["steps"], summary["steps_requested"], summary["stopped_early"]
        )
    return summary


def _track_final(cfg: RunConfig, run_id: str, png: Path | None, model_dir: Path | None, summary: dict) -> dict:
    """Reward curve and exported model to the MLflow run; a registered version when configured."""
    from grpo_core import tracking

    tc, out = cfg.tracking, {}
    if png is not None:
        tracking.log_file(tc, run_id, png, "plots")
    if tc.log_model and model_dir is not None:
        source = tracking.log_model(tc, run_id, model_dir, adapter=cfg.train.lora.enabled)
        if tc.registered_model_name:
            version = tracking.register_model(
                tc,
                run_id,
                source,
                description=f"{summary.get('steps', 0):.0f} steps; reward of the last five steps "
                f"{summary.get('reward_last5', float('nan')):.4f}",
            )
            out["registered_model"] = f"{tc.registered_model_name} v{version.version} @{tc.registered_model_alias}"
    return out


def retry_can_cure(exc: BaseException) -> bool:
    """Whether a flow retry may cure ``exc`` (the flow's retry condition; Prefect's ``retry_condition_fn`` is for
    tasks only). No when it is deterministic (``grpo_core.errors.is_deterministic``: bad config, a resume refused,
    nothing to train, user code that raises, ...) or a child process recorded such an error as its cause; yes for
    the rest: a process killed, a server or the network gone, a timeout, a held run lock."""
    from grpo_core.errors import is_deterministic

    causes = getattr(exc, "causes", None)
    if causes:
        return not any(is_deterministic(name) for name in causes)
    return not is_deterministic(exc)


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
    start, rollout_run = time.monotonic(), None
    try:
        with _sigterm_raises(), gpu_slots(config):
            urls = provision_servers.with_options(retries=config.server.start_retries)(run_dir)
            (Path(run_dir) / LOCATION_FILE).unlink(missing_ok=True)  # a retried flow run's old location
            rollout_run = rollout.submit(run_dir, urls, run["resume_state"])
            train(run_dir, urls, _await_location(run_dir, rollout_run))
            rollout_run.result()  # the trainer shut the rollout down: its exit decides the task's state
    except BaseException:
        if mlflow_run_id:
            from grpo_core import tracking

            tracking.end_run(_config(run_dir).tracking, mlflow_run_id, "FAILED")
        raise
    finally:
        _stop(run_dir)
        if rollout_run is not None:
            rollout_run.wait(timeout=60)  # its state turns final (Cancelled when stopped here)
    return finalize(run_dir, mlflow_run_id, time.monotonic() - start)


def run_slots(config: RunConfig) -> int:
    """Slots of ``flow.concurrency_limit`` a run holds: ``flow.concurrency_slots``, else the GPUs it uses (the
    servers' and the trainer's, counted once)."""
    if config.flow.concurrency_slots is not None:
        return config.flow.concurrency_slots
    if not config.server.starts_here():  # the servers run elsewhere: only the trainer's ranks here
        return config.train.num_ranks
    from grpo_core.serving.vllm import choose_backend, replica_gpus

    if choose_backend(config) != "vllm":
        return 1
    servers = {g for replica in range(config.server.num_replicas) for g in replica_gpus(config, replica)}
    ranks = config.train.gpu_ids[: config.train.num_ranks] if config.train.gpu_ids else range(config.train.num_ranks)
    return len(servers | set(ranks))


@contextlib.contextmanager
def gpu_slots(config: RunConfig) -> Iterator[None]:
    """Hold ``run_slots(config)`` slots of the global concurrency limit ``flow.concurrency_limit`` (waiting for
    them); a limit the server does not have is not waited for (e.g. ``grpo train`` on the embedded API).

    Raises:
        ConfigError: the run needs more slots than the limit has (it would wait forever).
    """
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectNotFound

    from grpo_core.errors import ConfigError

    name, log = config.flow.concurrency_limit, get_run_logger()
    if name is None:
        yield
        return
    try:
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
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
    hold = functools.partial(concurrency, name, occupy=slots, strict=True, raise_on_lease_renewal_failure=False)
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
