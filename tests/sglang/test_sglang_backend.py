"""kvlink's SGLang backend driven by SGLang's own queues and state machine (SGLang 0.5.23 from
PyPI, installed by tools/test.sh): a prefill process and a decode process, each with SGLang's
real scheduler queues, KV pool and metadata buffers on CPU, the backend loaded by SGLang's
plugin loader from kvlink's entry point. Every byte the decode receives is checked, and the
first output token travels in SGLang's aux (metadata) row."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from types import SimpleNamespace as NS
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SIDE = os.path.join(HERE, "sglang_side.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lines(text: str) -> List[Dict[str, Any]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def run_pair(requests: List[Dict[str, Any]], decode_env: Optional[Dict[str, str]] = None,
             deadline: float = 60, prefill: Optional[Dict[str, int]] = None,
             decode: Optional[Dict[str, int]] = None) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any],
                                                              Dict[str, Any], int]:
    """Runs both sides to the end, each ``{"tp": ranks, "dp": DP attention ranks}`` (one rank
    by default), a process per rank; returns (prefill ends, prefill summary, decode ends,
    decode summary, prefill rank 0's exit code), ends keyed by request id and merged over the
    ranks (the first rank's failure wins), summaries added up over the ranks."""
    prefill, decode = prefill or {"tp": 1}, decode or {"tp": 1}
    plan = json.dumps({"bootstrap_port": free_port(), "requests": requests, "deadline": deadline,
                       "prefill": prefill, "decode": decode,
                       "master_ports": {"prefill": free_port(), "decode": free_port()}})
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}

    def start(role, rank, extra):
        return subprocess.Popen([sys.executable, SIDE, role, plan, str(rank)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**env, **extra})

    ps = [start("prefill", r, {}) for r in range(prefill["tp"])]
    ds = [start("decode", r, decode_env or {}) for r in range(decode["tp"])]
    try:
        d_io = [d.communicate(timeout=deadline + 90) for d in ds]
        p_io = [p.communicate(timeout=30) for p in ps]
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
    assert d_sum is not None, f"decode did not finish:\n{d_io[0][1][-3000:]}"
    return p_ends, p_sum, d_ends, d_sum, ps[0].returncode


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


def test_chunked_prefill_every_byte_and_the_aux_row_arrive():
    rng = random.Random(16)
    reqs = []
    for i in range(16):
        # Page edges first, then random lengths: most are prefilled in several chunks.
        n = [1, 15, 16, 17][i] if i < 4 else rng.randint(2, 600)
        reqs.append({"rid": f"r{i}", "room": 1000 + rng.randint(0, 1 << 40) * 8 + i, "n": n,
                     "chunk": 16 * rng.randint(1, 8)})
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs)
    chunked = 0
    for r in reqs:
        d = d_ends[r["rid"]]
        assert d["end"] == "ok", d
        assert d["bytes_ok"], d
        assert d["first_token_ok"], f"the aux row did not carry the first token: {d}"
        assert p_ends[r["rid"]]["end"] == "ok", p_ends[r["rid"]]
        chunked += r["n"] > r["chunk"]
    assert chunked >= 5, "the plan must chunk several prefills"
    # Nothing held or read any more; the decode's pages all came back.
    assert p_sum["held"] == 0 and p_sum["senders"] == 0, p_sum
    assert d_sum["receiving"] == 0 and d_sum["receivers"] == 0 and d_sum["free_pages_back"], d_sum
    assert p_sum["bad_messages"] == d_sum["bad_messages"] == 0
    # One want per request, one chunk message per chunk; every hold confirmed.
    assert p_sum["stats"]["messages_received"] == len(reqs)
    assert d_sum["stats"]["messages_received"] == p_sum["stats"]["messages_sent"] >= len(reqs) + chunked
    assert p_sum["stats"]["sends_failed"] == d_sum["stats"]["reads_failed"] == 0
    assert d_sum["stats"]["reads_done"] == p_sum["stats"]["sends_done"]


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


@pytest.mark.parametrize("prefill,decode", [({"tp": 1}, {"tp": 2}), ({"tp": 2}, {"tp": 1}), ({"tp": 2}, {"tp": 2})],
                         ids=["tp1-to-tp2", "tp2-to-tp1", "tp2-to-tp2"])
