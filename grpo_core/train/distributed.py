"""Process group set-up and the rank-0 → rank row hand-off (torchrun environment).

gloo on CPU, NCCL on CUDA. Rows travel as uint8 tensors of Arrow IPC bytes
(``grpo_core.train.rows``): a header broadcast says what comes next, then rank 0
sends each other rank its row point to point. This control traffic always runs on
a CPU (gloo) process group, also beside NCCL: it never touches a device stream, so
handing off the next step's rows does not wait for the device to finish the
previous step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from grpo_core.packing import PackedRow

from .rows import row_from_bytes, row_to_bytes

# Header commands.
ROW = 0
STOP = 1
RESYNC = 2  # sync the current weights to the servers again (a replica came back with the base weights)


@dataclass(frozen=True)
class World:
    """This process's place in the run."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    control: object | None = None
    """CPU (gloo) process group for headers and rows; None = the default group (already gloo)."""

    @property
    def is_main(self) -> bool:
        """Rank 0 plans micro-batches, logs and checkpoints metadata."""
        return self.rank == 0


def init_world(device: str = "auto", timeout_s: float = 1800.0) -> World:
    """Join (or create, when not under torchrun) the default process group.

    Args:
        device: ``auto`` (CUDA if available), ``cpu`` or ``cuda``.
        timeout_s: collective timeout.
    """
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if use_cuda else None
    return World(rank, world_size, local_rank, dev, control)


def broadcast_header(world: World, values: list[int] | None, size: int = 4) -> list[int]:
    """Rank 0 sends ``values`` (at most ``size`` ints) to all over the control group; every rank returns them."""
    t = torch.zeros(size, dtype=torch.int64)
    if world.is_main:
        t[: len(values)] = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(t, 0, group=world.control)
    return t.tolist()


def scatter_rows(world: World, rows: list[PackedRow] | None) -> PackedRow:
    """Rank 0 passes one row per rank (its own stays local) over the control group; each rank returns its row."""
    if world.is_main:
        for r in range(1, world.world_size):
            data = np.frombuffer(row_to_bytes(rows[r]), dtype=np.uint8)
            dist.send(torch.tensor([data.size], dtype=torch.int64), r, group=world.control)
            dist.send(torch.from_numpy(data.copy()), r, group=world.control)
        return rows[0]
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, 0, group=world.control)
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(buf, 0, group=world.control)
    return row_from_bytes(buf.numpy().tobytes())

