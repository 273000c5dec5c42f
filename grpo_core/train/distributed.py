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
import json
import logging
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from grpo_core.packing import PackedRow

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
        from grpo_core.run.children import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if use_cuda else None
    return World(rank, world_size, local_rank, dev, control)


_DIGEST = 32  # bytes of an HMAC-SHA256
_HOST = 64  # bytes of a rank's host name in the checks below (UTF-8, cut, zero-padded)


def _tag(token: str, nonce: bytes, what: bytes) -> bytes:
    return hmac.new(token.encode(), nonce + what, hashlib.sha256).digest()


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.tolist())


def _u8(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def _from_main(world: World, size: int, data: bytes | None) -> bytes:
    """Rank 0's ``size`` bytes (``data``, on rank 0) on every rank, over the control group."""
    t = _u8(data) if world.is_main else torch.zeros(size, dtype=torch.uint8)
    dist.broadcast(t, 0, group=world.control)
    return _bytes(t)


def _gather_with_hosts(world: World, data: bytes) -> list[tuple[bytes, str]]:
    """Every rank's ``data`` (one fixed length on all ranks) and host name, in rank order, on every rank. Only
    ``uint8`` tensors travel: nothing a peer sends is unpickled."""
    mine = torch.zeros(len(data) + _HOST, dtype=torch.uint8)
    if data:
        mine[: len(data)] = _u8(data)
    host = socket.gethostname().encode()[:_HOST]
    mine[len(data) : len(data) + len(host)] = _u8(host)
    answers = [torch.zeros_like(mine) for _ in range(world.world_size)]
    dist.all_gather(answers, mine, group=world.control)
    return [
        (_bytes(a[: len(data)]), _bytes(a[len(data) :]).rstrip(b"\0").decode(errors="replace") or "?") for a in answers
    ]


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
        token: the run's trainer membership key (``GRPO_MEMBER_KEY``, else derived from ``GRPO_RUN_TOKEN``:
            ``grpo_core.security.auth.role_key``); None when this host has none (it still answers, so its peers
            stop at once instead of at the collective timeout, and it raises naming the variable).

    Raises:
        ConfigError: on every rank when any rank lacks the token or holds another one, naming the ranks and
            their hosts (rank 0), or that rank 0 did not prove the token (other ranks), and the fix.
    """
    from grpo_core.errors import ConfigError
    from grpo_core.security.auth import MEMBER_KEY_ENV, TOKEN_ENV

    if world.world_size == 1:
        return
    n = world.world_size
    nonce = _from_main(world, _DIGEST, secrets.token_bytes(_DIGEST) if world.is_main else None)

    def member(rank: int) -> bytes:
        return _tag(token, nonce, b"member" + rank.to_bytes(4, "big"))

    answers = _gather_with_hosts(world, member(world.rank) if token else bytes(_DIGEST))
    verdict = None
    if world.is_main:
        flags = bytes(0 if token and hmac.compare_digest(a, member(r)) else 1 for r, (a, _) in enumerate(answers))
        verdict = flags + (_tag(token, nonce, b"verdict" + flags) if token else bytes(_DIGEST))
    verdict = _from_main(world, n + _DIGEST, verdict)
    flags = verdict[:n]
    fix = (
        f"export the same {TOKEN_ENV} (the token the flow's run uses: set it in the environment of trainer-0's "
        f"worker or `grpo train`) on trainer-0, and on every other trainer host its membership key {MEMBER_KEY_ENV} "
        "(`python -m grpo_core.security.auth member` on trainer-0 prints it) or the same token, before torchrun"
    )
    host = answers[world.rank][1]
    if not token:
        raise ConfigError(
            f"{TOKEN_ENV} is not set on trainer host {host} (rank {world.rank}), nor {MEMBER_KEY_ENV}: with "
            f"train.nnodes > 1 every trainer rank proves it holds the run's membership key before any model data "
            f"moves; {fix}"
        )
    if not hmac.compare_digest(verdict[n:], _tag(token, nonce, b"verdict" + flags)):
        raise ConfigError(
            f"rank 0 at train.rdzv_endpoint did not prove it holds this host's {TOKEN_ENV} (trainer "
            f"host {host}, rank {world.rank}): another run's rendezvous, or another token; {fix}"
        )
    bad = [r for r, f in enumerate(flags) if f]
    if bad:  # host names as each rank gave them (unproven: for the message only)
        who = ", ".join(f"rank {r} (host {answers[r][1]})" for r in bad)
        raise ConfigError(
            f"trainer {who} did not prove it holds the run's token ({TOKEN_ENV}, or its {MEMBER_KEY_ENV}, missing or "
            "another): "
            f"torchrun's rendezvous has no authentication, so nothing is trained with it; {fix}"
        )
    if world.is_main:
        logger.info("every trainer rank proved it holds the run's token (%d ranks)", n)


def _leaves(value: Any, path: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}`` of nested JSON objects (lists are leaves)."""
    if not isinstance(value, dict):
        return {path: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(_leaves(item, f"{path}.{key}" if path else key))
    return out


def check_same_config(world: World, config: dict[str, Any]) -> None:
    """Every rank trains with rank 0's config; raise on every rank otherwise, naming the fields that differ.

    Each trainer host reads its own copy of ``train_config.json`` (and may add ``--set``): a copy from another run
    or one override more would train its shard with another learning rate, budget or step count, and a rank
    stepping past the others waits in a collective until its timeout. The ranks compare a SHA-256 of the config's
    canonical JSON; when one differs, the texts are exchanged (``uint8`` tensors, parsed as JSON) to name the fields.

    Args:
        world: the joined process group (after :func:`check_members`); a one-rank world passes at once.
        config: what must be equal on every rank (JSON values; host-specific fields left out by the caller).

    Raises:
        ConfigError: on every rank when a rank's config differs from rank 0's: ``field: rank 0's -> that rank's``.
    """
    from grpo_core.errors import ConfigError

    if world.world_size == 1:
        return
    text = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    answers = _gather_with_hosts(world, hashlib.sha256(text).digest())
    differ = [r for r, (digest, _) in enumerate(answers) if digest != answers[0][0]]
    if not differ:
        return
    size = torch.tensor([len(text)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world.world_size)]
    dist.all_gather(sizes, size, group=world.control)
    longest = max(int(n.item()) for n in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(text)] = _u8(text)
    texts = [torch.zeros_like(mine) for _ in range(world.world_size)]
    dist.all_gather(texts, mine, group=world.control)
    ours = _leaves(json.loads(_bytes(texts[0][: int(sizes[0].item())])))
    lines = []
    for r in differ:
        theirs = _leaves(json.loads(_bytes(texts[r][: int(sizes[r].item())])))
        fields = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        lines += [
            f"  rank {r} (host {answers[r][1]}): {k}: {ours.get(k)!r} (rank 0) -> {theirs.get(k)!r}" for k in fields
        ]
    raise ConfigError(
        "the trainer hosts train with different configs (each must read the same train_config.json, "
        "the run folder's, with no --set of its own):\n" + "\n".join(lines)
    )


def check_shared_folder(world: World, folder: Path, wait_s: float, field: str = "train.output_dir") -> None:
    """Every rank sees the file rank 0 writes in ``folder``; raise on every rank otherwise.

    The checkpoint is sharded (``torch.distributed.checkpoint``: each rank writes its own shard files into the
    folder rank 0 made and later renames), so with several trainer hosts ``train.output_dir`` must be one shared
    folder (an NFS or Lustre mount at the same path), else the first checkpoint fails or lacks shards. Rank 0 writes
    a file named by a random nonce; every rank looks for it (up to ``wait_s`` seconds: an NFS client may cache a
    missing name that long), and the ranks that miss it are named.

    Args:
        world: the joined process group; a one-rank world passes at once.
        folder: the folder that must be shared (made by rank 0 when missing).
        wait_s: seconds a rank keeps looking for the file (``train.shared_folder_wait_s``).
        field: its config path, for the message.

    Raises:
        ConfigError: on every rank when any rank does not see rank 0's file, naming the ranks and their hosts.
    """
    import time

    from grpo_core.errors import ConfigError

    if world.world_size == 1:
        return
    marker = None
    if world.is_main:
        nonce = secrets.token_bytes(16)
        folder.mkdir(parents=True, exist_ok=True)
        marker = folder / f".grpo-shared-{nonce.hex()}"
        marker.write_bytes(nonce)
    nonce = _from_main(world, 16, nonce if world.is_main else None)  # after the write: it exists on rank 0's side
    path, deadline = folder / f".grpo-shared-{nonce.hex()}", time.monotonic() + wait_s
    while True:
        try:
            seen = path.read_bytes() == nonce
        except OSError:
            seen = False
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    answers = _gather_with_hosts(world, bytes([seen]))
    if marker is not None:
        marker.unlink(missing_ok=True)
    missing = [f"rank {r} (host {h})" for r, (a, h) in enumerate(answers) if not a[0]]
    if missing:
        raise ConfigError(
            f"{field}={folder} is not one folder shared by every trainer host: {', '.join(missing)} "
            "does not see the file rank 0 wrote there. Each rank writes its own checkpoint shards into "
            f"it: mount one shared folder (NFS, Lustre, …) at the same path on every trainer host and "
            f"set {field} there"
        )


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
            data = np.frombuffer(rows[r].to_ipc(), dtype=np.uint8)
            dist.send(torch.tensor([data.size], dtype=torch.int64), r, group=world.control)
            dist.send(torch.from_numpy(data.copy()), r, group=world.control)
        return rows[0]
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, 0, group=world.control)
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(buf, 0, group=world.control)
    return PackedRow.from_ipc(buf.numpy().tobytes())