def test_attention_tp_sizes_pair_by_head(prefill, decode):
    """Llama 3.1 8B's 8 KV heads: a decode rank of TP 2 reads its 4 heads of the one prefill
    rank's 8; a decode rank of TP 1 reads 4 heads from each of two prefill ranks, side by side
    in its pages. Each decode rank checks every byte of its own heads, and the first token
    (the aux row) arrives on every rank."""
    reqs = mixed_requests(7, 8)
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs, prefill=prefill, decode=decode)
    assert_all_arrived(reqs, p_ends, p_sum, d_ends, d_sum)
    # Every prefill rank's hold was confirmed by each decode rank that read it.
    assert d_sum["stats"]["reads_done"] * max(1, prefill["tp"] // decode["tp"]) == p_sum["stats"]["sends_done"]


@pytest.mark.parametrize("decode", [{"tp": 2, "dp": 2}, {"tp": 1}], ids=["to-dp2", "to-tp1"])
def test_dp_attention_routes_each_room_to_its_prefill_dp_rank(decode):
    """A prefill of two DP attention ranks (attention TP 1 each), rooms routed by bootstrap
    room as SGLang's router does (room % 2): each decode rank finds a room's prefill through
    the bootstrap server's DP group of it, whichever decode DP rank took it."""
    reqs = mixed_requests(11, 8)
    assert {r["room"] % 2 for r in reqs} == {0, 1}
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs, prefill={"tp": 2, "dp": 2}, decode=decode)
    assert_all_arrived(reqs, p_ends, p_sum, d_ends, d_sum)


def test_aborts_on_either_side_end_both_sides_with_the_reason():
    reqs = [
        {"rid": "ok1", "room": 501, "n": 100, "chunk": 32},
        {"rid": "prefill-abort", "room": 502, "n": 64, "abort_in_bootstrap": True},
        {"rid": "decode-abort", "room": 503, "n": 800, "chunk": 16, "abort_after_first_chunk": True},
        {"rid": "ok2", "room": 504, "n": 33, "chunk": 16},
    ]
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs)
    for rid in ("ok1", "ok2"):
        assert d_ends[rid]["end"] == "ok" and d_ends[rid]["bytes_ok"], d_ends[rid]
    # The prefill aborted in its bootstrap queue: the decode fails it, saying so.
    assert "Abort" in p_ends["prefill-abort"]["end"], p_ends["prefill-abort"]
    assert "prefill aborted" in d_ends["prefill-abort"]["end"], d_ends["prefill-abort"]
    # The decode aborted mid-transfer: its reads stop, the prefill fails the room and frees it.
    assert "Abort" in d_ends["decode-abort"]["end"], d_ends["decode-abort"]
    assert "decode aborted" in p_ends["decode-abort"]["end"], p_ends["decode-abort"]
    assert p_sum["held"] == 0 and p_sum["senders"] == 0, p_sum
    assert d_sum["receiving"] == 0 and d_sum["free_pages_back"], d_sum


def test_a_stale_read_fails_the_room_and_is_never_decoded_from():
    """The prefill's hold of a chunk ends and the chunk's id is held again (a new hold, a new
    token) before the decode reads it: the read names the old hold's token, so although its
    bytes arrive, the prefill refuses its confirmation; the decode fails the room (SGLang's
    answer to a failed transfer), tells the prefill, and gives its pages back. The other room
    is untouched."""
    reqs = [
        {"rid": "stale", "room": 611, "n": 96, "chunk": 32, "rehold_after_first_chunk": True},
        {"rid": "fine", "room": 612, "n": 40, "chunk": 16},
    ]
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs)
    assert d_ends["fine"]["end"] == "ok" and d_ends["fine"]["bytes_ok"], d_ends["fine"]
    end = d_ends["stale"]["end"]
    assert end != "ok" and "unconfirmed" in end and "another hold" in end, end
    assert p_ends["stale"]["end"] != "ok", p_ends["stale"]
    assert p_sum["held"] == 0 and p_sum["senders"] == 0, p_sum
    assert d_sum["receiving"] == 0 and d_sum["free_pages_back"], d_sum


