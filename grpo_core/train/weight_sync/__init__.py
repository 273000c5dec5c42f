"""Weight sync from the trainer to the generation servers, every ``weight_sync_steps``.

Each sync makes one new policy version. Implementations:

* :class:`DiskFullWeightSync`: full weights as a checkpoint-format folder
  (safetensors, the served checkpoint's tensor names) read by the embedded server's
  ``/start_weight_update → /update_weights {"path"} → /finish_weight_update``.
* :class:`LoraAdapterSync`: a PEFT adapter saved with ``PeftModel.save_pretrained`` to
  ``<output_dir>/.vllm_lora/<name>-v{N}`` (atomic rename), published to ``train.adapter_store``
  when set (a folder or fsspec URL every server host can read, :mod:`.adapter_store`), loaded on every
  server with ``/v1/load_lora_adapter``; the newest ``max_staleness + 1``
  versions stay loaded, older ones are unloaded and deleted (a rollout group that outlives its
  version is stale by then: the rollout drops it, ``rollout/stale_group_count``). vLLM and the
  embedded server take the same requests. Adapter keys use the served
  checkpoint's module names (see :meth:`LoraAdapterSync.checkpoint_keys`).

Several servers: all or nothing (``ReplicaSet.fan_out``): each server is retried every
``server.control_retry_s`` until ``server.control_timeout_s`` (an adapter on shared storage may
reach a server host late); if one still fails, the new version is removed again from the servers
that took it (adapters are unloaded; full weights are restored from the previous version's folder)
and the error is raised. Full weights: every server is paused first (all or nothing), then updated,
then resumed, whatever failed. vLLM's full weights (:mod:`.vllm`) cannot be restored and are
fenced off instead. ``sync`` is collective: every rank
calls it (gathering a full state dict needs all ranks); rank 0 talks to servers.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors.torch import save_file

from grpo_core.config import ADAPTER_DIR, WEIGHTS_DIR, ServerConfig, TrainerServerView
from grpo_core.errors import ServingError

from ..export import publish, save_adapter
from .adapter_store import AdapterStore

if TYPE_CHECKING:
    from grpo_core.serving.client import GenerationClient
    from grpo_core.serving.replicas import ReplicaSet

    from ..policy import Policy


logger = logging.getLogger(__name__)


class WeightSync(Protocol):
    """Pushes the trainer's weights to the servers as policy version ``version``."""

    def sync(self, policy: Policy, version: int, rank: int) -> dict[str, float]:
        """Collective; returns ``perf/weight_sync_*`` timings in seconds (rank 0)."""
        ...


class NoWeightSync:
    """For offline training (no servers)."""

    def sync(self, policy: Policy, version: int, rank: int) -> dict[str, float]:  # noqa: ARG002 - WeightSync's
        """Nothing to do."""
        return {}


def full_state_dict(policy: Policy) -> dict[str, torch.Tensor]:
    """The policy's full, unsharded state dict on CPU (collective), HF parameter names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("lm."): v for k, v in sd.items()}


def untied(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop later names of tensors sharing storage (tied embeddings): safetensors stores each once,
    and loaders re-tie them from the model config."""
    seen, out = set(), {}
    for k, v in state_dict.items():
        if v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        out[k] = v.contiguous()
    return out


class _Servers:
    """Rank-0 helper: control calls on every server, all or nothing (``ReplicaSet.fan_out``).

    Args:
        urls: the servers' base URLs.
        server: the server settings whose bearer token and control retry settings apply (the trainer's
            ``TrainerProcessConfig.server``, or a ``ServerConfig``); None = defaults.
        timeout_s: per-request timeout in seconds.
    """

    def __init__(
        self, urls: list[str], server: TrainerServerView | ServerConfig | None = None, timeout_s: float = 600.0
    ):
        self.urls = urls
        self.server = server or ServerConfig()
        self.timeout_s = timeout_s

    def run(self, work: Callable[[ReplicaSet], Awaitable[None]]) -> None:
        """``await work(replica_set)`` over the servers (a ``ReplicaSet`` with the server settings)."""
        from grpo_core.serving.replicas import ReplicaSet

        async def run_all() -> None:
            async with ReplicaSet.from_config(
                self.server, self.urls, max_connections=4, timeout_s=self.timeout_s
            ) as rs:
                await work(rs)

        asyncio.run(run_all())

    def fan_out(
        self,
        name: str,
        call: Callable[[GenerationClient], Awaitable[Any]],
        undo: Callable[[GenerationClient], Awaitable[Any]] | None = None,
        reads_storage: bool = False,
    ) -> None:
        """``await call(client)`` on every server; on a failure ``undo`` where it succeeded (``reads_storage``: the
        call loads files from shared storage, so its 400s are retried; ``ReplicaSet.fan_out``).

        Raises:
            ControlFanOutError: a server kept failing ``call`` (a ``ServingError``).
        """
        self.run(lambda rs: rs.fan_out(name, call, undo, reads_storage))


