"""What the SGLang backend's tests share: ``run_pair`` (one prefill and one decode side, a
process per rank, each with SGLang's real queues and KV pool: ``sglang_side.py``) and ``Pair``
(a prefill and a decode manager in this process over numpy memory, with a bootstrap server),
and the helpers around them."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import select
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from types import SimpleNamespace as NS
from typing import Any, Dict, List, Optional, Tuple

import numpy as np


HERE = os.path.dirname(os.path.abspath(__file__))
SIDE = os.path.join(HERE, "sglang_side.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from ports import free_port  # noqa: E402  (re-exported to the tests)
# Every side process is forked from one server process that has imported torch and the SGLang
# modules a side uses (multiprocessing's forkserver): each side still gets a process of its
# own, fresh from those imports, without paying them again. The server imports nothing of
# kvlink, loads no plugin and makes no process group: all of that happens after the fork, as
# it did in a process of its own. SGLang reads its settings (``envs``) when it uses them, so
# each side's environment, set after the fork, is what it sees. A module missing from a
# release is skipped by the server's import.
PRELOAD = [
    "sglang_side",
    "sglang.srt.server_args",
    "sglang.srt.configs.model_config",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.disaggregation.utils",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.runtime_context",
]


def _context() -> Any:
    """The forkserver context, preloading ``PRELOAD`` (once per test process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _side_main(role: str, plan: str, rank: int, env: Dict[str, str], out: Connection, err: Connection) -> None:
    """A side process: its output to the pipes it was given, its environment, then
    ``sglang_side``'s prefill or decode, as ``python sglang_side.py ROLE PLAN RANK`` runs it."""
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [SIDE, role, plan, str(rank)]
    import sglang_side

    try:
        (sglang_side.run_prefill if role == "prefill" else sglang_side.run_decode)(json.loads(plan), rank)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


class Side:
    """One side's process, forked from the preloaded server, read as a ``subprocess.Popen``
    with text pipes is: ``stdout``, ``poll``, ``communicate``, ``kill``, ``returncode``."""

    def __init__(self, role: str, plan: str, rank: int, env: Dict[str, str]):
        r_out, w_out = os.pipe()
        r_err, w_err = os.pipe()
        out, err = Connection(w_out), Connection(w_err)
        try:
            self.proc = _context().Process(target=_side_main, args=(role, plan, rank, env, out, err))
            self.proc.start()
        finally:
            out.close()
            err.close()
        self.stdout = os.fdopen(r_out, "r")
        self.stderr = os.fdopen(r_err, "r")

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.exitcode

    def poll(self) -> Optional[int]:
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def communicate(self, timeout: float) -> Tuple[str, str]:
        """Everything the process writes until it exits, as ``Popen.communicate`` returns it;
        ``subprocess.TimeoutExpired`` when its pipes are still open after ``timeout``."""
        texts: Dict[str, str] = {}

        def drain(name: str, f: Any) -> None:
            texts[name] = f.read()

        readers = [threading.Thread(target=drain, args=(n, f), daemon=True)
                   for n, f in (("out", self.stdout), ("err", self.stderr))]
        for t in readers:
            t.start()
        end = time.monotonic() + timeout
        for t in readers:
            t.join(max(0.0, end - time.monotonic()))
        if any(t.is_alive() for t in readers):
            raise subprocess.TimeoutExpired(SIDE, timeout)
        self.proc.join(max(1.0, end - time.monotonic()))
        return texts["out"], texts["err"]


def lines(text: str) -> List[Dict[str, Any]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def run_pair(requests: List[Dict[str, Any]], decode_env: Optional[Dict[str, str]] = None,
             deadline: float = 60, prefill: Optional[Dict[str, int]] = None,
             decode: Optional[Dict[str, int]] = None, prefill_env: Optional[Dict[str, str]] = None,
             decode_dies: bool = False, model: str = "llama-3.1-8b") -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any],
                                                 Dict[str, Any], int]:
    """Runs both sides to the end, each ``{"tp": ranks, "dp": DP attention ranks}`` (one rank
    by default), a process per rank; returns (prefill ends, prefill summary, decode ends,
    decode summary, prefill rank 0's exit code), ends keyed by request id and merged over the
    ranks (the first rank's failure wins), summaries added up over the ranks."""
    prefill, decode = prefill or {"tp": 1}, decode or {"tp": 1}
    plan = json.dumps({"bootstrap_port": free_port(), "requests": requests, "deadline": deadline,
                       "prefill": prefill, "decode": decode, "model": model,
                       "master_ports": {"prefill": free_port(), "decode": free_port()}})
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}

    def start(role, rank, extra):
        return Side(role, plan, rank, {**env, **extra})

    ps = [start("prefill", r, prefill_env or {}) for r in range(prefill["tp"])]
    ds: List[Side] = []
    try:
        # The decode starts once the prefill is up, as a deployment's would: SGLang's decode
        # gives a prefill 15 s to register, which a cold start on a busy machine can exceed.
        firsts = [ready_line(p, 120) for p in ps]
        ds = [start("decode", r, decode_env or {}) for r in range(decode["tp"])]
        d_io = [d.communicate(timeout=deadline + 90) for d in ds]
        # The prefill ends by its own deadline, saying which requests did not finish.
        p_io = [(first + out, err) for first, (out, err) in zip(firsts, (p.communicate(timeout=deadline + 30)
                                                                          for p in ps))]
    finally:
        for p in ps + ds:
            if p.poll() is None:
                p.kill()
    for role, io in (("decode", d_io), ("prefill", p_io)):
        for out, err in io:
            ls = lines(out)
            assert ls and ls[0].get("ready"), f"{role} did not start:\n{err[-3000:]}"
            assert ls[0]["backend"] == "KvlinkKVManager"
    p_ends, p_sum = merge([lines(out) for out, _ in p_io])
    d_ends, d_sum = merge([lines(out) for out, _ in d_io])
    assert d_sum is not None or decode_dies, f"decode did not finish:\n{d_io[0][1][-3000:]}"
    assert p_sum is not None or ps[0].returncode != 0, f"prefill did not finish:\n{p_io[0][1][-3000:]}"
    return p_ends, p_sum, d_ends, d_sum, ps[0].returncode


