"""A port for a program that will listen on it later (the LLM-DataDist samples take
theirs as a number): one below the kernel's ephemeral range, free when chosen.

A port from bind(0) is an ephemeral one: between the choice and the program's own
bind, any outgoing connection on the host (torch.distributed's gloo opens many)
may take it as its local port, and the program fails with EADDRINUSE. Below the
ephemeral range only an explicit bind can take it.
"""

from __future__ import annotations

import random
import socket

__all__ = ["listen_port"]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def listen_port(host: str = "127.0.0.1") -> int:
    """A port in [10000, ephemeral low) that ``host`` can bind now."""
    low, high = 10000, _ephemeral_low()
    if high <= low + 100:             # an unusual range: fall back to the kernel's choice
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high}) on {host}")
