"""``python -m grpo_core.train.launch [torchrun arguments]``: torchrun whose stores listen on loopback only.

A single-node ``torchrun --standalone`` hosts two ``TCPStore`` servers (the c10d rendezvous store and
the store the ranks share), and ``TCPStore`` binds every interface (``::``) whatever host name it is
given, so anyone on the network could write into a run's rendezvous. Here both stores are created on
a socket bound to 127.0.0.1 and handed over with ``TCPStore(master_listen_fd=...)``, through a
rendezvous backend registered as ``grpo-loopback`` (torch.distributed.elastic's handler registry);
gloo binds loopback too (``GLOO_SOCKET_IFNAME=lo``). Everything else is torchrun's own code path.

Only single-node runs use this: a multi-node run needs its stores reachable from the other hosts and
keeps torchrun's own ``--rdzv-backend`` (call ``torch.distributed.run`` directly).

Example::

    python -m grpo_core.train.launch --nproc-per-node 2 -m grpo_core.train --config run.json
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler


BACKEND = "grpo-loopback"
LOOPBACK = "127.0.0.1"
_SOCKETS: list[socket.socket] = []


def loopback_store(timeout_s: float = 600.0) -> TCPStore:
    """A multi-tenant ``TCPStore`` server listening on 127.0.0.1 only (a free port)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    store = dist.TCPStore(
        LOOPBACK,
        sock.getsockname()[1],
        is_master=True,
        multi_tenant=True,
        master_listen_fd=sock.fileno(),
        timeout=timedelta(seconds=timeout_s),
    )
    _SOCKETS.append(sock)  # the listening socket must outlive the store (the process, here)
    return store


def _handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, create_handler

    class LoopbackHandler(DynamicRendezvousHandler):
        """torchrun's dynamic rendezvous, whose store for the ranks also listens on loopback only."""

        def _create_tcp_store_server(self, master_addr: str, master_port: int) -> TCPStore:  # noqa: ARG002 - torch's
            return loopback_store()

    store = loopback_store(float(params.get_as_int("read_timeout", 600)))
    handler = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    handler.__class__ = LoopbackHandler
    handler._backend_name = BACKEND  # noqa: SLF001 - torchrun checks the handler names the backend it asked for
    return handler


def torchrun_args(argv: list[str]) -> list[str]:
    """torchrun's arguments for a single-node run with the loopback rendezvous (``argv`` holds the rest)."""
    return [
        "--rdzv-backend",
        BACKEND,
        "--rdzv-endpoint",
        f"{LOOPBACK}:0",
        "--rdzv-id",
        uuid.uuid4().hex,
        "--local-addr",
        LOOPBACK,
        "--nnodes",
        "1",
        *argv,
    ]


def failure_lines(exc: ChildFailedError) -> list[str]:
    """One line per failed rank of torchrun's ``ChildFailedError``, instead of its traceback (frames of torchrun's
    launcher) and framed report: ``torchrun: rank R (pid P) exited with code C`` or, for a rank a signal ended,
    ``torchrun: rank R: Signal 9 (SIGKILL) received by PID P`` (torchrun's own words, which the flow reads)."""
    lines = []
    for rank, failure in sorted(exc.failures.items()):
        if failure.exitcode < 0:
            how = f"Signal {-failure.exitcode} ({failure.signal_name()}) received by PID {failure.pid}"
            lines.append(f"torchrun: rank {rank}: {how}")
        else:
            lines.append(f"torchrun: rank {rank} (pid {failure.pid}) exited with code {failure.exitcode}")
    return lines


def main(argv: list[str] | None = None) -> None:
    """Register the loopback rendezvous backend and run torchrun with it.

    Raises:
        SystemExit: code 1 when a rank failed, after one line per failed rank on stderr (:func:`failure_lines`;
            the rank's own traceback is in its output above and its error in the run folder's trainer_error.txt).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.run import main as torchrun

    rendezvous_handler_registry.register(BACKEND, _handler)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        torchrun(torchrun_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as exc:
        print("\n".join(failure_lines(exc)), file=sys.stderr, flush=True)  # noqa: T201 - the launcher's report
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