def test_a_retracted_request_goes_back_to_its_prefill_and_is_read_again():
    """SGLang's decode retracts a request (``add(req, is_rebootstrap=True)``): its new receiver
    asks the prefill again and ``submit_prefill_recompute`` posts SGLang's ``/generate`` body to
    the prefill's HTTP port (registered with the bootstrap server), which computes the prompt
    again and sends its KV; every byte checked. A prefill that refuses the post fails the room
    at once, not at the waiting timeout."""
    reqs = [
        {"rid": "retracted", "room": 621, "n": 80, "chunk": 32, "rebootstrap": True},
        {"rid": "refused", "room": 622, "n": 40, "chunk": 16, "rebootstrap": True, "recompute_fails": True},
        {"rid": "plain", "room": 623, "n": 33, "chunk": 16},
    ]
    start = time.monotonic()
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs, decode_env={"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60"})
    for rid in ("retracted", "plain"):
        assert d_ends[rid]["end"] == "ok" and d_ends[rid]["bytes_ok"], d_ends[rid]
        assert d_ends[rid]["first_token_ok"], d_ends[rid]
    assert "/generate answered 500" in d_ends["refused"]["end"], d_ends["refused"]
    assert time.monotonic() - start < 40, "failed at once, not at the 60 s waiting timeout"
    assert p_sum["generate_posts"] == 2, p_sum
    assert p_sum["held"] == 0 and p_sum["senders"] == 0, p_sum
    assert d_sum["receiving"] == 0 and d_sum["free_pages_back"], d_sum


def test_a_bootstrap_address_that_does_not_speak_http_answers_nothing():
    """A wrong bootstrap port (another service answering) is "no answer yet" to the decode's
    lookups, not an exception in SGLang's scheduler."""
    import threading

    from kvlink.sglang import bootstrap

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)

        def answer():
            c, _ = srv.accept()
            with c:
                c.recv(1024)
                c.sendall(b"SSH-2.0-not-http\r\n")

        threading.Thread(target=answer, daemon=True).start()
        assert bootstrap.get(f"127.0.0.1:{srv.getsockname()[1]}", "/kvlink/info") is None


def test_a_dead_prefill_fails_the_decode_within_its_waiting_timeout():
    reqs = [{"rid": "orphan", "room": 777, "n": 300, "chunk": 32, "die_after_first_chunk": True}]
    start = time.monotonic()
    p_ends, _, d_ends, d_sum, code = run_pair(reqs, decode_env={"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "3"},
                                              deadline=40)
    assert code == 3, "the prefill was to die after its first chunk"
    end = d_ends["orphan"]["end"]
    assert "no KV chunk" in end or "connection" in end or "peer" in end, end
    assert time.monotonic() - start < 60
    assert d_sum["receiving"] == 0 and d_sum["free_pages_back"], d_sum


def test_the_backend_is_registered_through_sglangs_plugin_loader():
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "kvlink"]
    assert eps and eps[0].value == "kvlink.sglang:install"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation import decode, prefill, utils
    from sglang.srt.managers import disagg_service

    import kvlink.sglang as ks

    ours = utils.TransferBackend("kvlink")
    assert ours not in list(utils.TransferBackend), "SGLang's own members are unchanged"
    assert "kvlink" in DISAGG_TRANSFER_BACKEND_CHOICES
    for module in (utils, prefill, decode, disagg_service):
        assert module.get_kv_class(ours, utils.KVClassType.SENDER) is ks.KvlinkKVSender
        assert module.get_kv_class(ours, utils.KVClassType.RECEIVER) is ks.KvlinkKVReceiver
        assert module.get_kv_class(ours, utils.KVClassType.MANAGER) is ks.KvlinkKVManager
        assert module.get_kv_class(utils.TransferBackend.FAKE, utils.KVClassType.SENDER).__name__ == "FakeKVSender"
    assert disagg_service.get_kv_class(ours, utils.KVClassType.BOOTSTRAP_SERVER) is ks.KvlinkBootstrapServer
    with pytest.raises(ValueError):
        utils.TransferBackend("no-such-backend")


# -- In one process: the aux and state index spaces, and hostile messages ----------------------


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
    st = [[buf(rows * item)] for rows, item in states]
    keep += kv + aux + [b for s in st for b in s]
    a.engine_rank, a.page_size, a.kv_cache_dtype_str, a.kv_layout = 0, 16, "uint8", None
    a.kv_data_ptrs = [b.ctypes.data for b in kv]
    a.kv_data_lens = [b.nbytes for b in kv]
    a.kv_item_lens = [item] * 4
    a.aux_data_ptrs = [b.ctypes.data for b in aux]
    a.aux_data_lens = [b.nbytes for b in aux]
    a.aux_item_lens = [8, 4, 16]
    a.state_types = ["mamba"] * len(states)
    a.state_data_ptrs = [[b.ctypes.data for b in s] for s in st]
    a.state_data_lens = [[b.nbytes for b in s] for s in st]
    a.state_item_lens = [[item] for _, item in states]
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