class DiskFullWeightSync:
    """Full weights through a shared folder (embedded server). See module docs."""

    def __init__(
        self,
        urls: list[str],
        output_dir: Path,
        keep: int = 2,
        model_dir: str | Path | None = None,
        server: TrainerServerView | ServerConfig | None = None,
    ):
        self.servers = _Servers(urls, server)
        self.root = Path(output_dir) / WEIGHTS_DIR
        self.keep = max(keep, 2)
        self.model_dir = model_dir
        self.name_map: dict[str, str] | None = None

    def sync(self, policy: Policy, version: int, rank: int) -> dict[str, float]:
        """Gather, write ``v{version}``, then pause every server, update every one, resume every one.

        Each phase is a fan-out, all or nothing: a refused pause resumes the servers paused and fails the sync;
        an update refused somewhere (the embedded server checks every tensor before it changes one, so that
        server keeps its weights) restores the previous version on the servers that took it, then fails it. Every
        paused server is resumed, whatever failed.

        Raises:
            ControlFanOutError: a server kept refusing the pause or the update (named), or the resume.
        """
        t0 = time.perf_counter()
        sd = full_state_dict(policy)
        if rank != 0:
            return {}
        t1 = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if self.model_dir is not None and self.name_map is None:
            from grpo_core.models.text_model import checkpoint_name_map

            self.name_map = checkpoint_name_map(policy.base(), self.model_dir)
        sd = {self.name_map.get(k, k): v for k, v in sd.items()} if self.name_map else sd
        save_file(untied(sd), tmp / "model.safetensors", metadata={"format": "pt"})
        folder = publish(tmp, self.root / f"v{version}")
        t2 = time.perf_counter()
        previous = self.root / f"v{version - 1}"
        undo = (lambda c: c.update_weights_from_path(str(previous))) if previous.exists() else None

        self.servers.run(lambda rs: self.phases(rs, str(folder), version, undo))
        self._prune(version)
        return {
            "perf/weight_sync_gather_s": t1 - t0,
            "perf/weight_sync_write_s": t2 - t1,
            "perf/weight_sync_load_s": time.perf_counter() - t2,
        }

    @staticmethod
    async def phases(rs: Any, folder: str, version: int, undo: Any = None) -> None:
        """Pause every server of ``rs`` (a ``ReplicaSet``; keep mode: requests in flight wait), update each from
        ``folder`` (policy version ``version``), lower every fence naming the version (``POST /grpo/stale``),
        resume each; every phase all or nothing, and every paused server resumed whatever failed.
        ``undo(client)`` restores a server that took the update when another refused it (None = nothing to restore).

        Raises:
            ControlFanOutError: a server kept refusing the pause, the update or the resume (named).
        """
        label = f"v{version}"
        await rs.fan_out(f"pause for weight sync {label}", lambda c: c.pause(), undo=lambda c: c.resume())
        try:
            await rs.fan_out(
                f"weight sync {label}", lambda c: c.update_weights_from_path(folder), undo, reads_storage=True
            )
            # every server holds this version now: a fence raised on one (started again with the base weights by
            # the servers' flow, or by an earlier trainer) comes down
            await rs.fan_out(f"lift fences after weight sync {label}", lambda c: c.set_stale(False, version=version))
        finally:  # never leave a server paused (a failed resume is raised, with the update's error as context)
            await rs.fan_out(f"resume after weight sync {label}", lambda c: c.resume())

    def _prune(self, version: int) -> None:
        for p in self.root.glob("v*"):
            if p.suffix != ".tmp" and p.name[1:].isdigit() and int(p.name[1:]) <= version - self.keep:
                shutil.rmtree(p, ignore_errors=True)


