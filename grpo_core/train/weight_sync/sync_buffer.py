"""The persistent packed buffer of the vLLM full-weight sync: every parameter's full tensor, gathered before any pause.

One ``uint8`` tensor on the rank's device holds every parameter's bytes back to back, allocated on the first sync and
reused by every later one (its storage, its views and the CUDA IPC handle made from it stay the same). The layout is
vLLM 0.25.1's packed format (``vllm/distributed/weight_transfer/packed_tensor.py``, ``unpack_tensor``): the receiver
splits the bytes by ``tensor_sizes`` in ``names`` order and reads each piece as its dtype with ``Tensor.view(dtype)``,
which needs every piece to start at a multiple of its element size. The parameters are therefore laid out by element
size, largest first (fp32 before bf16), so each dtype's pieces form one aligned segment: :attr:`PackedWeights.flat`
holds that segment as a flat tensor of the dtype (a view of the buffer, one per dtype) and :meth:`PackedWeights.views`
each parameter's view with its shape.

Tied parameters (an embedding shared with the output head) appear once, as ``named_parameters`` lists them; the servers
re-tie them from the model config, as they do with the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_core.errors import ServingError


@dataclass(frozen=True)
class Slot:
    """One parameter's place in the packed buffer.

    Attributes:
        name: the tensor's name on the servers (vLLM's loader names, :func:`..vllm.vllm_name`).
        param: the trainer's parameter name (``named_parameters``).
        dtype: the parameter's dtype.
        shape: the full (unsharded) shape.
        offset: first byte in the buffer (a multiple of ``dtype.itemsize``).
        nbytes: bytes the parameter takes (numel x itemsize).
    """

    name: str
    param: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class PackedWeights:
    """Every full parameter in one persistent ``uint8`` buffer (see module docs).

    Args:
        params: ``(server name, trainer name, dtype, full shape)`` per parameter, in ``named_parameters`` order.
        device: where the buffer lives (the rank's GPU; CPU in tests).

    Attributes:
        buffer: ``uint8[total_bytes]`` on ``device``: the parameters' bytes back to back, no padding.
        slots: the parameters in buffer order (element size descending, then ``named_parameters`` order).
        flat: per dtype, its segment as a 1-D tensor of that dtype (a view of ``buffer``).
    """

    def __init__(self, params: list[tuple[str, str, torch.dtype, tuple[int, ...]]], device: torch.device | str):
        order = sorted(range(len(params)), key=lambda i: -params[i][2].itemsize)  # stable: named_parameters order
        slots, offset = [], 0
        for i in order:
            name, param, dtype, shape = params[i]
            nbytes = math.prod(shape) * dtype.itemsize
            slots.append(Slot(name, param, dtype, tuple(shape), offset, nbytes))
            offset += nbytes
        self.slots: list[Slot] = slots
        self.buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        self._views = {s.param: self._view(s.offset, s.nbytes, s.dtype).view(s.shape) for s in slots}
        self.flat: dict[torch.dtype, torch.Tensor] = {}
        for dtype in dict.fromkeys(s.dtype for s in slots):
            mine = [s for s in slots if s.dtype == dtype]
            self.flat[dtype] = self._view(mine[0].offset, sum(s.nbytes for s in mine), dtype)
        self._order = [p[1] for p in params]  # the gather's order: the same collective sequence on every rank

    def _view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.buffer[offset : offset + nbytes].view(dtype)

    @classmethod
    def for_policy(cls, policy: torch.nn.Module, server_name: Callable[[str], str]) -> PackedWeights:
        """The layout of ``policy``'s parameters (full shapes and dtypes: no gather needed), buffer allocated.

        Args:
            policy: the (possibly FSDP2-sharded) policy; a DTensor parameter's ``shape`` is its full shape.
            server_name: maps a trainer parameter name to the servers' name.
        """
        params, device = [], None
        for name, p in policy.named_parameters():
            params.append((server_name(name), name, p.dtype, tuple(p.shape)))
            local = p.to_local() if hasattr(p, "to_local") else p
            device = device or local.device
        if device is None:
            raise ServingError("weight sync: the policy has no parameters to send")
        return cls(params, device)

    def gather(self, policy: torch.nn.Module) -> None:
        """Copy every parameter's full tensor into its view (collective under FSDP2: ``full_tensor`` all-gathers, so
        every rank calls it, in ``named_parameters`` order). A copy that fails does not stop the gathers: this rank
        still takes part in every later one (the ranks' collectives stay in step) and raises at the end. On CUDA,
        waits until the copies are done, so a reader of the buffer (a vLLM server through CUDA IPC, an NCCL
        broadcast) sees the whole update.

        Raises:
            ServingError: the policy's parameters are not those of the first sync (names, dtypes or shapes).
        """
        params = dict(policy.named_parameters())
        if list(params) != self._order:
            raise ServingError(
                "weight sync: the policy's parameters changed since the first sync "
                f"({len(params)} now, {len(self._order)} then); the packed buffer's layout is fixed"
            )
        first: Exception | None = None
        with torch.no_grad():
            for name in self._order:
                t = params[name].detach()
                full = t.full_tensor() if hasattr(t, "full_tensor") else t  # collective: every rank, every time
                if first is not None:
                    continue
                view = self._views[name]
                try:
                    if full.dtype != view.dtype or tuple(full.shape) != tuple(view.shape):
                        raise ServingError(
                            f"weight sync: parameter {name} is {full.dtype} {tuple(full.shape)} now, "
                            f"{view.dtype} {tuple(view.shape)} at the first sync; the packed buffer's layout is fixed"
                        )
                    view.copy_(full)
                except Exception as exc:  # noqa: BLE001 - raised below, once every collective was taken part in
                    first = exc
        if self.buffer.is_cuda:
            torch.cuda.current_stream(self.buffer.device).synchronize()
        if first is not None:
            raise first

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """``(server name, view of the buffer with the parameter's shape)`` in buffer order."""
        return [(s.name, self._views[s.param]) for s in self.slots]

    def update_fields(self) -> dict[str, list]:
        """vLLM's packed update metadata: ``names``, ``dtype_names``, ``shapes``, ``tensor_sizes`` (bytes), in buffer
        order (``IPCWeightTransferUpdateInfo`` / ``NCCLWeightTransferUpdateInfo`` of vLLM 0.25.1)."""
        return {
            "names": [s.name for s in self.slots],
            "dtype_names": [str(s.dtype).removeprefix("torch.") for s in self.slots],
            "shapes": [list(s.shape) for s in self.slots],
            "tensor_sizes": [s.nbytes for s in self.slots],
        }


def take_part_in_gather(policy: torch.nn.Module) -> None:
    """Take part in :meth:`PackedWeights.gather`'s collectives without keeping anything (a rank that sends nothing:
    every rank but 0 under NCCL, or a rank whose set-up failed and must not leave the others waiting)."""
    with torch.no_grad():
        for _, p in policy.named_parameters():
            t = p.detach()
            if hasattr(t, "full_tensor"):
                t.full_tensor()
