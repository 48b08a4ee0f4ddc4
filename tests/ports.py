"""Ports for the tests' launches, shared by the Python tests."""
import os
import random
import socket
import time


def free_port_pair():
    """A port p with p and p + 1 free (ptrun's agent store moves the programs' store to
    MASTER_PORT + 1), below the kernel's ephemeral range, so that the outgoing
    connections of tests running beside this one cannot take either between this
    check and the launcher's bind."""
    lo = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 12000), lo - 1)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports below the ephemeral range")
