"""Full-weight sync to vLLM through its weight-transfer protocol (vLLM 0.25.1 API).

Sequence per server (``VLLM_SERVER_DEV_MODE=1``): ``/init_weight_transfer_engine``
once; per sync ``/pause`` → ``/start_weight_update`` → the tensors →
``/finish_weight_update`` → ``/reset_prefix_cache`` → ``/resume``.

* ``ipc`` (trainer and server on the same GPU): every rank calls vLLM's
  ``IPCWeightTransferEngine.trainer_send_weights`` with full tensors on its own
  GPU; rank 0 posts the CUDA IPC handles to ``/update_weights``.
* ``nccl`` (different GPUs): rank 0 joins each server's weight-transfer NCCL
  group as rank 0 (``trainer_init``) and broadcasts every tensor while the
  server's ``/update_weights`` (names, dtypes, shapes) receives them.

With ``--enable-lora`` vLLM's linear and embedding layers gain a ``.base_layer``
segment; ``lora_names=True`` maps the trainer's names accordingly (a wrong name
fails the update with a 500).
"""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from grpo_core.errors import ServingError

logger = logging.getLogger(__name__)

_LORA_WRAPPED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|embed_tokens|lm_head)\.(weight|bias)$")


def vllm_name(name: str, lora_names: bool, name_map: dict[str, str] | None = None) -> str:
    """The trainer's parameter name as vLLM's loader expects it: the name in the served checkpoint
    (``name_map``, from :func:`grpo_core.text_model.checkpoint_name_map`; e.g. Qwen3.5's
    ``model.language_model.…``), with ``.base_layer`` where vLLM wraps a layer for LoRA."""
    name = name.removeprefix("lm.")
    name = name_map.get(name, name) if name_map else name
    return _LORA_WRAPPED.sub(r".\1.base_layer.\2", name) if lora_names else name


def full_tensors(policy, lora_names: bool, name_map: dict[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(vLLM name, full tensor on this rank's GPU)``, one parameter at a time (collective)."""
    for name, p in policy.named_parameters():
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        yield vllm_name(name, lora_names, name_map), t


class VllmWeightTransferSync:
    """See module docs. ``urls``: the vLLM servers; ``backend``: ``ipc`` or ``nccl``; ``model_dir``: the
    checkpoint the servers loaded, whose tensor names the sync sends (None = the trainer's names)."""

    def __init__(self, urls: list[str], backend: str = "ipc", lora_names: bool = False, timeout_s: float = 600.0,
                 model_dir: str | Path | None = None):
        if backend not in ("ipc", "nccl"):
            raise ValueError(f"server.weight_transfer_backend must be 'ipc' or 'nccl', got {backend!r}")
        self.urls, self.backend, self.lora_names = urls, backend, lora_names
        self.model_dir = model_dir
        self.name_map: dict[str, str] | None = None
        self.http = httpx.Client(timeout=timeout_s)
        self.groups: list = []
        self.initialised = False

    def _post(self, url: str, path: str, body: dict | None = None) -> dict:
        r = self.http.post(url + path, json=body)
        if r.status_code >= 400:
            raise ServingError(f"POST {url}{path} answered {r.status_code}: {r.text[:300]}")
        return r.json() if r.content else {}

    def _init_nccl(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        for url in self.urls:
            world = int(self.http.get(url + "/get_world_size").json()["world_size"]) + 1
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world}
            with ThreadPoolExecutor(1) as pool:  # the server joins the group while we do
                server = pool.submit(self._post, url, "/init_weight_transfer_engine", {"init_info": info})
                self.groups.append(trainer_init(info))
                server.result()

    def sync(self, policy, version: int, rank: int) -> dict[str, float]:
        """Push the policy's weights to every server as version ``version`` (collective)."""
        t0 = time.perf_counter()
        if self.name_map is None and self.model_dir is not None:
            from grpo_core.text_model import checkpoint_name_map

            self.name_map = checkpoint_name_map(policy.base(), self.model_dir)
        if rank == 0 and not self.initialised:
            if self.backend == "ipc":
                for url in self.urls:
                    self._post(url, "/init_weight_transfer_engine", {"init_info": {}})
            else:
                self._init_nccl()
            self.initialised = True
        if rank == 0:
            for url in self.urls:
                self._post(url, "/pause")
                self._post(url, "/start_weight_update", {"is_checkpoint_format": True})
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        try:
            for i, url in enumerate(self.urls):
                self._send(policy, rank, i, url)
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            if rank == 0:
                for url in self.urls:
                    self._post(url, "/finish_weight_update")
                    self._post(url, "/reset_prefix_cache")
                    self._post(url, "/resume")
        return {"perf/weight_sync_transfer_s": time.perf_counter() - t0} if rank == 0 else {}

    def _send(self, policy, rank: int, index: int, url: str) -> None:
        if self.backend == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

            IPCWeightTransferEngine.trainer_send_weights(full_tensors(policy, self.lora_names, self.name_map),
                                                         {"send_mode": "http", "url": url})
            return
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        tensors = list(full_tensors(policy, self.lora_names, self.name_map))  # collective: every rank gathers
        if rank != 0:
            return
        info = {"names": [n for n, _ in tensors], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors], "packed": False}
        with ThreadPoolExecutor(1) as pool:  # the server receives while we broadcast
            server = pool.submit(self._post, url, "/update_weights", {"update_info": info})
            NCCLWeightTransferEngine.trainer_send_weights(iter(tensors), {"group": self.groups[index]})
            server.result()