def test_aux_rows_and_state_indices_move_in_their_own_index_spaces():
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    import kvlink.sglang as ks

    port = free_port()
    server = ks.KvlinkBootstrapServer("127.0.0.1", port)
    sa = NS(host="127.0.0.1", disaggregation_bootstrap_port=port, dp_size=1)
    states = [(8, 24), (16, 40)]
    pa, (p_kv, p_aux, p_st), _pk = kv_args(64, states, seed=7)
    da, (d_kv, d_aux, d_st), _dk = kv_args(64, states, seed=None)
    pm = ks.KvlinkKVManager(pa, DisaggregationMode.PREFILL, sa)
    dm = ks.KvlinkKVManager(da, DisaggregationMode.DECODE, sa)
    try:
        addr = f"127.0.0.1:{port}"
        assert pump_until(lambda: dm.try_ensure_parallel_info(addr), [])
        sender = ks.KvlinkKVSender(pm, addr, 42)
        receiver = ks.KvlinkKVReceiver(dm, addr, 42)
        assert sender.poll() == KVPoll.Bootstrapping
        receiver.init(0)
        assert receiver.poll() == KVPoll.WaitingForInput
        local_pages = np.array([9, 3, 30, 31, 5], np.int32)
        receiver.send_metadata(local_pages, aux_index=6, state_indices=[[2], [11, 4, 0]], decode_prefix_len=0)
        assert pump_until(lambda: sender.poll() == KVPoll.WaitingForInput, [])
        sender.init(5, aux_index=17)
        remote_pages = [40, 41, 2, 60, 7]
        sender.send(np.array(remote_pages[:2], np.int32))
        sender.send(np.array(remote_pages[2:], np.int32), state_indices=[[5], [1, 15, 8]])
        assert pump_until(lambda: receiver.poll() == KVPoll.Success and sender.poll() == KVPoll.Success, [])
        for p, d in zip(p_kv, d_kv):
            for lp, rp in zip(local_pages, remote_pages):
                assert np.array_equal(d[lp * 64:(lp + 1) * 64], p[rp * 64:(rp + 1) * 64])
        for p, d, item in zip(p_aux, d_aux, [8, 4, 16]):
            assert np.array_equal(d[6 * item:7 * item], p[17 * item:18 * item])
            assert not d[:6 * item].any(), "only the aux row asked for is written"
        for (p,), (d,), (_, item), loc, rem in zip(p_st, d_st, states, [[2], [11, 4, 0]], [[5], [1, 15, 8]]):
            for li, ri in zip(loc, rem):
                assert np.array_equal(d[li * item:(li + 1) * item], p[ri * item:(ri + 1) * item])
        metric = sender.get_transfer_metric()
        assert metric.transfer_total_bytes == 5 * 256 + 28 and metric.transfer_latency_s is not None
        sender.clear()
        receiver.clear()
        assert sum(e.in_flight()[1] for e in pm.engines) == 0

        # A decode expecting more pages than the prefill sends: both sides fail, with the counts.
        s2, r2 = ks.KvlinkKVSender(pm, addr, 43), ks.KvlinkKVReceiver(dm, addr, 43)
        r2.init(0)
        r2.send_metadata(np.array([1, 2, 3], np.int32), aux_index=1, state_indices=[], decode_prefix_len=0)
        assert pump_until(lambda: s2.poll() == KVPoll.WaitingForInput, [])
        s2.init(2, aux_index=1)
        assert s2.poll() == KVPoll.Failed
        with pytest.raises(ks.KvlinkTransferError, match="sends 2 pages, the decode expects 3"):
            s2.failure_exception()
        assert pump_until(lambda: r2.poll() == KVPoll.Failed, [])
        with pytest.raises(ks.KvlinkTransferError, match="prefill aborted"):
            r2.failure_exception()
        r2.clear()
    finally:
        pm.close()
        dm.close()
        server.close()


