"""A free TCP port on loopback (local process groups: the launcher's rendezvous, explore's probe ranks)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the caller binds it soon after; a race with another process is
    possible but rare on one machine)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