def ready_line(p: Side, limit: float) -> str:
    """The first line ``p`` prints (its ``ready`` line), or "" once it exits or ``limit``
    seconds pass."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        ready, _, _ = select.select([p.stdout], [], [], 0.5)
        if ready:
            return p.stdout.readline()
        if p.poll() is not None:
            return ""
    return ""


def merge(ranks: List[List[Dict[str, Any]]]) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """One side's outcomes over its ranks: per request the first rank's failure, else its
    success (with ``bytes_ok`` and ``first_token_ok`` true only when true on every rank);
    summaries added up (numbers summed, flags and-ed, stats summed per key)."""
    ends: Dict[str, Any] = {}
    summary: Optional[Dict[str, Any]] = None
    for ls in ranks:
        for d in ls:
            if "rid" in d:
                old = ends.get(d["rid"])
                if old is None or (old["end"] == "ok" and d["end"] != "ok"):
                    ends[d["rid"]] = dict(d)
                elif d["end"] == "ok":
                    for k in ("bytes_ok", "first_token_ok"):
                        old[k] = old.get(k, True) and d.get(k, True)
            elif "summary" in d:
                summary = d["summary"] if summary is None else _add(summary, d["summary"])
    return ends, summary


def _add(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    for k, v in a.items():
        w = b.get(k)
        out[k] = _add(v, w) if isinstance(v, dict) else (v and w) if isinstance(v, bool) else v + w
    return out


def mixed_requests(seed: int, count: int) -> List[Dict[str, Any]]:
    rng = random.Random(seed)
    return [{"rid": f"r{i}", "room": 2000 + rng.randint(0, 1 << 30) * 4 + i, "n": rng.randint(1, 400),
             "chunk": 16 * rng.randint(1, 6)} for i in range(count)]


def assert_all_arrived(reqs, p_ends, p_sum, d_ends, d_sum):
    for r in reqs:
        d = d_ends[r["rid"]]
        assert d["end"] == "ok" and d["bytes_ok"] and d["first_token_ok"], d
        assert p_ends[r["rid"]]["end"] == "ok", p_ends[r["rid"]]
    assert p_sum["held"] == 0 and p_sum["senders"] == 0, p_sum
    assert d_sum["receiving"] == 0 and d_sum["receivers"] == 0 and d_sum["free_pages_back"], d_sum
    assert p_sum["bad_messages"] == d_sum["bad_messages"] == 0
    assert p_sum["stats"]["sends_failed"] == d_sum["stats"]["reads_failed"] == 0


PEER_GONE = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "300", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "300",
             "KVLINK_PEER_TIMEOUT": "2"}


def kv_args(pages: int, states: List[Tuple[int, int]], seed: Optional[int], item: int = 64):
    """SGLang's KVArgs over numpy buffers: 4 KV buffers (2 layers x K/V) of ``item``-byte pages,
    3 aux buffers of rows, and one buffer per state type (rows of the given size)."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    rng = np.random.default_rng(seed)

    def buf(n: int) -> np.ndarray:
        return rng.integers(0, 256, n, dtype=np.uint8) if seed is not None else np.zeros(n, np.uint8)

    a = KVArgs()
    keep = []
    kv = [buf(pages * item) for _ in range(4)]
    aux = [buf(32 * 8), buf(32 * 4), buf(32 * 16)]
    st = [[buf(s[0] * s[1])] for s in states]
    keep += kv + aux + [b for s in st for b in s]
    a.engine_rank, a.page_size, a.kv_cache_dtype_str, a.kv_layout = 0, 16, "uint8", None
    a.kv_data_ptrs = [b.ctypes.data for b in kv]
    a.kv_data_lens = [b.nbytes for b in kv]
    a.kv_item_lens = [item] * 4
    a.aux_data_ptrs = [b.ctypes.data for b in aux]
    a.aux_data_lens = [b.nbytes for b in aux]
    a.aux_item_lens = [8, 4, 16]
    a.state_types = [s[2] if len(s) > 2 else "mamba" for s in states]
    a.state_data_ptrs = [[b.ctypes.data for b in s] for s in st]
    a.state_data_lens = [[b.nbytes for b in s] for s in st]
    a.state_item_lens = [[s[1]] for s in states]
    a.ib_device, a.gpu_id, a.system_dp_rank = None, 0, 0
    return a, (kv, aux, st), keep