def test_malformed_and_foreign_messages_are_dropped_alone():
    import kvlink
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    import kvlink.sglang as ks
    from kvlink.sglang import wire

    port = free_port()
    server = ks.KvlinkBootstrapServer("127.0.0.1", port)
    sa = NS(host="127.0.0.1", disaggregation_bootstrap_port=port, dp_size=1)
    pa, (p_kv, _, _), _pk = kv_args(32, [], seed=3)
    da, (d_kv, _, _), _dk = kv_args(32, [], seed=None)
    pm = ks.KvlinkKVManager(pa, DisaggregationMode.PREFILL, sa)
    dm = ks.KvlinkKVManager(da, DisaggregationMode.DECODE, sa)
    intruder = kvlink.Engine()
    intruder.register_kv_caches([np.zeros((32, 64), np.uint8)] * 4, 16, dm.dtype)
    try:
        addr = f"127.0.0.1:{port}"
        assert pump_until(lambda: dm.try_ensure_parallel_info(addr), [])
        s, r = ks.KvlinkKVSender(pm, addr, 9), ks.KvlinkKVReceiver(dm, addr, 9)
        r.init(0)
        r.send_metadata(np.array([4, 5], np.int32), aux_index=0, state_indices=[], decode_prefix_len=0)
        garbage = [b"", b"\xff\xfe", b"[]", b'{"t":"chunk"}', b'{"t":"want","room":9}',
                   b'{"t":"chunk","room":9,"id":"x","first":0,"pages":[-1],"last":false,"spaces":[]}',
                   b'{"t":"nope","room":9}', b'{"t":"abort","room":-4,"reason":"x"}']
        for g in garbage:
            intruder.send_message(dm.kv.handshake_address, g)
            intruder.send_message(pm.kv.handshake_address, g)
        # Well formed, but from an engine that is not the room's prefill: ignored.
        intruder.send_message(dm.kv.handshake_address, wire.chunk(9, r.nonce, "sgl9.c0", 0, [1, 2], True, []))
        intruder.send_message(dm.kv.handshake_address, wire.abort(9, r.nonce, "forged"))
        assert pump_until(lambda: dm.bad_messages >= len(garbage) + 1 and pm.bad_messages >= len(garbage),
                          [s.poll, r.poll])
        assert r.poll() == KVPoll.WaitingForInput, "a forged abort or chunk changed nothing"
        assert pump_until(lambda: s.poll() == KVPoll.WaitingForInput, [])
        s.init(2, aux_index=0)
        s.send(np.array([30, 31], np.int32), state_indices=[])
        assert pump_until(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success, [])
        for p, d in zip(p_kv, d_kv):
            assert np.array_equal(d[4 * 64:6 * 64], p[30 * 64:32 * 64])
    finally:
        intruder.close()
        pm.close()
        dm.close()
        server.close()


@pytest.mark.parametrize("body, why", [
    (b"{", "not JSON"),
    (b'{"t":"want","room":1,"nonce":2,"addr":"a:1","pages":-1,"prefix":0,"aux":true,"states":[],"readers":{}}',
     "pages"),
    (b'{"t":"want","room":1,"nonce":2,"addr":"a:1","pages":1,"prefix":0,"aux":1,"states":[],"readers":{}}', "aux"),
    (b'{"t":"want","room":1,"nonce":2,"addr":"a:1","pages":1,"prefix":0,"aux":true,"states":[],"readers":{},'
     b'"tp":[0,1]}', "readers.aux"),
    (b'{"t":"want","room":1,"nonce":2,"addr":"a:1","pages":1,"prefix":0,"aux":false,"states":[1],'
     b'"readers":{"states":[]},"tp":[0,1]}', "readers.states"),
    (b'{"t":"want","room":1,"nonce":2,"addr":"a:1","pages":1,"prefix":0,"aux":false,"states":[],'
     b'"readers":{"states":[]},"tp":[2,2]}', "tp must be"),
    (b'{"t":"want","room":1,"addr":"a:1","pages":1,"prefix":0,"aux":false,"states":[],"readers":{}}', "nonce"),
    (b'{"t":"chunk","room":1,"nonce":2,"id":"i","first":0,"pages":[1.5],"last":true,"spaces":[]}', "pages"),
    (b'{"t":"chunk","room":1,"nonce":2,"id":"i","first":0,"pages":[1],"last":false,'
     b'"spaces":[{"space":"aux","addr":"a:1","id":"j","indices":[0]}]}', "only the last chunk"),
    (b'{"t":"chunk","room":1,"nonce":2,"id":"i","first":0,"pages":[1],"last":true,'
     b'"spaces":[{"space":99,"addr":"a:1","id":"j","indices":[0]}]}', "space"),
    (b'{"t":"abort","room":true,"reason":"x"}', "room"),
])
def test_wire_refuses_malformed_messages(body, why):
    from kvlink.sglang import wire

    with pytest.raises(wire.BadMessage, match=why):
        wire.decode(body)


