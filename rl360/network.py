"""Host networking helpers."""

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port free on every address of this host right now (a server binds all of them, so a port free only
    on 127.0.0.1 is not enough), chosen below the kernel's ephemeral range when it can be: outgoing connections
    (Ray's, gloo's) take their ports from that range and could take this one before its server binds it."""
    first_ephemeral = _ephemeral_range()[0]
    for _ in range(100):
        port = random.randint(10000, first_ephemeral - 1) if first_ephemeral > 10001 else 0
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999
