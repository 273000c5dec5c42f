"""Process group set-up and the rank-0 → rank row hand-off (torchrun environment).

gloo on CPU, NCCL on CUDA. Rows travel as uint8 tensors of Arrow IPC bytes
(``grpo_core.train.rows``): a header broadcast says what comes next, then rank 0
sends each other rank its row point to point. This control traffic always runs on
a CPU (gloo) process group, also beside NCCL: it never touches a device stream, so
handing off the next step's rows does not wait for the device to finish the
previous step.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from grpo_core.packing import PackedRow

from .rows import row_from_bytes, row_to_bytes

logger = logging.getLogger(__name__)

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


_DIGEST = 32  # bytes of an HMAC-SHA256
_HOST = 64  # bytes of a rank's host name in the member check (UTF-8, cut, zero-padded)


def _tag(token: str, nonce: bytes, what: bytes) -> bytes:
    return hmac.new(token.encode(), nonce + what, hashlib.sha256).digest()


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.tolist())


def check_members(world: World, token: str | None) -> None:
    """Every rank proves it holds the run's token before any model data moves; raise on every rank otherwise.

    torchrun's c10d rendezvous (``train.rdzv_endpoint`` with ``train.nnodes`` > 1) has no authentication: any
    process that reaches the port can take a node's place. So, right after the process group forms, rank 0
    broadcasts a random 32-byte nonce; each rank answers ``HMAC-SHA256(token, nonce ‖ "member" ‖ rank)`` (bound to
    its rank, so one rank's answer is no other's) with its host name; rank 0 checks each answer and broadcasts the
    verdict (one flag per rank) under ``HMAC(token, nonce ‖ "verdict" ‖ flags)``, which proves rank 0 holds the
    token too: a trainer host that joined another run's rendezvous (or an impostor's) stops. Only fixed-size
    ``uint8`` tensors travel (no pickles: an impostor's bytes are never unpickled). What it does not cover: the
    collectives' own traffic (gloo/NCCL) is not encrypted; keep the trainer hosts on a private network.

    Args:
        world: the joined process group (:func:`init_world`); a one-rank world passes at once.
        token: the run's token (``GRPO_RUN_TOKEN``); None when this host has none (it still answers, so its peers
            stop at once instead of at the collective timeout, and it raises naming the variable).

    Raises:
        ConfigError: on every rank when any rank lacks the token or holds another one, naming the ranks and
            their hosts (rank 0), or that rank 0 did not prove the token (other ranks), and the fix.
    """
    from grpo_core.auth import TOKEN_ENV
    from grpo_core.errors import ConfigError

    if world.world_size == 1:
        return
    group, host = world.control, socket.gethostname()
    nonce = torch.zeros(_DIGEST, dtype=torch.uint8)
    if world.is_main:
        nonce = torch.tensor(list(secrets.token_bytes(_DIGEST)), dtype=torch.uint8)
    dist.broadcast(nonce, 0, group=group)
    seed = _bytes(nonce)
    mine = torch.zeros(_DIGEST + _HOST, dtype=torch.uint8)
    if token:
        mine[:_DIGEST] = torch.tensor(list(_tag(token, seed, b"member" + world.rank.to_bytes(4, "big"))),
                                      dtype=torch.uint8)
    name = host.encode()[:_HOST]
    mine[_DIGEST:_DIGEST + len(name)] = torch.tensor(list(name), dtype=torch.uint8)
    answers = [torch.zeros_like(mine) for _ in range(world.world_size)]
    dist.all_gather(answers, mine, group=group)
    verdict = torch.zeros(world.world_size + _DIGEST, dtype=torch.uint8)
    if world.is_main:
        flags = bytes(0 if token and hmac.compare_digest(_bytes(a[:_DIGEST]), _tag(
            token, seed, b"member" + r.to_bytes(4, "big"))) else 1 for r, a in enumerate(answers))
        verdict[:world.world_size] = torch.tensor(list(flags), dtype=torch.uint8)
        if token:
            verdict[world.world_size:] = torch.tensor(list(_tag(token, seed, b"verdict" + flags)), dtype=torch.uint8)
    dist.broadcast(verdict, 0, group=group)
    flags = _bytes(verdict[:world.world_size])
    fix = (f"export the same {TOKEN_ENV} (the token the flow's run uses: set it in the environment of trainer-0's "
           "worker or `grpo train`) on every trainer host before torchrun")
    if not token:
        raise ConfigError(f"{TOKEN_ENV} is not set on trainer host {host} (rank {world.rank}): with train.nnodes > 1 "
                          f"every trainer rank proves it holds the run's token before any model data moves; {fix}")
    if not hmac.compare_digest(_bytes(verdict[world.world_size:]), _tag(token, seed, b"verdict" + flags)):
        raise ConfigError(f"rank 0 at train.rdzv_endpoint did not prove it holds this host's {TOKEN_ENV} (trainer "
                          f"host {host}, rank {world.rank}): another run's rendezvous, or another token; {fix}")
    bad = [r for r, f in enumerate(flags) if f]
    if bad:
        hosts = [_bytes(answers[r][_DIGEST:]).rstrip(b"\0").decode(errors="replace") for r in bad]
        who = ", ".join(f"rank {r} (host {h or '?'})" for r, h in zip(bad, hosts)) if world.is_main else \
            ", ".join(f"rank {r}" for r in bad)
        raise ConfigError(f"trainer {who} did not prove it holds the run's token ({TOKEN_ENV} missing or another): "
                          f"torchrun's rendezvous has no authentication, so nothing is trained with it; {fix}")
    if world.is_main:
        logger.info("every trainer rank proved it holds the run's token (%d ranks)", world.world_size)


def check_shared_folder(world: World, folder: Path, field: str = "train.output_dir") -> None:
    """Every rank sees the files rank 0 writes in ``folder``; raise on every rank otherwise.

    The checkpoint is sharded (``torch.distributed.checkpoint``: each rank writes its own shard files into the
    folder rank 0 made and later renames), so with several trainer hosts ``train.output_dir`` must be one shared
    folder (an NFS or Lustre mount at the same path), else the first checkpoint fails or lacks shards. Rank 0 writes
    a file named by a random nonce; every rank looks for it, and the ranks that miss it are named.

    Args:
        world: the joined process group; a one-rank world passes at once.
        folder: the folder that must be shared (made by rank 0 when missing).
        field: its config path, for the message.

    Raises:
        ConfigError: on every rank when any rank does not see rank 0's file, naming the ranks and their hosts.
    """
    from grpo_core.errors import ConfigError

    if world.world_size == 1:
        return
    group, host = world.control, socket.gethostname()
    nonce = torch.zeros(16, dtype=torch.uint8)
    marker = None
    if world.is_main:
        nonce = torch.tensor(list(secrets.token_bytes(16)), dtype=torch.uint8)
        folder.mkdir(parents=True, exist_ok=True)
        marker = folder / f".grpo-shared-{_bytes(nonce).hex()}"
        marker.write_bytes(_bytes(nonce))
    dist.broadcast(nonce, 0, group=group)  # after the write: the file exists on rank 0's side before anyone looks
    path = folder / f".grpo-shared-{_bytes(nonce).hex()}"
    try:
        seen = path.read_bytes() == _bytes(nonce)
    except OSError:
        seen = False
    mine = torch.zeros(1 + _HOST, dtype=torch.uint8)
    mine[0] = int(seen)
    name = host.encode()[:_HOST]
    mine[1:1 + len(name)] = torch.tensor(list(name), dtype=torch.uint8)
    answers = [torch.zeros_like(mine) for _ in range(world.world_size)]
    dist.all_gather(answers, mine, group=group)
    if marker is not None:
        marker.unlink(missing_ok=True)
    missing = [(r, _bytes(a[1:]).rstrip(b"\0").decode(errors="replace")) for r, a in enumerate(answers) if not a[0]]
    if missing:
        who = ", ".join(f"rank {r} (host {h or '?'})" for r, h in missing)
        raise ConfigError(f"{field}={folder} is not one folder shared by every trainer host: {who} does not see the "
                          "file rank 0 wrote there. Each rank writes its own checkpoint shards into it: mount one "
                          f"shared folder (NFS, Lustre, …) at the same path on every trainer host and set {field} there")


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

