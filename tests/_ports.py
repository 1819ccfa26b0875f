"""Free TCP ports for the servers that tests start, from the range kept for KV events and metrics
(27200-27299), so that tests never collide with the tier servers (27100-27199) and two test runs on one
machine (or a lingering socket) do not take the same port: each call returns a port nobody is bound to and
that this process has not handed out before."""

from __future__ import annotations

import os
import socket

RANGE = range(27200, 27300)
_handed_out: set[int] = set()


def free_port() -> int:
    """A port of :data:`RANGE` that is free now (scanning from an offset that differs between processes)."""
    start = os.getpid() % len(RANGE)
    for k in range(len(RANGE)):
        port = RANGE[(start + k) % len(RANGE)]
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {RANGE.start}-{RANGE.stop - 1}")


def tcp(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"
