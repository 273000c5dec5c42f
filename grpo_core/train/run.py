"""Wire one trainer process: world, sample source, weight sync, metrics sink."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.distributed as dist

from grpo_core.config import TrainerProcessConfig
from grpo_core.errors import ConfigError, ServerStartError
from grpo_core.models import resolve_model_dir
from grpo_core.run import startup
from grpo_core.run.layout import METRICS
from grpo_core.run.run_lock import RunLock
from grpo_core.tracking.metrics import JsonlSink, MetricsSink
from grpo_core.transport.file_source import ArrowFileSource
from grpo_core.transport.types import ResumeState, SampleSource

from .distributed import World, check_members, check_same_config, check_shared_folder, init_world
from .fingerprint import check_resume
from .trainer import Trainer, rotate_checkpoints
from .weight_sync import DiskFullWeightSync, LoraAdapterSync, NoWeightSync, WeightSync
from .weight_sync.adapter_store import AdapterStore

logger = logging.getLogger(__name__)


def server_backend(url: str, api_key: str | None = None) -> str:
    """``embedded`` or ``vllm``: the embedded server says so in ``/server_info`` (``api_key``: bearer token)."""
    import httpx

    from grpo_core.security.auth import ROLE_CONTROL, bearer_headers, role_key, tls_files
    from grpo_core.serving.limits import client_ssl_context
    from grpo_core.serving.protocol import SERVER_INFO_PATH

    try:
        headers, verify = (
            bearer_headers(api_key or role_key(ROLE_CONTROL)),
            client_ssl_context(tls_files()[2]),
        )  # tls.ca_file
        info = httpx.get(url + SERVER_INFO_PATH, headers=headers, timeout=30, verify=verify).json()
    except (httpx.HTTPError, ValueError) as e:
        raise ConfigError(f"--server-url {url}: /server_info did not answer ({e}); is the server up?") from None
    return "embedded" if info.get("backend") == "embedded" else "vllm"


def make_weight_sync(cfg: TrainerProcessConfig, server_urls: list[str]) -> WeightSync:
    """The weight sync for the servers: LoRA adapters (either server), full weights through a
    folder (embedded server) or vLLM's weight transfer (``server.weight_transfer_backend``)."""
    if not server_urls:
        return NoWeightSync()
    tc = cfg.train
    model_dir = resolve_model_dir(cfg.model)
    if tc.lora.enabled:
        store = AdapterStore(tc.adapter_store, tc.adapter_store_served_as, timeout_s=cfg.server.control_timeout_s)
        return LoraAdapterSync(
            server_urls,
            tc.output_dir,
            tc.lora.name,
            cfg.rollout.max_staleness,
            model_dir=model_dir,
            server=cfg.server,
            store=store,
        )
    api_key = cfg.server.resolved_api_key()
    kinds = {server_backend(u, api_key) for u in server_urls}
    if kinds == {"embedded"}:
        return DiskFullWeightSync(
            server_urls, tc.output_dir, keep=cfg.rollout.max_staleness + 1, model_dir=model_dir, server=cfg.server
        )
    if kinds != {"vllm"}:
        raise ConfigError("--server-url mixes vLLM and embedded servers; use one kind per run")
    if cfg.server.weight_transfer_backend is None:
        raise ConfigError("server.weight_transfer_backend is None: vLLM servers need 'ipc' (same GPU) or 'nccl'")
    from .weight_sync.vllm import VllmWeightTransferSync

    return VllmWeightTransferSync(
        server_urls,
        cfg.server.weight_transfer_backend,
        lora_names=tc.lora.enabled,
        model_dir=model_dir,
        api_key=api_key,
        control_retry_s=cfg.server.control_retry_s,
        control_timeout_s=cfg.server.control_timeout_s,
    )


def make_source(cfg: TrainerProcessConfig, resume: ResumeState | None) -> SampleSource:
    """The sample source: an Arrow IPC file (offline) or the rollout process's Flight server."""
    tc = cfg.train
    if tc.samples_path is not None:
        return ArrowFileSource(tc.samples_path, max_staleness=cfg.rollout.max_staleness, resume=resume)
    if tc.rollout_location is None:
        raise ConfigError("train.samples_path or train.rollout_location must be set: the trainer needs samples")
    from grpo_core.transport.flight_client import FlightSource

    return FlightSource(
        tc.rollout_location, max_staleness=cfg.rollout.max_staleness, timeout_s=cfg.rollout.rollout_worker_timeout_s
    )


class DeferredSource:
    """The sample source of a trainer built before the rollout serves (``train.inputs_path``): it hands every call to
    ``inner``, set once the rollout's location is known; nothing pulls before (the trainer builds and compiles)."""

    def __init__(self) -> None:
        self.inner: SampleSource | None = None

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(f"{name}: the sample source is not connected yet (the rollout has not served)")
        return getattr(inner, name)


