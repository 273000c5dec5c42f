"""Full-weight sync to vLLM through its weight-transfer protocol (vLLM 0.25.1 API).

Sequence per server (``VLLM_SERVER_DEV_MODE=1``): ``/init_weight_transfer_engine``
once; per sync ``/pause?mode=keep`` → ``/start_weight_update`` → the tensors
(``/update_weights``) → ``/finish_weight_update`` →
``/reset_prefix_cache?reset_running_requests=true`` → ``/resume``.

* Gather first, pause only around the copy: every rank copies its parameters' full tensors (FSDP2 ``full_tensor``,
  collective) into a persistent packed buffer (:class:`.sync_buffer.PackedWeights`: one ``uint8`` tensor allocated on
  the first sync and reused, one flat view per dtype, a view per parameter; under NCCL rank 0 alone keeps one, the
  others only take part in the all-gathers) while the servers still generate; only then
  are they paused, sent the buffer, finished, reset and resumed. A failure before the pause (the gather, the set-up,
  on any rank) fails the sync on every rank before any server is paused.
* Pause in keep mode: ``/pause`` without a mode **aborts** every in-flight request
  (``finish_reason: "abort"``, seen on vLLM 0.25.1); keep freezes them and they continue on the
  new weights after ``/resume`` (vLLM recomputes their KV, so no cache of the old weights is
  reused). Whatever fails, every server that was paused gets finish and resume.
* Several replicas: one pause→update→resume round trip per replica, all in parallel, with one rendezvous after the
  pause: every replica is paused and started, all or nothing (a refused pause is retried every
  ``server.control_retry_s`` until ``server.control_timeout_s``; then the sync fails before any weight moves, naming
  the replica, and the paused ones are resumed); then each replica takes the update and is finished and resumed on
  its own, without waiting for the others' updates (NCCL broadcasts go one replica at a time: they share rank 0's
  GPU). A replica the update failed on is fenced off before its resume (``POST /grpo/stale``, see
  :mod:`grpo_core.serving.guard`: 503 on ``/health`` and generation requests, so every router routes
  around it and counts it) until a later sync reaches it, while the others serve the new version
  (``weight_sync/failed_replica_count``). The sync fails only when the update reached no replica.
  Full weights cannot be rolled back (the trainer holds only the new ones), unlike LoRA loads.
* vLLM's packed transfer (``vllm/distributed/weight_transfer/packed_tensor.py``): the update names every tensor with
  its dtype, shape and byte size, and the bytes travel as one buffer in that order.
* ``ipc`` (trainer and server on the same GPU): one CUDA IPC handle for the whole buffer (``packed: true``,
  ``tensor_sizes``; the server's ``packed_ipc_consumer`` splits and clones it), made once on the first sync
  (:func:`cuda_ipc_handle`, as vLLM's ``IPCWeightTransferEngine`` makes its handles: ``reduce_tensor``, keyed by the
  GPU's UUID; with several ranks every rank's handle, merged, so each vLLM worker finds its own GPU). The update body
  is framed once as vLLM's HTTP transport frames it (base64 pickled handles) and the same body goes to every server.
* ``nccl`` (different GPUs): rank 0 joins each server's weight-transfer NCCL group as rank 0
  (``trainer_init``) and broadcasts the buffer as one tensor (``NCCLWeightTransferEngine.trainer_send_weights``)
  while the server's ``/update_weights`` receives it with vLLM's packed consumer, told
  ``packed_buffer_size_bytes`` = the buffer's size: its chunk closes only past that size, so it takes the
  whole buffer in one broadcast.

With ``--enable-lora`` vLLM's linear and embedding layers gain a ``.base_layer``
segment; ``lora_names=True`` maps the trainer's names accordingly (a wrong name
fails the update with a 500).
"""

from __future__ import annotations

import base64
import logging
import pickle
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import torch

