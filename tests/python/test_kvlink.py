"""Python tests of the kvlink bindings: two processes moving a realistic layout, concurrency,
TP aggregation, a dead peer, and clear exceptions for bad arguments."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import kvlink
from kv_layout import BLOCK_BYTES, make_caches

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS = 32


def collect(engine, want, limit=60.0):
    """Accumulates finished entries until ``want(receiving, failed)`` or the limit."""
    end = time.monotonic() + limit
    receiving, sending, failed = [], [], []
    while time.monotonic() < end and not want(receiving, sending, failed):
        f = engine.wait_finished(min(1.0, max(0.01, end - time.monotonic())))
        receiving += f.receiving
        sending += f.sending
        failed += f.failed
    return receiving, sending, failed


class PrefillProcess:
    """A prefill worker in another Python process."""

    def __init__(self, blocks, seed, held):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "prefill_worker.py"), str(LAYERS), str(blocks),
             str(BLOCK_BYTES), str(seed), str(held)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE)
        line = self.proc.stdout.readline()
        assert line.startswith("ADDR "), line
        self.addr = line.split()[1]

    def lines(self, prefix, count, limit=30.0):
        got, end = [], time.monotonic() + limit
        while len(got) < count and time.monotonic() < end:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(prefix):
                got.append(line.strip())
        return got

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


def test_two_processes_random_blocks_every_byte():
    blocks, requests, per = 64, 16, 4
    prefill = PrefillProcess(blocks, seed=7, held=requests)
    try:
        decode = kvlink.Engine(request_timeout=30.0)
        local = make_caches(LAYERS, blocks, BLOCK_BYTES, 0)
        decode.register_kv_caches(local, 16, "bf16")
        rng = np.random.default_rng(1)
        slots = rng.permutation(blocks)
        plan = []
        for i in range(requests):
            l = slots[i * per:(i + 1) * per]
            r = rng.choice(blocks, size=per, replace=False)
            plan.append((f"req-{i}", l, r))
            decode.read_blocks(prefill.addr, f"req-{i}", l.tolist(), r)
        receiving, _, failed = collect(decode, lambda r, s, f: len(r) + len(f) == requests)
        assert failed == []
        assert sorted(receiving) == sorted(p[0] for p in plan)
        remote = make_caches(LAYERS, blocks, BLOCK_BYTES, 7)
        for _, l, r in plan:
            for t in range(2 * LAYERS):
                assert np.array_equal(local[t][l], remote[t][r])
        assert len(prefill.lines("SENT ", requests)) == requests
    finally:
        prefill.close()


def test_aggregation_over_four_ranks():
    ranks, blocks = 4, 8
    prefills, decodes, caches = [], [], []
    for rank in range(ranks):
        p = kvlink.Engine(tp_rank=rank, tp_size=ranks)
        pc = make_caches(2, blocks, 1024, 100 + rank)
        p.register_kv_caches(pc, 16, "fp8")
        d = kvlink.Engine(tp_rank=rank, tp_size=ranks)
        dc = make_caches(2, blocks, 1024, 0)
        d.register_kv_caches(dc, 16, "fp8")
        prefills.append(p)
        decodes.append(d)
        caches.append((pc, dc))
    agg = kvlink.TpAggregator(ranks)
    for rank, (p, d) in enumerate(zip(prefills, decodes)):
        p.hold_blocks("agg-1", [6, 5])
        d.read_blocks(p.handshake_address, "agg-1", [1, 2], [6, 5])
        if rank < ranks - 1:
            agg.add(rank, d.wait_finished(10.0))
            assert agg.take().receiving == [], "released before every rank reported"
    last = decodes[-1]
    agg.add(ranks - 1, last.wait_finished(10.0))
    assert agg.take().receiving == ["agg-1"]
    for pc, dc in caches:
        assert all(np.array_equal(dc[t][[1, 2]], pc[t][[6, 5]]) for t in range(4))
    # A failure on one rank fails the request for the scheduler.
    agg.add(0, decodes[0].get_finished())
    bad = kvlink.TpAggregator(2)
    ok = decodes[0]
    prefills[0].hold_blocks("agg-2", [3])
    ok.read_blocks(prefills[0].handshake_address, "agg-2", [3], [3])
    bad.add(0, ok.wait_finished(10.0))
    decodes[1].read_blocks("127.0.0.1:1", "agg-2", [3], [3])
    bad.add(1, decodes[1].wait_finished(20.0))
    out = bad.take()
    assert out.receiving == [] and out.failed[0][0] == "agg-2" and "rank 1" in out.failed[0][3]


def test_dead_peer_fails_within_the_deadline():
    blocks = 32
    prefill = PrefillProcess(blocks, seed=3, held=0)
    decode = kvlink.Engine(request_timeout=5.0, handshake_timeout=1.0)
    decode.register_kv_caches(make_caches(LAYERS, blocks, BLOCK_BYTES, 0), 16, "bf16")
    decode.connect(prefill.addr)
    prefill.kill()
    t0 = time.monotonic()
    decode.read_blocks(prefill.addr, "to-the-dead", list(range(8)), list(range(8)))
    _, _, failed = collect(decode, lambda r, s, f: len(f) > 0, limit=30.0)
    assert failed and failed[0][0] == "to-the-dead" and failed[0][1] == "recv"
    assert time.monotonic() - t0 < 15.0
    assert decode.in_flight() == (0, 0)


def test_bad_arguments_raise_clear_exceptions():
    e = kvlink.Engine()
    with pytest.raises(kvlink.InvalidArgument, match="set a KV layout"):
        e.read_blocks("127.0.0.1:1", "a", [0], [0])
    caches = make_caches(2, 4, 256, 0)
    e.register_kv_caches(caches, 16, "bf16")
    with pytest.raises(kvlink.InvalidArgument, match="out of range"):
        e.read_blocks("127.0.0.1:1", "a", [4], [0])
    with pytest.raises(kvlink.InvalidArgument, match="pair one to one"):
        e.read_blocks("127.0.0.1:1", "a", [0, 1], [0])
    with pytest.raises(kvlink.InvalidArgument, match="twice"):
        e.read_blocks("127.0.0.1:1", "a", [1, 1], [0, 1])
    with pytest.raises(kvlink.InvalidArgument):
        e.read_blocks("127.0.0.1:1", "a", [-1], [0])
    with pytest.raises(TypeError, match="request ids are str"):
        e.read_blocks("127.0.0.1:1", 5, [0], [0])
    small = e.register_array(np.zeros(1000, dtype=np.uint8))
    with pytest.raises(kvlink.InvalidArgument, match="run past the end"):
        e.set_layout([(small, 0, 256, 256, 4)], 16, "bf16")
    with pytest.raises(kvlink.InvalidArgument, match="not C-contiguous"):
        e.register_array(np.zeros((4, 8), dtype=np.uint8)[:, ::2])
    with pytest.raises(kvlink.InvalidArgument, match="read-only"):
        ro = np.zeros(16, dtype=np.uint8)
        ro.flags.writeable = False
        e.register_array(ro)
    # Arrays of Python objects hold pointers, not KV bytes: refused, as are structured dtypes
    # with an object field at any depth; plain structured (void) dtypes are fine.
    with pytest.raises(kvlink.InvalidArgument, match="object"):
        e.register_array(np.array([object()] * 16, dtype=object))
    nested = np.dtype([("a", np.uint8), ("b", [("c", np.float32), ("Obj", object)])])
    with pytest.raises(kvlink.InvalidArgument, match="object fields"):
        e.register_array(np.zeros(4, dtype=nested))
    plain = np.dtype([("Offset", np.uint32), ("v", np.float16, (3,))])
    e.deregister(e.register_array(np.zeros(4, dtype=plain)))
    with pytest.raises(kvlink.InvalidArgument, match="engine_id"):
        kvlink.Engine(engine_id="x" * 257)

    class GpuArray:
        __cuda_array_interface__ = {"data": (1, False), "shape": (4,), "typestr": "|u1"}

    # Without a GPU runtime: an error naming what is missing; with one, address 1 is refused
    # as not being GPU memory.
    with pytest.raises(kvlink.KvlinkError, match="GPU"):
        e.register_array(GpuArray())
    with pytest.raises(kvlink.InvalidArgument, match="not registered"):
        e.set_layout([(999, 0, 256, 256, 4)], 16, "bf16")
    with pytest.raises(kvlink.InvalidArgument, match="transport"):
        kvlink.Engine(transport="carrier-pigeon")
    with pytest.raises(kvlink.InvalidArgument, match="positive"):
        e.wait_finished(-1)
    # An unknown peer: accepted at the call, failed with the reason.
    e.read_blocks("no-such-host.invalid:1", "unknown-peer", [0], [0])
    _, _, failed = collect(e, lambda r, s, f: len(f) > 0, limit=30.0)
    assert failed[0][0] == "unknown-peer"
    # Memory registered by address, then deregistered.
    buf = np.zeros(4096, dtype=np.uint8)
    region = e.register_memory(buf.ctypes.data, buf.nbytes)
    e.deregister(region)
    with pytest.raises(kvlink.InvalidArgument, match="not registered"):
        e.deregister(region)
    # With an owner, the owner lives while registered, and no longer after deregister.
    import weakref

    class Owner:
        def __init__(self):
            self.buf = np.zeros(4096, dtype=np.uint8)

    owner = Owner()
    alive = weakref.ref(owner)
    region = e.register_memory(owner.buf.ctypes.data, owner.buf.nbytes, owner=owner)
    del owner
    assert alive() is not None, "kept alive while registered"
    e.deregister(region)
    assert alive() is None, "released by deregister"


def test_authentication_and_protected_mode():
    key = "python-deployment-key-0123456789"
    prefill = kvlink.Engine(auth_key=key)
    prefill.register_kv_caches(make_caches(2, 8, 256, 3), 16, "bf16")
    decode = kvlink.Engine(auth_key=key.encode())
    decode.register_kv_caches(make_caches(2, 8, 256, 0), 16, "bf16")
    prefill.hold_blocks("a", [5, 6])
    decode.read_blocks(prefill.handshake_address, "a", [0, 1], [5, 6])
    received, _, failed = collect(decode, lambda r, s, f: len(r) + len(f) > 0, limit=30.0)
    assert received == ["a"] and not failed, failed
    keyless = kvlink.Engine()
    keyless.register_kv_caches(make_caches(2, 8, 256, 0), 16, "bf16")
    keyless.read_blocks(prefill.handshake_address, "b", [0], [0])
    _, _, failed = collect(keyless, lambda r, s, f: len(f) > 0, limit=30.0)
    assert "requires authentication" in failed[0][3], failed
    with pytest.raises(kvlink.InvalidArgument, match="at least 16"):
        kvlink.Engine(auth_key="short")
    with pytest.raises(kvlink.InvalidArgument, match="KVLINK_AUTH_KEY"):
        kvlink.Engine("0.0.0.0:0")
    kvlink.Engine("0.0.0.0:0", insecure=True)


def test_close_and_context_manager():
    with kvlink.Engine() as e:
        e.register_kv_caches(make_caches(2, 8, 256, 0), 16, "bf16")
        addr = e.handshake_address
        assert not e.closed
    assert e.closed
    with pytest.raises(kvlink.KvlinkError, match="shut down"):
        e.read_blocks("127.0.0.1:1", "late", [0], [0])
    e.close()  # idempotent
    import socket

    host, port = addr.rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()


def test_transport_names_are_the_engines():
    """``kvlink.TRANSPORTS`` is what ``Engine(transport=...)`` reads (connectors check settings
    against it): each name starts an engine or fails for want of RDMA, anything else is refused
    naming them all."""
    assert kvlink.TRANSPORTS == ("auto", "network", "tcp", "rdma", "local")
    for name in kvlink.TRANSPORTS:
        try:
            kvlink.Engine(transport=name).close()
        except kvlink.RdmaUnavailable:
            assert name == "rdma"
    with pytest.raises(kvlink.InvalidArgument, match='auto, network, tcp, rdma or local, got "TCP"'):
        kvlink.Engine(transport="TCP")


def test_transport_summary_says_why_not_rdma():
    with kvlink.Engine(transport="tcp") as e:
        summary = kvlink.transport_summary(e)
        assert summary == f"TCP; RDMA: {e.rdma_unavailable_reason}" and e.rdma_unavailable_reason


def test_gpu_capabilities_and_absence_paths():
    e = kvlink.Engine(transport="tcp")
    caps = e.capabilities()
    assert set(caps) == {"rdma", "tcp", "cuda", "hip"}
    assert caps["tcp"][0] is True
    assert caps["rdma"] == (False, "disabled by configuration (transport: tcp)")
    for name in ("cuda", "hip"):
        available, detail = caps[name]
        assert detail, name
        print(f"{name}: {'found' if available else 'unavailable'}: {detail}")
    no_gpu = not caps["cuda"][0] and not caps["hip"][0]
    buf = np.zeros(8192, dtype=np.uint8)
    # Said to be device memory: refused with the reason, nothing registered.
    with pytest.raises(kvlink.KvlinkError, match="no GPU runtime is loaded" if no_gpu else "not GPU"):
        e.register_memory(buf.ctypes.data, buf.nbytes, device=True)
    with pytest.raises(kvlink.InvalidArgument, match="not registered"):
        e.deregister(1)  # the refused registration left no region behind

    class Device:
        type = "cuda"

    class CudaTensor:
        device = Device()
        nbytes = 8192

        def data_ptr(self):
            return buf.ctypes.data

        def is_contiguous(self):
            return True

    with pytest.raises(kvlink.KvlinkError, match="GPU"):
        e.register_array(CudaTensor())

    class XlaDevice:
        type = "xla"

    class XlaTensor(CudaTensor):
        device = XlaDevice()

    with pytest.raises(kvlink.InvalidArgument, match="xla"):
        e.register_array(XlaTensor())
    # Asking the runtimes (device=None): host memory is registered as host memory.
    region = e.register_memory(buf.ctypes.data, buf.nbytes)
    e.deregister(region)
    stats = e.stats()
    assert stats["bytes_staged_out"] == 0 and stats["bytes_staged_in"] == 0
    # GPU runtimes and staging are configurable; bad values are refused.
    off = kvlink.Engine(gpu=False, staging_chunk_bytes=1 << 20, staging_buffers=4)
    assert off.capabilities()["cuda"] == (False, "disabled by configuration (gpu: false)")
    with pytest.raises(kvlink.InvalidArgument, match="staging"):
        kvlink.Engine(staging_buffers=0)


def test_type_stubs_match_the_module():
    """The checked-in stubs name exactly the public classes and members the module has."""
    import ast

    stub = os.path.join(HERE, "..", "..", "ffi", "python", "python", "kvlink", "_kvlink.pyi")
    tree = ast.parse(open(stub).read())
    declared = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names = set()
            for n in node.body:
                if isinstance(n, ast.FunctionDef):
                    names.add(n.name)
                elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    names.add(n.target.id)
            declared[node.name] = {m for m in names if not m.startswith("_")}
    native = kvlink._kvlink
    public = {n for n in dir(native) if not n.startswith("_") and isinstance(getattr(native, n), type)}
    assert set(declared) == public, set(declared) ^ public
    for name, members in declared.items():
        cls = getattr(native, name)
        if issubclass(cls, Exception):
            continue
        have = {m for m in dir(cls) if not m.startswith("_")}
        assert members == have, (name, members ^ have)


def test_cancel_ends_a_read_in_flight():
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    peer = "127.0.0.1:%d" % silent.getsockname()[1]
    e = kvlink.Engine()
    e.register_kv_caches(make_caches(2, 4, 256, 0), 16, "bf16")
    assert e.cancel("never-started") is False
    e.read_blocks(peer, "c1", [0], [0])
    assert e.cancel("c1") is True
    _, _, failed = collect(e, lambda r, s, f: len(f) > 0, limit=10.0)
    assert failed[0][0] == "c1" and failed[0][1] == "recv", failed
    assert "cancelled" in failed[0][3], failed
    assert e.cancel("c1") is False
    silent.close()


def test_finished_reads_carry_a_report():
    prefill = kvlink.Engine()
    prefill.register_kv_caches(make_caches(2, 8, 256, 5), 16, "bf16")
    decode = kvlink.Engine()
    decode.register_kv_caches(make_caches(2, 8, 256, 0), 16, "bf16")
    prefill.hold_blocks("rep", [6, 1])
    decode.read_blocks(prefill.handshake_address, "rep", [0, 3], [6, 1])
    end = time.monotonic() + 30.0
    f = decode.wait_finished(1.0)
    while not f.receiving and not f.failed and time.monotonic() < end:
        f = decode.wait_finished(1.0)
    assert f.receiving == ["rep"], f.failed
    (r,) = f.reports
    assert r["id"] == "rep" and r["transport"] == "tcp", r
    # 2 blocks of 4 tensors (2 layers, K and V) of 256 bytes each.
    assert r["bytes"] == 2 * 4 * 256 and r["blocks"] == 2, r
    assert r["segments"] >= 1 and r["work_requests"] >= 1 and r["seconds"] > 0, r
    assert prefill.wait_finished(10.0).reports == [], "sends carry no report"


def _pair(blocks=8, bytes_=256):
    prefill = kvlink.Engine()
    prefill.register_kv_caches(make_caches(2, blocks, bytes_, 9), 16, "bf16")
    decode = kvlink.Engine()
    decode.register_kv_caches(make_caches(2, blocks, bytes_, 0), 16, "bf16")
    return prefill, decode


def _until(engine, want, limit=20.0):
    end, got = time.monotonic() + limit, []
    while time.monotonic() < end:
        f = engine.wait_finished(0.5)
        got.append(f)
        if want(f):
            return f, got
    raise AssertionError(f"not finished within {limit} s: {got}")


def test_decode_local_id_differs_from_the_prefills():
    prefill, decode = _pair()
    prefill.hold_blocks("prefill-7", [4, 2])
    decode.read_blocks(prefill.handshake_address, "decode-7", [0, 1], [4, 2], remote_request_id="prefill-7")
    f, _ = _until(decode, lambda f: f.receiving or f.failed)
    assert f.receiving == ["decode-7"], f.failures
    assert f.reports[0]["id"] == "decode-7" and f.reports[0]["peer"] == prefill.handshake_address
    t = f.reports[0]["timeline"]
    assert 0 <= t["connected"] <= t["first_byte"] <= t["last_byte"] <= t["confirmed"] <= f.reports[0]["seconds"], t
    assert t["held"] is not None and t["held"] >= 0, t
    s, _ = _until(prefill, lambda f: f.sending or f.failed)
    assert s.sending == ["prefill-7"], s.failures
    with pytest.raises(kvlink.InvalidArgument, match="empty"):
        decode.read_blocks(prefill.handshake_address, "x", [0], [0], remote_request_id="")


def test_reject_and_release_free_a_hold_at_once():
    prefill, decode = _pair()
    prefill.hold_blocks("rejected", [1], abort_timeout=300.0)
    decode.reject(prefill.handshake_address, "rejected", "admission refused")
    f, _ = _until(prefill, lambda f: f.failed)
    (failure,) = f.failures
    assert failure["id"] == "rejected" and failure["side"] == "send" and failure["cause"] == "peer", failure
    assert "admission refused" in failure["reason"]
    prefill.hold_blocks("released", [2])
    assert prefill.release("released") is True
    assert prefill.release("released") is False
    assert prefill.in_flight() == (0, 0)
    # The grant ended with the hold: the read is refused, and nothing is reported on the
    # prefill for the released request.
    decode.read_blocks(prefill.handshake_address, "released", [0], [2])
    f, _ = _until(decode, lambda f: f.failed)
    assert f.failures[0]["cause"] == "peer" and "not held" in f.failures[0]["reason"], f.failures
    assert prefill.get_finished().is_empty()


def test_failures_carry_a_cause_and_counters_add_up():
    prefill, decode = _pair()
    # Nothing listens on this port: the read fails for its connection.
    spare = __import__("socket").socket()
    spare.bind(("127.0.0.1", 0))
    dead = "127.0.0.1:%d" % spare.getsockname()[1]
    spare.close()
    decode.read_blocks(dead, "nowhere", [0], [0])
    f, _ = _until(decode, lambda f: f.failed)
    assert f.failures[0]["cause"] == "connection", f.failures
    prefill.hold_blocks("ok", [3, 5])
    decode.read_blocks(prefill.handshake_address, "ok", [0, 1], [3, 5])
    _until(decode, lambda f: f.receiving)
    _until(prefill, lambda f: f.sending)
    d, p = decode.stats(), prefill.stats()
    assert (d["reads_done"], d["reads_failed"], d["bytes_read"]) == (1, 1, 2 * 4 * 256), d
    assert (p["sends_done"], p["sends_failed"]) == (1, 0), p


def test_metrics_render_and_serve():
    import urllib.request

    from kvlink import metrics

    prefill, decode = _pair()
    prefill.hold_blocks("m", [1])
    decode.read_blocks(prefill.handshake_address, "m", [0], [1])
    _until(decode, lambda f: f.receiving)
    text = metrics.render([prefill, decode])
    assert "# TYPE kvlink_reads_done_total counter" in text
    assert f'kvlink_reads_done_total{{engine_id="{decode.engine_id}"}} 1' in text
    assert f'kvlink_read_bytes_total{{engine_id="{decode.engine_id}"}} {4 * 256}' in text
    assert "# TYPE kvlink_holds_in_flight gauge" in text
    server = metrics.serve(decode, 0)
    try:
        url = "http://127.0.0.1:%d/metrics" % server.server_address[1]
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        assert f'kvlink_reads_done_total{{engine_id="{decode.engine_id}"}} 1' in body
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=5)
    finally:
        server.shutdown()


def test_an_idle_session_closes_and_the_next_read_opens_another():
    from kvlink import metrics

    prefill = kvlink.Engine()
    prefill.register_kv_caches(make_caches(2, 8, 256, 9), 16, "bf16")
    decode = kvlink.Engine(session_idle=0.3)
    decode.register_kv_caches(make_caches(2, 8, 256, 0), 16, "bf16")
    for rid, block in (("i1", 1), ("i2", 2)):
        prefill.hold_blocks(rid, [block])
        decode.read_blocks(prefill.handshake_address, rid, [block], [block])
        _until(decode, lambda f: f.receiving)
        assert decode.stats()["sessions"] == 1
        end = time.monotonic() + 10
        while decode.stats()["sessions"] and time.monotonic() < end:
            time.sleep(0.05)
        s = decode.stats()
        assert s["sessions"] == 0, s
    assert (s["sessions_opened"], s["sessions_closed_idle"]) == (2, 2), s
    text = metrics.render(decode)
    assert f'kvlink_sessions_closed_idle_total{{engine_id="{decode.engine_id}"}} 2' in text
    assert "# TYPE kvlink_queue_pairs gauge" in text
    with pytest.raises(kvlink.InvalidArgument):
        kvlink.Engine(session_idle=-1.0)


def test_messages_arrive_in_order_with_the_senders_engine_id():
    a, b = kvlink.Engine(), kvlink.Engine()
    for e in (a, b):
        e.register_kv_caches(make_caches(1, 4, 64, 0), 16, "bfloat16")
    for i in range(50):
        a.send_message(b.handshake_address, f"m{i}".encode())
    a.send_message(b.handshake_address, b"\0" * 65536)
    with pytest.raises(kvlink.InvalidArgument, match="limit"):
        a.send_message(b.handshake_address, b"\0" * 65537)
    got = []
    end = time.monotonic() + 10
    while len(got) < 51 and time.monotonic() < end:
        got += b.messages()
        time.sleep(0.01)
    assert [body for _, body in got[:50]] == [f"m{i}".encode() for i in range(50)]
    assert len(got[50][1]) == 65536
    assert {sender for sender, _ in got} == {a.engine_id}
    assert b.messages() == []
    assert a.stats()["messages_sent"] == 51 and b.stats()["messages_received"] == 51
    a.close()
    b.close()


def _tp_engine(rank, size, heads_total, layers, blocks, tokens, head_bytes, head_major, fill):
    """A TP rank whose caches declare their heads, layer 1 in block group 1. Arrays are
    ``[blocks, heads, tokens, head_bytes]`` (head-major) or ``[blocks, tokens, heads,
    head_bytes]``; ``fill`` gives the byte of (layer, kv, block, global head, token, byte)."""
    local = heads_total // size
    first = rank * local
    e = kvlink.Engine(tp_rank=rank, tp_size=size)
    arrays, tensors = [], []
    for layer in range(layers):
        for kv in range(2):
            shape = (blocks, local, tokens, head_bytes) if head_major else (blocks, tokens, local, head_bytes)
            a = np.zeros(shape, np.uint8)
            if fill is not None:
                b, h, t, i = np.meshgrid(np.arange(blocks), np.arange(local), np.arange(tokens), np.arange(head_bytes), indexing="ij")
                v = fill(layer, kv, b, h + first, t, i).astype(np.uint8)
                a[...] = v if head_major else v.transpose(0, 2, 1, 3)
            region = e.register_memory(a.ctypes.data, a.nbytes, owner=a)
            runs = 1 if head_major else tokens
            per_block = a.nbytes // blocks
            tensors.append((region, 0, per_block, per_block, blocks, layer % 2, (heads_total, local, runs)))
            arrays.append(a)
    e.set_layout(tensors, tokens, "u8")
    return e, arrays


def test_heterogeneous_tp_and_block_groups_every_byte():
    heads, layers, blocks, tokens, hb = 4, 2, 12, 4, 8

    def fill(layer, kv, b, g, t, i):
        return (layer * 61 + kv * 31 + b * 17 + g * 7 + t * 3 + i) % 251

    assert kvlink.tp_sources(1, 2, 1) == [0]
    assert kvlink.tp_sources(0, 1, 4) == [0, 1, 2, 3]
    with pytest.raises(kvlink.InvalidArgument, match="multiple"):
        kvlink.tp_sources(0, 3, 2)
    local = [[0, 5, 2], [7, 1, 3]]  # per block group
    remote = [[9, 4, 11], [0, 10, 6]]
    for psize, dsize, head_major in ((1, 2, True), (2, 1, False)):
        prefill = [_tp_engine(r, psize, heads, layers, blocks, tokens, hb, head_major, fill) for r in range(psize)]
        decode = [_tp_engine(r, dsize, heads, layers, blocks, tokens, hb, head_major, None) for r in range(dsize)]
        addrs = [p.handshake_address for p, _ in prefill]
        rid = f"tp-{psize}-{dsize}"
        for p, _ in prefill:
            p.hold_blocks(rid, remote)
        for d, _ in decode:
            d.read_blocks(addrs, rid, local, remote)
        for r, (d, arrays) in enumerate(decode):
            f, _ = _until(d, lambda f: f.receiving or f.failed)
            assert f.receiving == [rid], f.failures
            assert f.reports[0]["peer"] == ",".join(addrs[s] for s in kvlink.tp_sources(r, dsize, psize))
            first = r * heads // dsize
            for t, a in enumerate(arrays):
                layer, kv = divmod(t, 2)
                group = layer % 2
                for lb, rb in zip(local[group], remote[group]):
                    got = a[lb] if head_major else a[lb].transpose(1, 0, 2)
                    h, tk, i = np.meshgrid(np.arange(got.shape[0]), np.arange(tokens), np.arange(hb), indexing="ij")
                    want = fill(layer, kv, rb, h + first, tk, i).astype(np.uint8)
                    assert np.array_equal(got, want), (psize, dsize, r, t, lb, rb)
        for p, _ in prefill:
            s, _ = _until(p, lambda f: f.sending or f.failed)
            assert s.sending == [rid], s.failures
        for e, _ in prefill + decode:
            e.close()
    # A flat block list for a layout of two groups is refused with the reason.
    d, _ = _tp_engine(0, 1, heads, layers, blocks, tokens, hb, True, None)
    with pytest.raises(kvlink.InvalidArgument, match="block groups"):
        d.hold_blocks("flat", [1, 2])
    with pytest.raises(kvlink.InvalidArgument, match="heads"):
        d.set_layout([(1, 0, 64, 64, 2, 0, (4, 3, 1))], 4, "u8")

