"""Wire one trainer process: world, sample source, weight sync, metrics sink."""

from __future__ import annotations

import logging

import torch.distributed as dist

from grpo_core.config import RunConfig
from grpo_core.errors import ConfigError
from grpo_core.metrics import JsonlSink
from grpo_core.transport import ResumeState

from .distributed import init_world
from .source import ArrowFileSource
from .trainer import Trainer
from .weight_sync import DiskFullWeightSync, LoraAdapterSync, NoWeightSync

logger = logging.getLogger(__name__)


def make_weight_sync(cfg: RunConfig, server_urls: list[str]):
    """The weight sync matching the config: LoRA adapters, full weights via disk, or none."""
    if not server_urls:
        return NoWeightSync()
    tc = cfg.train
    if tc.lora.enabled:
        return LoraAdapterSync(server_urls, tc.output_dir, tc.lora.name, cfg.rollout.max_staleness)
    return DiskFullWeightSync(server_urls, tc.output_dir, keep=cfg.rollout.max_staleness + 1)


def make_source(cfg: RunConfig, resume: ResumeState | None):
    """The sample source: an Arrow IPC file (offline) or the rollout process's Flight server."""
    tc = cfg.train
    if tc.samples_path is not None:
        return ArrowFileSource(tc.samples_path, max_staleness=cfg.rollout.max_staleness, resume=resume)
    if tc.rollout_location is None:
        raise ConfigError("train.samples_path or train.rollout_location must be set: the trainer needs samples")
    from grpo_core.transport_flight import FlightSource  # noqa: PLC0415 - only with a rollout process

    return FlightSource(tc.rollout_location, max_staleness=cfg.rollout.max_staleness,
                        timeout_s=cfg.rollout.rollout_worker_timeout_s)


def run_trainer(cfg: RunConfig, server_urls: list[str] | None = None, sink=None) -> ResumeState | None:
    """Train per ``cfg`` on this process's rank; returns the final resume state on rank 0."""
    world = init_world(cfg.train.device)
    try:
        from . import checkpoint

        latest = checkpoint.latest_checkpoint(cfg.train.output_dir)
        resume = checkpoint.read_state(latest) if latest is not None else None
        if world.is_main:
            cfg.train.output_dir.mkdir(parents=True, exist_ok=True)
            checkpoint.truncate_step_logs(cfg.train.output_dir, resume.step if resume else 0)
        source = make_source(cfg, resume) if world.is_main else None
        if sink is None and world.is_main:
            sink = JsonlSink(cfg.train.output_dir / "metrics.jsonl")
            if cfg.tracking.enabled and cfg.tracking.run_id:
                from grpo_core.tracking import MlflowSink  # noqa: PLC0415 - mlflow only when tracking

                sink = MlflowSink(cfg.tracking, cfg.tracking.run_id, inner=sink)
        trainer = Trainer(cfg, world, source, make_weight_sync(cfg, server_urls or []), sink)
        state = trainer.run()
        if source is not None:
            source.close()
        return state
    finally:
        if sink is not None:
            sink.close()
        if dist.is_initialized():
            dist.destroy_process_group()