from grpo_core.errors import ServerRequestError, ServingError
from grpo_core.run.children import free_port
from grpo_core.security.auth import ROLE_CONTROL, bearer_headers, role_key, tls_files
from grpo_core.serving.limits import client_ssl_context
from grpo_core.serving.protocol import (
    FINISH_WEIGHT_UPDATE_PATH,
    INIT_WEIGHT_TRANSFER_PATH,
    PAUSE_PATH,
    RESET_PREFIX_CACHE_PATH,
    RESUME_PATH,
    STALE_PATH,
    START_WEIGHT_UPDATE_PATH,
    UPDATE_WEIGHTS_PATH,
    WORLD_SIZE_PATH,
)

from .sync_buffer import PackedWeights, take_part_in_gather

if TYPE_CHECKING:
    from ..policy import Policy


logger = logging.getLogger(__name__)

_LORA_WRAPPED = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|embed_tokens|lm_head)\.(weight|bias)$"
)
#: Query of the pause that keeps in-flight requests (vLLM's default mode, ``abort``, ends them).
PAUSE_KEEP = {"mode": "keep"}
#: Query of the prefix-cache reset after new weights: running (kept) requests are recomputed too.
RESET_ALL = {"reset_running_requests": "true"}


def vllm_name(name: str, lora_names: bool, name_map: dict[str, str] | None = None) -> str:
    """The trainer's parameter name as vLLM's loader expects it: the name in the served checkpoint
    (``name_map``, from :func:`grpo_core.models.text_model.checkpoint_name_map`; e.g. Qwen3.5's
    ``model.language_model.…``), with ``.base_layer`` where vLLM wraps a layer for LoRA."""
    name = name.removeprefix("lm.")
    name = name_map.get(name, name) if name_map else name
    return _LORA_WRAPPED.sub(r".\1.base_layer.\2", name) if lora_names else name


