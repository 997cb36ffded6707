"""Ports for the listeners the Python tests start in other processes (SGLang's bootstrap
server, a torch TCP store, an events publisher, an index service), where the port has to be
chosen before the listener binds it.

Asking the kernel for port 0 and closing the socket hands out a port from the ephemeral range,
the same range every outgoing connection on the machine draws its local port from: under a
busy test run one of those takes it before the listener binds (EADDRINUSE). These ports are
drawn at random from below the ephemeral range instead, where no outgoing connection lands, and
each is checked by binding it without SO_REUSEADDR on every address, which also fails while
an earlier connection on it lingers in TIME_WAIT."""

from __future__ import annotations

import random
import socket

# The lowest port handed out; the default ephemeral range starts at 32768.
FLOOR = 20000
# From the OS, not the module's generator: processes forked from one parent share its state.
_RANDOM = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive free ports below the ephemeral range."""
    top = max(_ephemeral_low(), FLOOR + 1000)
    for _ in range(1000):
        base = _RANDOM.randrange(FLOOR, top - count)
        if all(_is_free(p) for p in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} free consecutive ports between {FLOOR} and {top}")


def free_port() -> int:
    """A free port below the ephemeral range."""
    return free_ports(1)