def test_wire_round_trips():
    from kvlink.sglang import wire

    w = wire.decode(wire.want(5, 77, "h:1", 3, 16, True, [1], {"aux": "e1", "states": ["e2"]}))
    assert (w["nonce"], w["pages"], w["prefix"], w["readers"]["states"]) == (77, 3, 16, ["e2"])
    c = wire.decode(wire.chunk(5, 77, "sgl5.c0", 0, [1, 2], True,
                               [{"space": 0, "addr": "h:2", "id": "s", "indices": [4]}]))
    assert c["pages"] == [1, 2] and c["spaces"][0]["indices"] == [4]
    assert wire.decode(wire.abort(5, 77, "x" * 2000))["reason"] == "x" * wire.MAX_REASON
    assert wire.decode(wire.abort(5, None, "x"))["nonce"] is None
    # A chunk message names at most MAX_PAGES_PER_MESSAGE pages, and fits in one kvlink message.
    big = wire.chunk(5, (1 << 63) - 1, "sgl5.c0", 0, [(1 << 31) - 1] * wire.MAX_PAGES_PER_MESSAGE, True)
    assert len(big) < 65536 and len(wire.decode(big)["pages"]) == wire.MAX_PAGES_PER_MESSAGE
    with pytest.raises(wire.BadMessage, match="pages"):
        wire.decode(wire.chunk(5, 1, "i", 0, [1] * (wire.MAX_PAGES_PER_MESSAGE + 1), True))


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


def test_a_chunk_larger_than_one_message_is_announced_in_parts():
    from sglang.srt.disaggregation.base.conn import KVPoll

    n = 2 * 4096 + 1000  # page_size 1 with a 9K-token chunk: three messages
    pair = Pair(n + 8, item=8)
    try:
        rng = np.random.default_rng(1)
        local = rng.permutation(n + 8)[:n]
        remote = rng.permutation(n + 8)[:n]
        s, r = pair.start(77, local)
        s.send(remote.astype(np.int32), state_indices=[])
        assert pump_until(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success, [], limit=30)
        for p, d in zip(pair.p_kv, pair.d_kv):
            assert np.array_equal(d.reshape(-1, 8)[local], p.reshape(-1, 8)[remote])
        assert pair.dm.kv.stats()["messages_received"] == 3
        assert r.chunks == 3
    finally:
        pair.close()


def test_a_reused_room_is_not_touched_by_its_earlier_attempt():
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvlink.sglang import wire

    pair = Pair(64)
    try:
        s1, r1 = pair.start(5, [1, 2, 3])
        s1.send(np.array([10], np.int32))
        assert pump_until(lambda: r1.chunks == 1, [r1.poll])
        old = r1.nonce
        r1.abort()
        assert r1.poll() == KVPoll.Failed
        r1.clear()
        assert pump_until(lambda: s1.poll() == KVPoll.Failed, [])
        # Told by the abort message or, first, by the cancelled read's own notice.
        with pytest.raises(pair.ks.KvlinkTransferError, match="decode aborted|reader cancelled"):
            s1.failure_exception()
        # The retry, under the same room: a late abort of the first attempt changes nothing.
        s2, r2 = pair.start(5, [4, 5, 6])
        assert r2.nonce != old
        pair.pm.kv.send_message(pair.dm.kv.handshake_address, wire.abort(5, old, "late"))
        pair.dm.kv.send_message(pair.pm.kv.handshake_address, wire.abort(5, old, "late"))
        s2.send(np.array([20, 21, 22], np.int32), state_indices=[])
        assert pump_until(lambda: r2.poll() == KVPoll.Success and s2.poll() == KVPoll.Success, [])
        for p, d in zip(pair.p_kv, pair.d_kv):
            assert np.array_equal(d[4 * 64:7 * 64], p[20 * 64:23 * 64])
    finally:
        pair.close()


