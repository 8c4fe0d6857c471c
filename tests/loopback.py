"""A free TCP port on 127.0.0.1, for tests and benchmarks that start a server of their own."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the kernel just handed out on loopback (closed again, so a server can bind it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
