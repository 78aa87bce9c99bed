"""Free TCP ports for the lab's own servers (the coordinator, its shards, PostgreSQL)."""
from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A free TCP port between Ray's worker ports (10002-19999) and the job's store (29500): one
    the kernel hands out (bind to 0) can be taken by Ray's own connections before the server
    that is given it binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):  # bounded: a busy host still leaves most of these free
        port = rng.randrange(20000, max(20001, min(low, 29000)))
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free TCP port for the lab's servers between 20000 and 29000")
