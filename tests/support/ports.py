"""A loopback port that refuses connections for as long as a test needs it (issue 29: no port reuse races).

``grpo_core.run.children.free_port`` gives a port up again: another process (an xdist worker's server) may take it
before the test's "nothing listens here" URL is dialled. A socket bound but never listening holds the port for the
test, and the kernel answers a connection to it with a reset (ECONNREFUSED), as for a port nobody holds.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager


@contextmanager
def refusing_ports(count: int = 1, host: str = "127.0.0.1") -> Iterator[list[int]]:
    """Hold ``count`` TCP ports on ``host`` that refuse every connection until the block ends.

    Yields:
        list[int]: the ports, each bound (not listening) by a socket of this process until exit.
    """
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        yield ports