def test_clear_returns_only_when_a_cancelled_read_can_no_longer_write():
    from sglang.srt.disaggregation.base.conn import KVPoll

    pages = 192
    pair = Pair(pages + 1, item=256 << 10)  # 4 x 192 x 256 KiB = 192 MiB to read
    try:
        local = list(range(pages))
        s, r = pair.start(8, local)
        s.send(np.arange(1, pages + 1, dtype=np.int32), state_indices=[])
        assert pump_until(lambda: r.chunks == 1, [r.poll])
        r.abort()
        assert r.poll() == KVPoll.Failed
        r.clear()
        assert not pair.dm.draining, "clear() waited for every cancelled read"
        # SGLang hands the pages to another request now: nothing of the read may land later.
        for d in pair.d_kv:
            d[:] = 0xEE
        time.sleep(0.5)
        pair.dm.pump()
        for d in pair.d_kv:
            assert (d == 0xEE).all()
        assert pump_until(lambda: s.poll() == KVPoll.Failed, [])
    finally:
        pair.close()


def test_a_missing_state_type_fails_the_room():
    from sglang.srt.disaggregation.base.conn import KVPoll

    pair = Pair(32, states=[(8, 16), (8, 16)])
    try:
        s, r = pair.start(3, [1, 2], state_indices=[[0], [1]])
        s.send(np.array([5, 6], np.int32), state_indices=[[2], None])
        assert pump_until(lambda: r.poll() == KVPoll.Failed, [s.poll])
        with pytest.raises(pair.ks.KvlinkTransferError, match="no indices of state type 1"):
            r.failure_exception()
        r.clear()
        assert pump_until(lambda: s.poll() == KVPoll.Failed, [])
    finally:
        pair.close()


def test_a_kv_layout_name_longer_than_a_kvlink_tag_still_starts():
    """DeepSeek-V4 names its main and compressed KV layouts (SGLang's ``get_pd_kv_layout``), which
    with the dtype and page size is over the 32 bytes of a kvlink layout tag: the engine gets a
    digest of it, and the registry still compares the names in full."""
    import kvlink.sglang as ks
    from kvlink.sglang.manager import _layout_tag
    from sglang.srt.disaggregation.utils import DisaggregationMode

    a, _, _keep = kv_args(4, [], seed=None)
    a.kv_cache_dtype_str, a.kv_layout = "fp8_e4m3", "v41_fp4_new,c4:v41_fp4_new,c128:v41_fp4_new"
    sa = NS(host="127.0.0.1", disaggregation_bootstrap_port=free_port(), dp_size=1)
    m = ks.KvlinkKVManager(a, DisaggregationMode.DECODE, sa)
    try:
        assert m.dtype == "fp8_e4m3/v41_fp4_new,c4:v41_fp4_new,c128:v41_fp4_new/p16"
        assert len(m.tag) == 32 and m.tag == _layout_tag(m.dtype) != _layout_tag(m.dtype + "x")
    finally:
        m.close()
    assert _layout_tag("uint8/default/p16") == "uint8/default/p16"


@pytest.mark.parametrize("parallel, extra, why", [
    ({"pp_size": 2, "pp_rank": 0}, {}, "pipeline parallelism"),
    ({"attn_cp_size": 2}, {}, "attention context parallelism"),
    ({"attn_dp_size": 2, "load_balance_method": "round_robin"}, {}, "round_robin load balance method with 2 DP"),
    ({}, {"disaggregation_decode_allocation_policy": "prefill_complete"}, "prefill_complete"),
    ({}, {"enable_memory_saver": True}, "memory saver"),
])
def test_configurations_not_supported_are_refused_at_start(parallel, extra, why):
    """Read from SGLang's resolved parallel context (``get_parallel()``), not raw arguments."""
    import kvlink.sglang as ks
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_parallel

    a, _, _keep = kv_args(4, [], seed=None)
    sa = NS(host="127.0.0.1", disaggregation_bootstrap_port=free_port(), **extra)
    with get_parallel().override(**parallel), pytest.raises(ValueError, match=why):
        ks.KvlinkKVManager(a, DisaggregationMode.PREFILL, sa)


def test_a_parallel_size_sglang_has_not_published_stops_the_backend_at_start():
    import kvlink.sglang as ks
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_parallel

    a, _, _keep = kv_args(4, [], seed=None)
    sa = NS(host="127.0.0.1", disaggregation_bootstrap_port=free_port())
    p = get_parallel()
    saved = dict(p._stamp)
    p.clear_stamp()
    try:
        with pytest.raises(ValueError, match="parallel context has no attn_tp_rank"):
            ks.KvlinkKVManager(a, DisaggregationMode.DECODE, sa)
    finally:
        p.override_permanently(**saved)
