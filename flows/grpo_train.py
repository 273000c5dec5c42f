"""The ``grpo-train`` flow: provision servers → rollout process → trainer (torchrun), torn down in ``finally``.

Thin by design: every step calls ``grpo_core``; tasks get references (the run folder, URLs, the
MLflow run id), never payloads, and no task caches (the config is not hashed). Each flow run
works in ``<train.output_dir>/<flow run id>/``; a retry of the same flow run (flow retries, or
Retry in the UI) finds that folder, or the checkpoint in its MLflow run, and resumes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from prefect import flow, get_run_logger, runtime, task
from prefect.cache_policies import NO_CACHE

from flows.processes import REGISTRY, log_tail, setup_logging, stream, wait_for_file
from grpo_core.config import RunConfig

RESOLVED_CONFIG = "run_config.json"


class TrainerError(RuntimeError):
    """The trainer process failed; the message holds the tail of its output."""


def _config(run_dir: str) -> RunConfig:
    return RunConfig.model_validate_json((Path(run_dir) / RESOLVED_CONFIG).read_text())


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@task(name="prepare", cache_policy=NO_CACHE, persist_result=False)
def prepare(config: RunConfig, flow_run_id: str, deployment: str | None) -> dict:
    """Check the config (imports, dataset columns), lay out the run folder, open the MLflow run, fetch a checkpoint.

    Returns:
        ``{"run_dir", "mlflow_run_id", "resume_state"}`` (paths as strings; resume_state None = fresh start).
    """
    from grpo_core import preflight
    from grpo_core.train.checkpoint import STATE_FILE, latest_checkpoint

    log = get_run_logger()
    preflight.check_run(config)
    run_dir = (config.train.output_dir / flow_run_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = config.model_copy(deep=True)
    cfg.train.output_dir = run_dir
    cfg.server.log_dir = run_dir / "servers"
    mlflow_run_id = None
    if cfg.tracking.enabled:
        from grpo_core import tracking

        mlflow_run_id, continued = tracking.start_run(cfg, flow_run_id, deployment, run_name=runtime.flow_run.name)
        cfg.tracking.run_id = mlflow_run_id
        source = mlflow_run_id if continued else cfg.resume_from
        if latest_checkpoint(run_dir) is None and source:
            tracking.download_latest_checkpoint(cfg.tracking, source, run_dir)
    (run_dir / RESOLVED_CONFIG).write_text(cfg.model_dump_json(indent=1))
    latest = latest_checkpoint(run_dir)
    if latest is not None:
        log.info("resuming from checkpoint %s", latest)
    log.info("run folder %s, MLflow run %s", run_dir, mlflow_run_id)
    return {"run_dir": str(run_dir), "mlflow_run_id": mlflow_run_id,
            "resume_state": str(latest / STATE_FILE) if latest is not None else None}


@task(name="provision_servers", cache_policy=NO_CACHE, persist_result=False)
def provision_servers(run_dir: str) -> list[str]:
    """Start the generation server replicas (vLLM on GPUs, else embedded); returns their URLs."""
    from grpo_core.serving.vllm import choose_backend, provision

    log, procs, cfg = get_run_logger(), REGISTRY[run_dir], _config(run_dir)
    backend = choose_backend(cfg)
    for i in range(cfg.server.num_replicas):
        procs.follow(cfg.server.log_dir / f"{backend}-replica{i}.log", log, f"[server {i}] ")
    handles = provision(cfg)
    procs.servers.extend(handles)
    return [h.url for h in handles]


@task(name="rollout", cache_policy=NO_CACHE, persist_result=False)
def start_rollout(run_dir: str, server_urls: list[str], resume_state: str | None) -> str:
    """Start the long-running rollout process; returns its Arrow Flight location once it serves."""
    import subprocess

    log, procs, root = get_run_logger(), REGISTRY[run_dir], Path(run_dir)
    location_file, error_file, log_file = root / "rollout.location", root / "rollout_error.txt", root / "rollout.log"
    location_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "grpo_core.rollout", "--config", str(root / RESOLVED_CONFIG),
           "--location-file", str(location_file), "--error-path", str(error_file)]
    cmd += [arg for url in server_urls for arg in ("--server-url", url)]
    if resume_state:
        cmd += ["--resume", resume_state]
    procs.follow(log_file, log, "[rollout] ")
    with log_file.open("ab") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=_child_env(), start_new_session=True)
    procs.processes.append(process)
    try:
        location = wait_for_file(location_file, process, timeout_s=600)
    except RuntimeError as exc:
        raise RuntimeError(f"rollout process {exc}; log {log_file}:\n{log_tail(log_file)}") from None
    log.info("rollout process %d serves samples at %s", process.pid, location)
    return location


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def train(run_dir: str, server_urls: list[str], rollout_location: str) -> str:
    """Run the trainer under torchrun until ``train.max_steps``; returns the latest checkpoint folder.

    Raises:
        TrainerError: torchrun exited non-zero (the message holds its output's tail, with the traceback).
    """
    from grpo_core.report import TRAINER_ERROR, read_trainer_error
    from grpo_core.train.checkpoint import latest_checkpoint

    log, root = get_run_logger(), Path(run_dir)
    cfg = _config(run_dir)
    cfg.train.rollout_location = rollout_location
    (root / TRAINER_ERROR).unlink(missing_ok=True)
    config_path = root / "train_config.json"
    config_path.write_text(cfg.model_dump_json(indent=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(cfg.train.num_ranks), "-m", "grpo_core.train", "--config", str(config_path)]
    cmd += [arg for url in server_urls for arg in ("--server-url", url)]
    env = _child_env()
    if cfg.train.gpu_ids is not None:  # e.g. vLLM on GPU 0, the trainer on GPU 1 (NCCL weight transfer)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.train.gpu_ids[:cfg.train.num_ranks]))
    code, tail = stream(cmd, log, "[trainer] ", env, pid_file=root / "trainer.pid",
                        register=REGISTRY[run_dir])
    if code != 0:
        cause = read_trainer_error(root)
        raise TrainerError(f"trainer exited with code {code}" + (f": {cause}" if cause else "")
                           + f"\nlast output:\n{tail}")
    return str(latest_checkpoint(root))


@task(name="finalize", cache_policy=NO_CACHE, persist_result=False)
def finalize(run_dir: str, mlflow_run_id: str | None, wall_s: float) -> dict:
    """Reward curve, summary, final model to MLflow; returns the summary (JSON-able)."""
    from grpo_core import report
    from grpo_core.train.checkpoint import latest_checkpoint

    cfg, root = _config(run_dir), Path(run_dir)
    png = report.plot_reward_curve(root / "metrics.jsonl", root / "reward_curve.png")
    summary = {**report.summarize(root / "metrics.jsonl", wall_s), "run_dir": run_dir,
               "checkpoint": str(latest_checkpoint(root)), "reward_curve": str(png) if png else None,
               "mlflow_run_id": mlflow_run_id, "mlflow_uri": cfg.tracking.resolved_tracking_uri()}
    if mlflow_run_id:
        from grpo_core import tracking

        if png is not None:
            tracking.log_file(cfg.tracking, mlflow_run_id, png, "plots")
        model_dir = _final_model_dir(cfg, root)
        if cfg.tracking.log_model and model_dir is not None:
            tracking.log_model(cfg.tracking, mlflow_run_id, model_dir, adapter=cfg.train.lora.enabled)
        tracking.end_run(cfg.tracking, mlflow_run_id, "FINISHED")
    get_run_logger().info("summary: %s", summary)
    if summary.get("stopped_early"):
        get_run_logger().warning("trained %s of %s steps: %s", summary["steps"], summary["steps_requested"],
                                 summary["stopped_early"])
    return summary


def _final_model_dir(cfg: RunConfig, root: Path) -> Path | None:
    """A loadable HF folder of the last synced weights (or the last LoRA adapter); None if none was synced."""
    from grpo_core.models import resolve_model_dir
    from grpo_core.text_model import write_trained_checkpoint

    if cfg.train.lora.enabled:
        adapters = sorted((root / ".vllm_lora").glob(f"{cfg.train.lora.name}-v*"),
                          key=lambda p: int(p.name.rsplit("v", 1)[1]))
        return adapters[-1] if adapters else None
    versions = sorted((p for p in (root / ".weights").glob("v*") if p.name[1:].isdigit()),
                      key=lambda p: int(p.name[1:]))
    if not versions:
        return None
    return write_trained_checkpoint(resolve_model_dir(cfg.model), versions[-1] / "model.safetensors",
                                    root / "final_model")


@contextlib.contextmanager
def _sigterm_raises():
    """Turn SIGTERM (cancellation by the worker) into an exception so ``finally`` stops every process."""
    def handler(signum, frame):  # noqa: ANN001, ARG001
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
    """
    setup_logging()
    flow_run_id = str(runtime.flow_run.id or f"local-{int(time.time())}")
    deployment = runtime.deployment.name
    run = prepare(config, flow_run_id, deployment)
    run_dir, mlflow_run_id = run["run_dir"], run["mlflow_run_id"]
    start = time.monotonic()
    try:
        with _sigterm_raises():
            urls = provision_servers(run_dir)
            location = start_rollout(run_dir, urls, run["resume_state"])
            train(run_dir, urls, location)
    except BaseException:
        if mlflow_run_id:
            from grpo_core import tracking

            tracking.end_run(_config(run_dir).tracking, mlflow_run_id, "FAILED")
        raise
    finally:
        _stop(run_dir)
    return finalize(run_dir, mlflow_run_id, time.monotonic() - start)


def _stop(run_dir: str) -> None:
    procs = REGISTRY.pop(run_dir, None)
    if procs is not None:
        procs.stop_all()
