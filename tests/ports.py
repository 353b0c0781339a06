"""Free TCP ports on the loopback for the servers the tests start (Ray, MLflow, SLURM daemons)."""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports nothing listens on now.

    The sockets stay bound until all are chosen: asked one at a time, the kernel may hand a port
    it just released out again (a Ray head once got the same port for its dashboard and for
    another of its components, and refused to start).
    """
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def free_port() -> int:
    return free_ports(1)[0]
