"""Free loopback ports for servers that must know each other's address
before they start (replica sets: --replicas), for the Python tests."""

import random
import socket


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(n):
    """n distinct ports that were free a moment ago (all bound at once, so
    none is picked twice, then released for the servers). They are drawn
    below the kernel's ephemeral range: a port handed out for port 0 (every
    server's data plane listens there, every client connects from one)
    never lands on a port picked here between its release and the server's
    bind, as one did in a CI run."""
    lo, hi = _ephemeral_range()
    first = 10000 if lo > 12000 else 1024
    pool = list(range(first, lo)) or list(range(hi + 1, 65536))
    rng = random.SystemRandom()
    socks = []
    try:
        for _ in range(50 * n + 100):
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", rng.choice(pool)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise RuntimeError("found only %d free ports of %d outside the ephemeral range"
                               % (len(socks), n))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