def await_inputs(cfg: TrainerProcessConfig, world: World) -> tuple[list[str], str]:
    """The servers' URLs and the rollout's location, once the flow wrote them to ``train.inputs_path`` (rank 0 reads,
    every rank gets them; the wait is cut in slices so no collective waits near its timeout).

    Raises:
        ServerStartError: the file did not come within ``train.inputs_timeout_s`` (the flow stops the trainer
            sooner when a server fails to start: this ends a trainer left waiting).
    """
    tc = cfg.train
    assert tc.inputs_path is not None
    deadline = time.monotonic() + tc.inputs_timeout_s
    while True:
        payload: list[Any] = [None]
        if world.is_main:
            got = startup.wait_inputs(tc.inputs_path, min(30.0, max(deadline - time.monotonic(), 0.0)))
            payload = [got if got is not None else ("late" if time.monotonic() >= deadline else None)]
        if world.world_size > 1:
            dist.broadcast_object_list(payload, src=0, group=world.control)
        if payload[0] == "late":
            raise ServerStartError(
                f"the generation servers and the rollout process were not up after {tc.inputs_timeout_s:.0f} s "
                f"(train.inputs_timeout_s): {tc.inputs_path} never came; the run's log names the server or process "
                "that did not start"
            )
        if payload[0] is not None:
            urls, location = payload[0]
            return list(urls), str(location)


def run_trainer(
    cfg: TrainerProcessConfig, server_urls: list[str] | None = None, sink: MetricsSink | None = None
) -> ResumeState | None:
    """Train per ``cfg`` (the trainer's sub-config, ``RunConfig.trainer_process()``) on this process's rank;
    returns the final resume state on rank 0.

    Rank 0 holds the run folder's lock (:class:`grpo_core.run.run_lock.RunLock`) until it returns. A resume
    compares the config with the checkpoint's fingerprint first (:func:`~grpo_core.train.fingerprint.check_resume`).

    Raises:
        RunLockedError: (rank 0) another process still writes ``train.output_dir`` after
            ``train.run_lock_timeout_s``.
        ConfigError: the config trains a different run than the checkpoint it would resume (a diff).
    """
    world = init_world(cfg.train.device)
    if cfg.train.nnodes > 1:  # torchrun's rendezvous has no authentication: prove the token before any data moves
        from grpo_core.security.auth import ROLE_MEMBER, role_key

        check_members(world, role_key(ROLE_MEMBER))
        # what rank 0 alone reads (tracking, the servers, the export, the sample source) or each host sets for its
        # own GPUs and mounts may differ (the output folder is checked by what each rank sees in it, below);
        # everything that shapes a rank's step must not
        check_same_config(
            world,
            cfg.model_dump(
                mode="json",
                exclude={
                    "tracking": True,
                    "server": True,
                    "export": True,
                    "train": {"rollout_location", "samples_path", "gpu_ids", "rdzv_timeout_s", "output_dir"},
                },
            ),
        )
        # every rank writes its checkpoint shards there
        check_shared_folder(world, cfg.train.output_dir, cfg.train.shared_folder_wait_s)
    lock = RunLock(cfg.train.output_dir, "trainer", cfg.train.run_lock_timeout_s) if world.is_main else None
    try:
        from . import checkpoint

        if lock is not None:
            lock.acquire()
        latest = checkpoint.latest_checkpoint(cfg.train.output_dir)
        resume = checkpoint.read_state(latest) if latest is not None else None
        if latest is not None:
            check_resume(cfg, latest)
        if world.is_main:
            checkpoint.truncate_step_logs(cfg.train.output_dir, resume.step if resume else 0)
        early = cfg.train.inputs_path is not None  # started before the servers: they come after the compile
        source = (DeferredSource() if early else make_source(cfg, resume)) if world.is_main else None
        if sink is None and world.is_main:
            sink = JsonlSink(cfg.train.output_dir / METRICS)
            if cfg.tracking.enabled and cfg.tracking.run_id:
                from grpo_core.tracking import MlflowSink

                sink = MlflowSink(cfg.tracking, cfg.tracking.run_id, inner=sink, trained=JsonlSink.read(sink.path))
        trainer = Trainer(cfg, world, source, None if early else make_weight_sync(cfg, server_urls or []), sink)
        if early:
            trainer.warmup()  # compiled while the servers start
            server_urls, cfg.train.rollout_location = await_inputs(cfg, world)
            if isinstance(source, DeferredSource):
                source.inner = make_source(cfg, resume)
            trainer.weight_sync = make_weight_sync(cfg, server_urls)
            if world.is_main:
                startup.mark(cfg.train.output_dir, "inputs_ready", "trainer")
        state = trainer.run()
        if source is not None:
            source.close()
        if world.world_size > 1:  # leave together: no rank tears its process group down under a peer still exporting
            dist.barrier(group=world.control)
        return state
    finally:
        if sink is not None:
            sink.close()
            if world.is_main and cfg.train.save_total_limit is not None:  # uploads done: what they held may go now
                rotate_checkpoints(cfg.train.output_dir, cfg.train.save_total_limit, None, sink)
        if dist.is_initialized():
            dist.destroy_process_group()
        if lock is not None:
            lock.release()
