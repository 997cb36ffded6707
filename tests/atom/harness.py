"""Engines for the ATOM tests: each an ``engine.py`` process (ATOM's CoreManager, EngineCore
and TP workers) driven over JSON lines, and the checks every test makes at its end."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# Real models' config.json (no weights), shared with the vLLM suite.
MODELS = os.path.join(os.path.dirname(HERE), "vllm", "models")
sys.path.insert(0, os.path.dirname(HERE))
from ports import free_ports  # noqa: E402,F401  (re-exported to the tests)
SNAPSHOT_NAME = "atom-ffdf3bb5"
_ROOT: List[str] = []


def snapshot_archive() -> str:
    """The ATOM snapshot archive: ``KVLINK_ATOM_SNAPSHOT``, else the workplace's shared copy."""
    env = os.environ.get("KVLINK_ATOM_SNAPSHOT")
    if env:
        return env
    for base in (os.path.join(REPO, "..", "shared"), "/work/shared"):
        path = os.path.join(base, "third-party", SNAPSHOT_NAME + ".tar.gz")
        if os.path.exists(path):
            return os.path.abspath(path)
    raise RuntimeError(f"the ATOM snapshot {SNAPSHOT_NAME}.tar.gz is not found: set KVLINK_ATOM_SNAPSHOT")


def snapshot_root() -> str:
    """Where the snapshot is unpacked (once per process; the directory holding ``atom/``)."""
    if not _ROOT:
        dest = tempfile.mkdtemp(prefix="kvlink-atom-")
        with tarfile.open(snapshot_archive()) as t:
            t.extractall(dest, filter="data")
        inner = [d for d in os.listdir(dest) if os.path.isdir(os.path.join(dest, d, "atom"))]
        _ROOT.append(os.path.join(dest, inner[0]) if inner else dest)
    return _ROOT[0]


class Engine:
    """One ATOM engine process; ``role`` ``kv_producer``, ``kv_consumer`` or ``none``."""

    def __init__(self, tmp: str, name: str, role: str, model: str, tp: int = 1, port: int = 0, prefix: bool = False, env: Optional[Dict[str, str]] = None):
        self.name, self.events = name, queue.Queue()
        self.errors = os.path.join(tmp, f"{name}-kv-errors")
        os.makedirs(self.errors, exist_ok=True)
        self.log_path = os.path.join(tmp, f"{name}.log")
        e = dict(os.environ)
        e["PYTHONPATH"] = os.pathsep.join([snapshot_root(), HERE, e.get("PYTHONPATH", "")])
        e["KVLINK_ATOM_ERRORS"] = self.errors
        e.setdefault("KVLINK_LOG", "kvlink=info")
        e.update(env or {})
        argv = [sys.executable, os.path.join(HERE, "engine.py"), role, os.path.join(MODELS, model), str(tp), str(port)]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv + (["--prefix-cache"] if prefix else []), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=e, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.ids: Dict[str, int] = {}

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put({"event": "exit"})

    def _next(self, want: str, key: Optional[str], timeout: float) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                ev = self.events.get(timeout=max(left, 0.01))
            except queue.Empty:
                raise AssertionError(f"{self.name}: no {want} {key or ''} within {timeout} s; log {self.log_path}:\n{self.tail()}") from None
            if ev["event"] == "exit":
                raise AssertionError(f"{self.name} exited; log {self.log_path}:\n{self.tail()}")
            if ev["event"] == want and (key is None or ev.get("key") == key):
                return ev
            self._stash(ev)

    def _stash(self, ev: Dict[str, Any]) -> None:
        self.done = getattr(self, "done", {})
        if ev["event"] == "done":
            self.done[ev["key"]] = ev

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def ready(self, timeout: float = 180) -> "Engine":
        self._next("ready", None, timeout)
        return self

    def add(self, key: str, prompt: List[int], max_tokens: int, params: Optional[Dict[str, Any]] = None, dp_rank: Optional[int] = None) -> None:
        self.send(op="add", key=key, prompt=prompt, max_tokens=max_tokens, params=params, dp_rank=dp_rank)
        self.ids[key] = self._next("added", key, 30)["id"]

    def result(self, key: str, timeout: float = 60) -> Dict[str, Any]:
        done = getattr(self, "done", {})
        if key in done:
            return done.pop(key)
        return self._next("done", key, timeout)

    def abort(self, key: str) -> None:
        self.send(op="abort", key=key)

    def kv_errors(self) -> List[str]:
        out = []
        for f in sorted(os.listdir(self.errors)):
            with open(os.path.join(self.errors, f)) as fh:
                out += fh.read().splitlines()
        return out

    def kill(self) -> None:
        """SIGKILL to the whole engine (CoreManager, EngineCore and workers)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def quit(self) -> None:
        """Asks the engine to shut down (ATOM's ``CoreManager.close``); ``close`` waits for it."""
        if self.proc.poll() is None:
            try:
                self.send(op="quit")
            except OSError:
                pass

    def close(self) -> None:
        self.quit()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        self.log.close()


def close_all(*engines: Engine) -> None:
    """Shuts the engines down side by side (each takes seconds to stop its processes)."""
    for e in engines:
        e.quit()
    for e in engines:
        e.close()


def idle_all(*engines: Engine, timeout: float = 30) -> List[Dict[str, Any]]:
    """Waits until ATOM's own metrics show, on every DP rank of every engine, every block free
    and the connector waiting for nothing; returns each engine's DP rank 0 metrics. The engines
    are asked together: each answer waits for its next metrics push (every 5 s). Fails with
    the last metrics seen."""
    deadline, last = time.monotonic() + timeout, {}
    done: Dict[str, Dict[str, Any]] = {}
    while time.monotonic() < deadline and len(done) < len(engines):
        waiting = [e for e in engines if e.name not in done]
        for e in waiting:
            e.send(op="metrics")
        for e in waiting:
            ranks = e._next("metrics", None, 20)["metrics"]
            if all(m is not None for m in ranks):
                last[e.name] = ranks
                if all(_idle(m) for m in ranks):
                    done[e.name] = ranks[0]
    for e in engines:
        if e.name not in done:
            raise AssertionError(f"{e.name}: blocks or transfers still held after {timeout} s: {last.get(e.name)}\n{e.tail()}")
    return [done[e.name] for e in engines]


def _idle(m: Dict[str, Any]) -> bool:
    pending = any((m.get("offload") or {}).get("kvlink_pending", {}).values())
    return m["kv_blocks_used"] == 0 and m["kv_blocks_free"] == m["kv_blocks_total"] and not pending and m["requests_parked_kv_load"] == 0


def prompt(seed: int, length: int) -> List[int]:
    """A prompt of ``length`` tokens below ``kvmodel.VOCAB``."""
    rng = random.Random(seed)
    return [rng.randrange(3, 240) for _ in range(length)]
