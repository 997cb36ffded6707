"""Ports for the listeners the Python tests start in other processes (SGLang's bootstrap
server, a torch TCP store, an events publisher, an index service), where the port has to be
chosen before the listener binds it.

Asking the kernel for port 0 and closing the socket hands out a port from the ephemeral range,
the same range every outgoing connection on the machine draws its local port from: under a
busy test run one of those takes it before the listener binds (EADDRINUSE). These ports are
drawn at random from below the ephemeral range instead, where no outgoing connection lands, and
each is checked by binding it without SO_REUSEADDR on every address, which also fails while
an earlier connection on it lingers in TIME_WAIT.

A free port stays free until its listener binds it, and test processes running side by side
draw from the same range (the SGLang bootstrap server's port, drawn by the test, was once
taken by a port the prefill drew for its HTTP API before the server bound it). So each port
handed out is also claimed in a file every process on the machine sees, and no process is
handed it again for the next ten minutes (``_claim``)."""

from __future__ import annotations

import os
import random
import socket
import shutil
import tempfile
import time

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


# How long a port handed out is not handed out again, in seconds.
CLAIM_S = 600
_CLAIMS = os.path.join(tempfile.gettempdir(), "kvlink-test-ports")


def _claim(port: int) -> bool:
    """Claims ``port`` for this process unless a process claimed it in this ten-minute slot
    or the one before. A claim is a file created exclusively in the slot's folder; slots
    older than that are removed, so nothing is ever reclaimed in place (no race)."""
    slot = int(time.time()) // CLAIM_S
    for past in (slot - 1, slot):
        if os.path.exists(os.path.join(_CLAIMS, str(past), str(port))):
            return False
    folder = os.path.join(_CLAIMS, str(slot))
    os.makedirs(folder, exist_ok=True)
    try:
        os.close(os.open(os.path.join(folder, str(port)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    for name in os.listdir(_CLAIMS):
        if name.isdigit() and int(name) < slot - 1:
            shutil.rmtree(os.path.join(_CLAIMS, name), ignore_errors=True)
    return True


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
        ports = range(base, base + count)
        if all(_is_free(p) for p in ports) and all(_claim(p) for p in ports):
            return base
    raise RuntimeError(f"no {count} free consecutive ports between {FLOOR} and {top}")


def free_port() -> int:
    """A free port below the ephemeral range."""
    return free_ports(1)