def ipc_update_body(update_info: Any) -> dict[str, Any]:
    """The ``/update_weights`` body of an IPC update, framed as vLLM's HTTP transport frames it.

    Args:
        update_info: vLLM's ``IPCWeightTransferUpdateInfo`` (``names``, ``dtype_names``, ``shapes``,
            ``ipc_handles``: per parameter ``{GPU UUID: rebuild_cuda_tensor args}``, ``packed``,
            optional ``tensor_sizes``).

    Returns:
        ``{"update_info": {names, dtype_names, shapes, packed, [tensor_sizes,] ipc_handles_pickled}}``
        where ``ipc_handles_pickled`` is the base64 text of the pickled handles; the server needs
        ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to unpickle it (vLLM 0.25.1 ``ipc_engine.py``).
    """
    fields: dict[str, Any] = {
        "names": list(update_info.names),
        "dtype_names": list(update_info.dtype_names),
        "shapes": [list(s) for s in update_info.shapes],
        "packed": bool(update_info.packed),
    }
    if getattr(update_info, "tensor_sizes", None) is not None:
        fields["tensor_sizes"] = list(update_info.tensor_sizes)
    fields["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(update_info.ipc_handles)).decode("ascii")
    return {"update_info": fields}


class VllmWeightTransferSync:
    """See module docs. ``urls``: the vLLM servers; ``backend``: ``ipc`` or ``nccl``; ``model_dir``: the
    checkpoint the servers loaded, whose tensor names the sync sends (None = the trainer's names);
    ``control_retry_s`` / ``control_timeout_s``: retries of a refused pause (``server.control_retry_s``,
    ``server.control_timeout_s``).

    Attributes:
        stale: ``{url: reason}`` of the replicas fenced off after a failed update (out of routing until an update
            reaches them).
    """

    def __init__(
        self,
        urls: list[str],
        backend: str = "ipc",
        lora_names: bool = False,
        timeout_s: float = 600.0,
        model_dir: str | Path | None = None,
        api_key: str | None = None,
        control_retry_s: float = 0.5,
        control_timeout_s: float = 60.0,
    ):
        if backend not in ("ipc", "nccl"):
            raise ValueError(f"server.weight_transfer_backend must be 'ipc' or 'nccl', got {backend!r}")
        self.urls, self.backend, self.lora_names = urls, backend, lora_names
        self.model_dir = model_dir
        self.name_map: dict[str, str] | None = None
        # the run's control key unless given; https replicas verified against the run's tls.ca_file (GRPO_TLS_CA_FILE)
        self.http = httpx.Client(
            timeout=timeout_s,
            headers=bearer_headers(api_key or role_key(ROLE_CONTROL)),
            verify=client_ssl_context(tls_files()[2]),
        )
        self.control_retry_s, self.control_timeout_s = control_retry_s, control_timeout_s
        self.groups: list = []
        self.initialised = False
        self.stale: dict[str, str] = {}
        # A replica that took the update serves this version: its fence comes down whoever raised it (this trainer
        # after a failed update, an earlier trainer, or the servers' flow after starting it again with the base
        # weights). Replicas without our guard (404: an external vLLM) are not asked again.
        self._unguarded: set[str] = set()
        self._failed: dict[str, str] = {}  # replicas whose update failed in the sync under way
        self.weights: PackedWeights | None = None  # the persistent packed buffer, made on the first sync
        self._body: dict[str, Any] | None = None  # the /update_weights body of every sync, made on the first
        self._handle: dict[str, tuple] | None = None  # this rank's CUDA IPC handle of the buffer (ipc)

    def _post(self, url: str, path: str, body: dict | None = None, params: dict | None = None) -> dict:
        try:
            r = self.http.post(url + path, json=body, params=params)
        except httpx.HTTPError as exc:
            raise ServingError(f"POST {url}{path}: {type(exc).__name__}: {exc}") from None
        if 400 <= r.status_code < 500:  # a refusal: the status tells the retry policy whether it is final
            raise ServerRequestError(f"POST {url}{path} answered {r.status_code}: {r.text[:300]}", r.status_code)
        if r.status_code >= 500:
            raise ServingError(f"POST {url}{path} answered {r.status_code}: {r.text[:300]}")
        return r.json() if r.content else {}

    def _init_nccl(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        for url in self.urls:
            world = int(self.http.get(url + WORLD_SIZE_PATH).json()["world_size"]) + 1
            port = free_port()
            info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world}
            with ThreadPoolExecutor(1) as pool:  # the server joins the group while we do
                server = pool.submit(self._post, url, INIT_WEIGHT_TRANSFER_PATH, {"init_info": info})
                self.groups.append(trainer_init(info))
                server.result()

    def _initialise(self) -> None:
        if self.backend == "ipc":
            for url in self.urls:
                self._post(url, INIT_WEIGHT_TRANSFER_PATH, {"init_info": {}})
        else:
            self._init_nccl()
        self.initialised = True

    def sync(self, policy: Policy, version: int, rank: int) -> dict[str, float]:
        """Push the policy's weights to every server as version ``version`` (collective).

        Every rank first gathers the full weights into the persistent packed buffer while the servers generate; the
        ranks then agree that it worked (one ``all_gather_object``, which also carries the CUDA IPC handles on the first
        sync), and only then does rank 0 run one round trip per replica, in parallel: pause (keep) and start, all or
        nothing (a replica that still refuses after ``control_timeout_s`` of retries fails the sync before any weight
        moves), the update, then finish, prefix-cache reset and resume whatever happened. A replica whose update
        failed is fenced off before its resume (``POST /grpo/stale``, :mod:`grpo_core.serving.guard`: out of every
        router's set until an update reaches it, or it restarts); the others serve the new version. The other ranks
        wait at a barrier until the servers have read the buffers.

        Returns:
            (rank 0) in seconds: ``perf/weight_sync_transfer_s`` (the whole sync), ``perf/weight_sync_gather_s`` (the
            gather into the buffer and the ranks' agreement, plus the name map, buffer allocation and transfer-engine
            set-up on first use; generation runs meanwhile), ``perf/weight_sync_pause_s`` (the time generation was
            paused: the first ``/pause`` sent to the last ``/resume`` answered), and within it, over the replicas,
            the longest ``perf/weight_sync_update_s`` (the update, after every replica paused) and
            ``perf/weight_sync_settle_s`` (finish, prefix-cache reset and resume); and
            ``weight_sync/failed_replica_count`` (replicas the update failed on, fenced off; the run's total is the
            metric's sum).

        Raises:
            ControlFanOutError: a replica refused the pause or start (names it); every paused replica was resumed.
            ServingError: the update failed on every replica (nothing serves the new version), or the clean-up
                failed; every paused server was still sent finish, prefix-cache reset and resume. Any error of the
                gather or set-up (on any rank) is raised on every rank before any server is paused.
        """
        t0 = time.perf_counter()
        error = self._gather(policy, rank)
        if error is not None:
            raise error
        t_gathered = time.perf_counter()
        if rank != 0:
            _barrier()  # the servers read this rank's buffer (IPC) until rank 0 is done
            return {}
        self._failed = {}
        try:
            phases = self._round_trips(version)
            t_resumed = time.perf_counter()
        finally:
            _barrier()
        self._lift_fences(version)
        return {
            "perf/weight_sync_transfer_s": time.perf_counter() - t0,
            "perf/weight_sync_gather_s": t_gathered - t0,
            "perf/weight_sync_pause_s": t_resumed - t_gathered,
            "perf/weight_sync_update_s": max(p[0] for p in phases),
            "perf/weight_sync_settle_s": max(p[1] for p in phases),
            "weight_sync/failed_replica_count": float(len(self._failed)),
        }

    def _gather(self, policy: Policy, rank: int) -> BaseException | None:
        """Set up on first use, gather into the buffer (collective), and agree across ranks; returns the error every
        rank raises (the first rank's that failed), or None."""
        error: BaseException | None = None
        try:
            if self.name_map is None and self.model_dir is not None:
                from grpo_core.models.text_model import checkpoint_name_map

                self.name_map = checkpoint_name_map(policy.base(), self.model_dir)
            if self.weights is None and (self.backend == "ipc" or rank == 0):  # NCCL: rank 0 alone sends
                self.weights = PackedWeights.for_policy(
                    policy, lambda name: vllm_name(name, self.lora_names, self.name_map)
                )
            if rank == 0 and not self.initialised:
                self._initialise()
        except BaseException as exc:  # noqa: BLE001 - every rank still gathers (collective), then all raise
            error = exc
        handle = None
        try:
            if self.weights is None:
                take_part_in_gather(policy)  # the all-gathers need every rank; nothing kept here
            else:
                self.weights.gather(policy)
                if error is None and self.backend == "ipc" and self._body is None:
                    if self._handle is None:  # once per buffer, even when the first exchange failed
                        self._handle = cuda_ipc_handle(self.weights.buffer)
                    handle = self._handle
        except BaseException as exc:  # noqa: BLE001 - shared with the other ranks below, then raised
            error = error or exc
        mine = (None if error is None else f"{type(error).__name__}: {error}", handle)
        every = _all_gather(mine)
        failed = [(r, e) for r, (e, _) in enumerate(every) if e is not None]
        if error is None and failed:
            error = ServingError(
                f"weight sync: rank {failed[0][0]} failed before the pause ({failed[0][1]}); no server was paused"
            )
        if error is None and self._body is None and rank == 0:  # rank 0 alone talks to the servers
            self._body = self._update_body([h for _, h in every])
        return error

    def _update_body(self, handles: list[dict[str, tuple] | None]) -> dict[str, Any]:
        """The ``/update_weights`` body of every sync (the buffer, its layout and handle never change)."""
        assert self.weights is not None
        fields: dict[str, Any] = self.weights.update_fields()
        if self.backend == "nccl":  # NCCLWeightTransferUpdateInfo has no tensor_sizes (its consumer computes them)
            del fields["tensor_sizes"]
            fields.update(packed=True, packed_buffer_size_bytes=int(self.weights.buffer.numel()))
            return {"update_info": fields}
        merged: dict[str, tuple] = {}
        for h in handles:  # every rank's GPU: each vLLM worker finds its own UUID
            merged.update(h or {})
        fields.update(packed=True)
        fields["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(merged)).decode("ascii")
        return {"update_info": fields}

    def _retry(self, url: str, path: str, body: dict | None = None, params: dict | None = None) -> None:
        """``_post`` under the control calls' one retry policy (:func:`grpo_core.serving.replicas.retry_control`:
        every ``control_retry_s`` until ``control_timeout_s``, a final refusal such as a 401 or 404 at once); raises
        the last error."""
        from grpo_core.serving.replicas import retry_control

        retry_control(url, lambda: self._post(url, path, body, params), self.control_retry_s, self.control_timeout_s)

    def _round_trips(self, version: int) -> list[tuple[float, float]]:
        """One pause→update→resume round trip per replica, in parallel (see :meth:`sync`).

        Returns:
            ``(update seconds, settle seconds)`` per replica.

        Raises:
            ControlFanOutError: some replica refused the pause or start (names it); every paused one was resumed.
            ServingError: the update reached no replica, or a clean-up call failed.
        """
        from grpo_core.serving.replicas import ControlFanOutError

        paused: list[str] = []
        refused: dict[str, str] = {}
        gate = threading.Barrier(len(self.urls))
        send_lock = threading.Lock()  # NCCL: one broadcast at a time from rank 0's GPU

        def round_trip(index: int, url: str) -> tuple[float, float, BaseException | None]:
            paused.append(url)  # from here on it gets finish and resume, whatever happens
            try:
                self._retry(url, PAUSE_PATH, params=PAUSE_KEEP)
                self._retry(url, START_WEIGHT_UPDATE_PATH, {"is_checkpoint_format": True})
            except BaseException as exc:  # noqa: BLE001 - every replica must reach the gate
                refused[url] = str(exc)
            gate.wait()  # all or nothing: no weight moves until every replica is paused and started
            t_go = time.perf_counter()
            if not refused:
                self._update_one(index, url, send_lock)
                if url in self._failed:  # before its resume: it must not serve a version it does not hold
                    self._fence(url, version)
            t_sent = time.perf_counter()
            failed = self._finish(url)
            return t_sent - t_go, time.perf_counter() - t_sent, failed

        with ThreadPoolExecutor(len(self.urls)) as pool:
            results = list(pool.map(round_trip, range(len(self.urls)), self.urls))
        error = next((e for _, _, e in results if e is not None), None)
        if refused:
            raise ControlFanOutError(
                f"weight sync v{version}: pause failed on {len(refused)} of {len(self.urls)} replicas after retrying "
                f"for {self.control_timeout_s:.0f} s (server.control_timeout_s): "
                + "; ".join(f"{u}: {e}" for u, e in refused.items())
                + f"; no weights were sent, every paused replica is resumed ({', '.join(paused)})",
                refused,
                paused,
            ) from error
        if self._failed:
            logger.error(
                "weight sync v%d failed on %d of %d replicas; out of routing until an update reaches them: %s",
                version,
                len(self._failed),
                len(self.urls),
                "; ".join(f"{u}: {e}" for u, e in self._failed.items()),
            )
        if len(self._failed) == len(self.urls):
            raise ServingError(
                f"weight sync v{version} failed on every replica: "
                + "; ".join(f"{u}: {e}" for u, e in self._failed.items())
            ) from error
        if error is not None:
            raise error
        return [(u, s) for u, s, _ in results]

    def _update_one(self, index: int, url: str, send_lock: threading.Lock) -> None:
        """The update on one replica; a failure goes to ``_failed``."""
        try:
            if self.backend == "ipc":
                self._post(url, UPDATE_WEIGHTS_PATH, self._body)
            else:
                with send_lock:
                    self._send_nccl(index, url)
        except Exception as exc:  # noqa: BLE001 - that replica's update failed (HTTP answer or its broadcast)
            self._failed[url] = str(exc) if isinstance(exc, ServingError) else f"{type(exc).__name__}: {exc}"

    def _fence(self, url: str, version: int) -> None:
        """Take a replica whose update failed out of routing (``POST /grpo/stale``)."""
        self.stale[url] = f"weight update to policy version {version} failed: {self._failed[url]}"
        try:
            self._post(url, STALE_PATH, {"stale": True, "reason": self.stale[url]})
        except ServingError as exc:
            logger.error("could not fence off %s (is grpo_core.serving.guard installed?): %s", url, exc)

    def _lift_fences(self, version: int) -> None:
        """A replica that took the update serves ``version``: its fence comes down (whoever raised it)."""
        for url in [u for u in self.urls if u not in self._failed and u not in self._unguarded]:
            try:
                self._post(url, STALE_PATH, {"stale": False, "version": version})
            except ServingError as exc:
                if url not in self.stale and " 404" in str(exc):
                    self._unguarded.add(url)
                logger.log(
                    logging.ERROR if url in self.stale else logging.INFO,
                    "could not lift the fence of %s (grpo_core.serving.guard answers it): %s",
                    url,
                    exc,
                )
                continue
            if self.stale.pop(url, None) is not None:
                logger.warning("replica %s holds policy version %d again; it rejoins the routing", url, version)

    def _finish(self, url: str) -> BaseException | None:
        """Finish, reset and resume a paused server, each even after a failure; returns the first error."""
        first = None
        for path, params in (
            (FINISH_WEIGHT_UPDATE_PATH, None),
            (RESET_PREFIX_CACHE_PATH, RESET_ALL),
            (RESUME_PATH, None),
        ):
            try:
                self._post(url, path, params=params)
            except ServingError as exc:
                logger.error("weight sync clean-up %s%s failed: %s", url, path, exc)
                first = first or exc
        return first

    def _send_nccl(self, index: int, url: str) -> None:
        """Broadcast the packed buffer to one replica's NCCL group while its ``/update_weights`` receives it."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        assert self.weights is not None
        failed: list[BaseException] = []
        packed = [(PACKED_NAME, self.weights.buffer)]

        def broadcast() -> None:
            try:
                NCCLWeightTransferEngine.trainer_send_weights(iter(packed), {"group": self.groups[index]})
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                failed.append(exc)

        # NCCL has no timeout: the broadcast runs on a daemon thread while the HTTP request that drives the
        # server's receive stays here, so a server that refuses the update raises instead of hanging the trainer.
        sender = threading.Thread(target=broadcast, name="nccl-weight-broadcast", daemon=True)
        sender.start()
        self._post(url, UPDATE_WEIGHTS_PATH, self._body)
        sender.join()
        if failed:
            raise failed[0]


#: The name the packed buffer's one broadcast goes under (vLLM's unpacked send ignores names).
PACKED_NAME = "packed-weights"


def cuda_ipc_handle(buffer: torch.Tensor) -> dict[str, tuple]:
    """``{physical GPU UUID: rebuild_cuda_tensor args}`` of ``buffer``, made as vLLM 0.25.1's
    ``IPCWeightTransferEngine`` makes its handles (``torch.multiprocessing.reductions.reduce_tensor``). Made once per
    buffer: the buffer persists, so the handle stays valid for every sync.

    Args:
        buffer: the packed ``uint8`` buffer on a CUDA device.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(buffer.device).uuid)
    _, args = reduce_tensor(buffer)
    return {uuid: args}


def _all_gather(item: Any) -> list[Any]:
    """Every rank's ``item`` (``all_gather_object``); ``[item]`` without a process group."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [item]
    every: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, item)
    return every


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
