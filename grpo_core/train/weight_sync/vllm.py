"""Full-weight sync to vLLM through its weight-transfer protocol (vLLM 0.25.1 API).

Sequence per server (``VLLM_SERVER_DEV_MODE=1``): ``/init_weight_transfer_engine``
once; per sync ``/pause?mode=keep`` → ``/start_weight_update`` → the tensors
(``/update_weights``) → ``/finish_weight_update`` →
``/reset_prefix_cache?reset_running_requests=true`` → ``/resume``.

* Pause in keep mode: ``/pause`` without a mode **aborts** every in-flight request
  (``finish_reason: "abort"``, seen on vLLM 0.25.1); keep freezes them and they continue on the
  new weights after ``/resume`` (vLLM recomputes their KV, so no cache of the old weights is
  reused). Whatever fails, every server that was paused gets finish and resume.
* Several replicas: a fan-out. Every replica is paused and started at once, all or nothing (a refused
  pause is retried every ``server.control_retry_s`` until ``server.control_timeout_s``; then the sync
  fails before any weight moves, naming the replica, and the paused ones are resumed); the update goes
  to every replica; a replica it failed on is fenced off before its resume (``POST /grpo/stale``, see
  :mod:`grpo_core.serving.guard`: 503 on ``/health`` and generation requests, so every router routes
  around it and counts it) until a later sync reaches it, while the others serve the new version
  (``weight_sync/failed_replica_count``). The sync fails only when the update reached no replica.
  Full weights cannot be rolled back (the trainer holds only the new ones), unlike LoRA loads.
* ``ipc`` (trainer and server on the same GPU): every rank calls vLLM's
  ``IPCWeightTransferEngine.trainer_send_weights`` with full tensors on its own GPU and a
  send callable; rank 0 frames the update as vLLM's HTTP transport does
  (:func:`ipc_update_body`: names, dtypes, shapes and the base64 pickled CUDA IPC handles) and
  posts it to every server, so one gather serves all of them.
* ``nccl`` (different GPUs): rank 0 joins each server's weight-transfer NCCL group as rank 0
  (``trainer_init``) and broadcasts every tensor while the server's ``/update_weights``
  (names, dtypes, shapes) receives them.

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
from collections.abc import Iterator
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


def full_tensors(
    policy: Policy, lora_names: bool, name_map: dict[str, str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(vLLM name, full tensor on this rank's GPU)``, one parameter at a time (collective)."""
    for name, p in policy.named_parameters():
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        yield vllm_name(name, lora_names, name_map), t


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

        A fan-out over the replicas: every replica is paused (keep) and started (all or nothing: a replica that
        still refuses after ``control_timeout_s`` of retries fails the sync before any weight moves), the update goes
        to every replica, then every paused replica is finished, reset and resumed whatever happened. A replica whose
        update failed is fenced off first (``POST /grpo/stale``, :mod:`grpo_core.serving.guard`: out of every
        router's set until an update reaches it, or it restarts); the others serve the new version.

        Returns:
            (rank 0) ``perf/weight_sync_transfer_s`` (seconds, split into ``perf/weight_sync_pause_s``: the name
            map and transfer-engine set-up on first use, pause and start on every replica;
            ``perf/weight_sync_update_s``: the barriers, gather and send; ``perf/weight_sync_settle_s``: finish,
            prefix-cache reset and resume) and ``weight_sync/failed_replica_count`` (replicas the update
            failed on, fenced off; the run's total is the metric's sum).

        Raises:
            ControlFanOutError: a replica refused the pause or start (names it); every paused replica was resumed.
            ServingError: the update failed on every replica (nothing serves the new version), or the clean-up
                failed; every paused server was still sent finish, prefix-cache reset and resume.
        """
        t0 = time.perf_counter()
        if self.name_map is None and self.model_dir is not None:
            from grpo_core.models.text_model import checkpoint_name_map

            self.name_map = checkpoint_name_map(policy.base(), self.model_dir)
        paused: list[str] = []
        error: BaseException | None = None
        self._failed = {}
        try:
            if rank == 0:
                if not self.initialised:
                    self._initialise()
                self._pause_all(paused, version)
        except BaseException as exc:  # noqa: BLE001 - re-raised after the collective: the other ranks still meet us
            error = exc
        t_paused = time.perf_counter()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        try:
            # Gathering full tensors is collective, so every rank takes part even when rank 0 already failed.
            self._send(policy, rank, skip_post=error is not None)
        except BaseException as exc:  # noqa: BLE001 - re-raised after the barrier below
            error = error or exc
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            t_sent = time.perf_counter()
            if rank == 0:
                error = self._settle(paused, version, error)
        if error is not None:
            raise error
        if rank != 0:
            return {}
        end = time.perf_counter()
        # the phases, to tell a slow keep-mode pause (requests finishing their engine step) from a slow transfer
        # or a slow finish/reset/resume
        return {
            "perf/weight_sync_transfer_s": end - t0,
            "perf/weight_sync_pause_s": t_paused - t0,
            "perf/weight_sync_update_s": t_sent - t_paused,
            "perf/weight_sync_settle_s": end - t_sent,
            "weight_sync/failed_replica_count": float(len(self._failed)),
        }

    def _retry(self, url: str, path: str, body: dict | None = None, params: dict | None = None) -> None:
        """``_post`` under the control calls' one retry policy (:func:`grpo_core.serving.replicas.retry_control`:
        every ``control_retry_s`` until ``control_timeout_s``, a final refusal such as a 401 or 404 at once); raises
        the last error."""
        from grpo_core.serving.replicas import retry_control

        retry_control(url, lambda: self._post(url, path, body, params), self.control_retry_s, self.control_timeout_s)

    def _pause_all(self, paused: list[str], version: int) -> None:
        """Pause (keep) and start the update on every replica at once, all or nothing.

        Raises:
            ControlFanOutError: some replica refused (names it); the caller resumes every one in ``paused``.
        """
        from grpo_core.serving.replicas import ControlFanOutError

        def pause(url: str) -> str | None:
            paused.append(url)  # from here on it gets finish and resume, whatever happens
            try:
                self._retry(url, PAUSE_PATH, params=PAUSE_KEEP)
                self._retry(url, START_WEIGHT_UPDATE_PATH, {"is_checkpoint_format": True})
            except ServingError as exc:
                return str(exc)
            return None

        with ThreadPoolExecutor(len(self.urls)) as pool:
            refused = {u: e for u, e in zip(self.urls, pool.map(pause, self.urls)) if e is not None}
        if refused:
            raise ControlFanOutError(
                f"weight sync v{version}: pause failed on {len(refused)} of {len(self.urls)} replicas after retrying "
                f"for {self.control_timeout_s:.0f} s (server.control_timeout_s): "
                + "; ".join(f"{u}: {e}" for u, e in refused.items())
                + f"; no weights were sent, every paused replica is resumed ({', '.join(paused)})",
                refused,
                paused,
            )

    def _settle(self, paused: list[str], version: int, error: BaseException | None) -> BaseException | None:
        """After the update: fence off the replicas it failed on, finish and resume every paused one, lift the fence
        of those it reached; returns the error to raise (the first one), or None."""
        if error is None:
            for url, reason in self._failed.items():
                self.stale[url] = f"weight update to policy version {version} failed: {reason}"
                try:  # before its resume: it must not serve a version it does not hold
                    self._post(url, STALE_PATH, {"stale": True, "reason": self.stale[url]})
                except ServingError as exc:
                    logger.error("could not fence off %s (is grpo_core.serving.guard installed?): %s", url, exc)
            if self._failed:
                logger.error(
                    "weight sync v%d failed on %d of %d replicas; out of routing until an update reaches them: %s",
                    version,
                    len(self._failed),
                    len(self.urls),
                    "; ".join(f"{u}: {e}" for u, e in self._failed.items()),
                )
            if self._failed and len(self._failed) == len(self.urls):
                error = ServingError(
                    f"weight sync v{version} failed on every replica: "
                    + "; ".join(f"{u}: {e}" for u, e in self._failed.items())
                )
        error = self._finish(paused, error)
        if error is not None:
            return error
        for url in [u for u in paused if u not in self._failed and u not in self._unguarded]:
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
        return None

    def _finish(self, paused: list[str], error: BaseException | None) -> BaseException | None:
        """Finish, reset and resume every paused server, even after a failure; returns the first error."""

        def finish(url: str) -> BaseException | None:
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

        if paused:
            with ThreadPoolExecutor(len(paused)) as pool:
                for failed in pool.map(finish, list(paused)):
                    error = error or failed
        return error

    def _send(self, policy: Policy, rank: int, skip_post: bool = False) -> None:
        if self.backend == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

            post = (lambda info: None) if skip_post else self._post_ipc_update
            IPCWeightTransferEngine.trainer_send_weights(
                full_tensors(policy, self.lora_names, self.name_map), {"send_mode": post}
            )
            return
        tensors = list(
            full_tensors(policy, self.lora_names, self.name_map)
        )  # full_tensor is collective: every rank gathers
        if rank != 0 or skip_post:
            return
        for index, url in enumerate(self.urls):  # one NCCL group per replica; a failure moves on to the next
            try:
                self._send_nccl(tensors, index, url)
            except Exception as exc:  # noqa: BLE001 - that replica's update failed (HTTP answer or its broadcast)
                self._failed[url] = f"{type(exc).__name__}: {exc}"

    def _post_ipc_update(self, update_info: Any) -> None:
        """Rank 0's send callable: the same framed update to every server at once (failures go to ``_failed``)."""
        body = ipc_update_body(update_info)

        def post(url: str) -> None:
            try:
                self._post(url, UPDATE_WEIGHTS_PATH, body)
            except ServingError as exc:
                self._failed[url] = str(exc)

        with ThreadPoolExecutor(len(self.urls)) as pool:
            list(pool.map(post, self.urls))

    def _send_nccl(self, tensors: list[tuple[str, torch.Tensor]], index: int, url: str) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        info = {
            "names": [n for n, _ in tensors],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
            "packed": False,
        }
        failed: list[BaseException] = []

        def broadcast() -> None:
            try:
                NCCLWeightTransferEngine.trainer_send_weights(iter(tensors), {"group": self.groups[index]})
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                failed.append(exc)

        # NCCL has no timeout: the broadcast runs on a daemon thread while the HTTP request that drives the
        # server's receive stays here, so a server that refuses the update raises instead of hanging the trainer.
        sender = threading.Thread(target=broadcast, name="nccl-weight-broadcast", daemon=True)
        sender.start()
        self._post(url, UPDATE_WEIGHTS_PATH, {"update_info": info})
        sender.join()
        if failed:
            raise failed[0]