class LoraAdapterSync:
    """PEFT adapter versions on every server. See module docs."""

    def __init__(
        self,
        urls: list[str],
        output_dir: Path,
        name: str,
        max_staleness: int,
        model_dir: str | Path | None = None,
        server: TrainerServerView | ServerConfig | None = None,
        store: AdapterStore | None = None,
    ):
        self.servers = _Servers(urls, server)
        self.store = store if store is not None else AdapterStore(None)
        self.root = Path(output_dir) / ADAPTER_DIR
        self.name = name
        self.keep = max_staleness + 1
        self.loaded: list[int] = []
        self.model_dir = model_dir
        self.name_map: dict[str, str] | None = None

    def checkpoint_keys(self, lm: torch.nn.Module, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Adapter keys under the served checkpoint's module names (Qwen3.5: ``model.language_model.…``),
        which vLLM's LoRA loader maps like the checkpoint, and PEFT maps back when it loads the adapter
        into transformers' renamed model (the embedded server)."""
        if self.model_dir is None:
            return adapter
        from grpo_core.models.text_model import checkpoint_name_map, rename_module_key

        if self.name_map is None:
            self.name_map = checkpoint_name_map(lm.get_base_model(), self.model_dir)
        prefix = "base_model.model."
        return {prefix + rename_module_key(k.removeprefix(prefix), self.name_map): v for k, v in adapter.items()}

    def adapter_name(self, version: int) -> str:
        """Served model name of a version: ``{name}-v{version}``."""
        return f"{self.name}-v{version}"

    def save_adapter(self, policy: Policy, version: int) -> Path | None:
        """Collective gather; rank 0 writes the adapter folder with PEFT's ``save_pretrained``, atomically."""
        sd = full_state_dict(policy)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            lm = policy.lm
            return save_adapter(
                lm, sd, self.root / self.adapter_name(version), rename=lambda adapter: self.checkpoint_keys(lm, adapter)
            )
        return None

    @staticmethod
    async def _load(client: GenerationClient, name: str, folder: str) -> None:
        """Load, replacing a same-named adapter a server kept from before a trainer restart."""
        from grpo_core.errors import ServerRequestError

        try:
            await client.unload_lora_adapter(name)
        except ServerRequestError:
            pass  # not loaded: the usual case
        await client.load_lora_adapter(name, folder)

    @staticmethod
    async def _unload(client: GenerationClient, name: str) -> None:
        """Unload; an adapter the server no longer has (404) counts as unloaded."""
        from grpo_core.errors import ServerRequestError

        try:
            await client.unload_lora_adapter(name)
        except ServerRequestError as exc:
            if exc.status != 404:
                raise

    def sync(self, policy: Policy, version: int, rank: int) -> dict[str, float]:
        """Save ``{name}-v{version}``, load it everywhere (all or nothing), retire old versions."""
        t0 = time.perf_counter()
        folder = self.save_adapter(policy, version)
        if rank != 0:
            return {}
        t1 = time.perf_counter()
        name = self.adapter_name(version)
        try:
            path = self.store.publish(folder, name)
            self.servers.fan_out(
                f"LoRA load {name}",
                lambda c: self._load(c, name, path),
                undo=lambda c: c.unload_lora_adapter(name),
                reads_storage=True,
            )
        except ServingError:
            shutil.rmtree(folder, ignore_errors=True)
            self.store.remove(name)
            raise
        self.loaded.append(version)
        while len(self.loaded) > self.keep:
            old = self.adapter_name(self.loaded.pop(0))
            try:
                self.servers.fan_out(f"LoRA unload {old}", lambda c, old=old: self._unload(c, old))
            except ServingError as exc:  # a stale version left loaded costs a slot, not correctness
                logger.warning("retiring %s: %s", old, exc)
            shutil.rmtree(self.root / old, ignore_errors=True)
            self.store.remove(old)
        return {"perf/weight_sync_write_s": t1 - t0, "perf/weight_sync_load_s": time.perf_counter() - t1}