def pump_until(cond, polls, limit=20.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        for p in polls:
            p()
        if cond():
            return True
        time.sleep(0.005)
    return False


class Pair:
    """A prefill and a decode manager in this process, with a bootstrap server."""

    def __init__(self, pages: int, states=(), item: int = 64, sa_extra=None, ib_device=None):
        import kvlink.sglang as ks
        from sglang.srt.disaggregation.utils import DisaggregationMode

        self.ks = ks
        port = free_port()
        self.server = ks.KvlinkBootstrapServer("127.0.0.1", port)
        sa = NS(host="127.0.0.1", disaggregation_bootstrap_port=port, dp_size=1, **(sa_extra or {}))
        self.pa, (self.p_kv, _, self.p_st), self._pk = kv_args(pages, list(states), seed=5, item=item)
        self.da, (self.d_kv, _, self.d_st), self._dk = kv_args(pages, list(states), seed=None, item=item)
        self.pa.ib_device = self.da.ib_device = ib_device
        self.pm = ks.KvlinkKVManager(self.pa, DisaggregationMode.PREFILL, sa)
        self.dm = ks.KvlinkKVManager(self.da, DisaggregationMode.DECODE, sa)
        self.addr = f"127.0.0.1:{port}"
        assert pump_until(lambda: self.dm.try_ensure_parallel_info(self.addr), [])

    def start(self, room: int, local_pages, num_pages: Optional[int] = None, state_indices=()):
        from sglang.srt.disaggregation.base.conn import KVPoll

        s = self.ks.KvlinkKVSender(self.pm, self.addr, room)
        r = self.ks.KvlinkKVReceiver(self.dm, self.addr, room)
        r.init(0)
        r.send_metadata(np.array(local_pages, np.int32), aux_index=0, state_indices=list(state_indices),
                        decode_prefix_len=0)
        assert pump_until(lambda: s.poll() == KVPoll.WaitingForInput, [])
        s.init(len(local_pages) if num_pages is None else num_pages, aux_index=0)
        return s, r

    def close(self):
        self.pm.close()
        self.dm.close()
        self.server.close()
