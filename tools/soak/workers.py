"""The soak's worker processes (tools/kvlink-soak): started, spoken to, killed, stopped and
resumed, and measured from /proc."""

import json
import os
import random
import signal
import socket
import subprocess
import threading
import time


def rdma_resources():
    """Queue pairs and registered bytes per task, from the kernel's RDMA resource tracking
    (`rdma -j res show qp|mr`; inside the SoftRoCE VM, as root). The kernel records the
    thread that created each (a tokio worker for a queue pair): `Worker.tasks` maps them to
    their process. Kernel-owned entries (no pid) are left out. Empty when unavailable."""
    out: dict = {}
    for what, key in (("qp", "qps"), ("mr", "mr_bytes")):
        try:
            res = subprocess.run(
                ["rdma", "-j", "res", "show", what], capture_output=True, text=True, timeout=5, check=False
            )
            rows = json.loads(res.stdout or "[]")
        except (OSError, ValueError, subprocess.TimeoutExpired):
            continue
        for row in flatten(rows):
            pid = row.get("pid")
            if pid is None:
                continue
            entry = out.setdefault(pid, {"qps": 0, "mr_bytes": 0})
            entry[key] += 1 if key == "qps" else int(row.get("mrlen", 0))
    return out


def flatten(rows):
    """The objects of `rdma -j` output, whatever lists they come in."""
    if isinstance(rows, dict):
        yield rows
    elif isinstance(rows, list):
        for r in rows:
            yield from flatten(r)


# From the OS: the soak's own generator is seeded for replay, and must not decide ports.
_RANDOM = random.SystemRandom()


def free_port(host="127.0.0.1"):
    """A port nothing listens on now (the engine binds it with SO_REUSEADDR, so that a prefill
    restarted on it gets it back). Drawn at random from below the ephemeral range, where no
    outgoing connection of a busy machine takes it before the engine binds it (a port from
    bind(0) is in that range), and checked by binding it without SO_REUSEADDR."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(1000):
        port = _RANDOM.randrange(20000, max(low, 21000))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port on {host} between 20000 and {low}")


class Worker:
    """One kvlink-soak process. Its events go to `sink(t, name, life, event)` from a reader
    thread; `life` counts its restarts, so events of a killed life can be told apart."""

    def __init__(self, name, binary, args, sink, logdir):
        self.name = name
        self.binary = binary
        self.args = list(args)
        self.sink = sink
        self.logdir = logdir
        self.life = 0
        self.proc: subprocess.Popen | None = None
        self.addr = None
        self.engine = None
        self.stopped = False
        self.killed = False
        self.ready = threading.Event()

    def start(self, timeout=20.0):
        """Starts a new life and waits for its `ready` event."""
        self.life += 1
        self.ready.clear()
        self.stopped = False
        self.killed = False
        err = open(os.path.join(self.logdir, f"{self.name}.{self.life}.log"), "wb")
        # Each life is another engine to its peers, as a restarted process is.
        engine_id = f"{self.name}.{self.life}"
        self.proc = subprocess.Popen(
            [self.binary, *self.args, "--engine-id", engine_id],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            bufsize=0,
        )
        err.close()
        threading.Thread(target=self._read, args=(self.proc, self.life), daemon=True).start()
        if not self.ready.wait(timeout):
            raise RuntimeError(f"{self.name} did not start within {timeout} s (see its log)")

    def _read(self, proc, life):
        for raw in proc.stdout:
            t = time.monotonic()
            try:
                ev = json.loads(raw)
            except ValueError:
                ev = {"ev": "garbage", "line": raw[:200].decode("utf-8", "replace")}
            if ev.get("ev") == "ready":
                self.addr, self.engine = ev["addr"], ev["engine"]
                self.ready.set()
            self.sink(t, self.name, life, ev)

    def send(self, **cmd):
        """Sends a command; False when the process is gone."""
        proc = self._live()
        if proc is None or proc.stdin is None:
            return False
        try:
            proc.stdin.write((json.dumps(cmd) + "\n").encode())
            return True
        except (BrokenPipeError, OSError):
            return False

    def alive(self):
        return self._live() is not None

    def _live(self) -> subprocess.Popen | None:
        """The process while it runs, else None."""
        return self.proc if self.proc is not None and self.proc.poll() is None else None

    def kill(self):
        """SIGKILL, as a crash; waits for the process to be gone."""
        self.killed = True
        proc = self._live()
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self):
        proc = self._live()
        if proc is not None:
            proc.send_signal(signal.SIGSTOP)
            self.stopped = True

    def resume(self):
        proc = self._live()
        if proc is not None:
            proc.send_signal(signal.SIGCONT)
        self.stopped = False

    def close(self, timeout=5.0):
        """Asks the worker to exit; kills it if it does not."""
        self.killed = True
        proc = self._live()
        if proc is None:
            return
        self.resume()
        self.send(op="exit")
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout)
        except (subprocess.TimeoutExpired, OSError):
            self.kill()

    def tasks(self):
        """The thread ids of the process (its pid among them)."""
        if self.proc is None:
            return set()
        try:
            return {int(t) for t in os.listdir(f"/proc/{self.proc.pid}/task")}
        except OSError:
            return set()

    def sample(self):
        """fds, threads and anonymous resident memory (KiB) of the process, or None."""
        proc = self._live()
        if proc is None:
            return None
        pid = proc.pid
        try:
            fds = len(os.listdir(f"/proc/{pid}/fd"))
            status = {}
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    status[k] = v.strip()
            return {
                "fds": fds,
                "threads": int(status.get("Threads", "0")),
                "rss_anon_kib": int(status.get("RssAnon", "0 kB").split()[0]),
            }
        except (OSError, ValueError):
            return None
