"""kvlink's SGLang backend in one process: a prefill and a decode manager over numpy memory
(``harness.Pair``) driven call by call as SGLang's queues drive them (state payloads, GPU
events, reused rooms, hostile messages), the wire format, the configurations refused at start
and the plugin loader."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace as NS

import numpy as np
import pytest

from harness import Pair, free_port, kv_args, pump_until


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
    """The decode refuses the whole last chunk before reading any of it: a KV read started
    first would run on, and the prefill would report the room sent."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    pair = Pair(32, states=[(8, 16), (8, 16)])
    try:
        s, r = pair.start(3, [1, 2], state_indices=[[0], [1]])
        s.send(np.array([5, 6], np.int32), state_indices=[[2], None])
        assert pump_until(lambda: r.poll() == KVPoll.Failed, [s.poll])
        with pytest.raises(pair.ks.KvlinkTransferError, match="no indices of state type 1"):
            r.failure_exception()
        r.clear()  # returns once every read it cancelled was reported
        for e in pair.dm.engines:
            st = e.stats()
            assert st["reads_done"] + st["reads_failed"] + st["reads_cancelled"] == 0, st
        assert pump_until(lambda: s.poll() == KVPoll.Failed, [])
    finally:
        pair.close()


def test_a_chunk_behind_a_gpu_event_is_held_only_once_the_event_completed():
    """Overlap scheduling hands over a chunk with an event (``_early_send_wait_event``) its KV
    is still being written behind: nothing is held or announced until the event completed, and
    the scheduler thread never waits for it."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    class Event:
        done = False
        asked = 0

        def query(self):
            self.asked += 1
            return self.done

        def synchronize(self):
            raise AssertionError("the scheduler thread must not wait for the GPU")

    pair = Pair(32)
    try:
        s, r = pair.start(8, [1, 2, 3])
        ev = Event()
        s._early_send_wait_event = ev
        s.send(np.array([4, 5], np.int32))
        s.send(np.array([6], np.int32))  # queued behind the first
        for _ in range(20):
            assert s.poll() == KVPoll.WaitingForInput and r.poll() == KVPoll.WaitingForInput
            time.sleep(0.002)
        assert pair.pm.kv.in_flight()[1] == 0 and r.chunks == 0 and ev.asked > 1
        ev.done = True
        assert pump_until(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success, [s.poll])
        for p, d in zip(pair.p_kv, pair.d_kv):
            for lp, rp in ((1, 4), (2, 5), (3, 6)):
                assert np.array_equal(d[lp * 64:(lp + 1) * 64], p[rp * 64:(rp + 1) * 64])
    finally:
        pair.close()


def test_state_payloads_pair_as_sglangs_own_backends_pair_them():
    """A dsa_tail descriptor moves its request row whole (same ring size); a sliding window
    one page longer on the decode reads the pages both have (SGLang's 1-page drift); a
    request_row moves row for row."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    pair = Pair(32, states=[(8, 64, "dsa_tail"), (16, 16, "swa"), (8, 16, "request_row")])
    try:
        s, r = pair.start(5, [1, 2], state_indices=[[3, 2, 4, 0, 2, 8], [1, 2, 3], [5]])
        s.send(np.array([7, 8], np.int32), state_indices=[[6, 2, 4, 0, 2, 8], [10, 11], [2]])
        assert pump_until(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success, []), r.reason
        (tail_p,), (swa_p,), (row_p,) = pair.p_st
        (tail_d,), (swa_d,), (row_d,) = pair.d_st
        assert np.array_equal(tail_d[3 * 64:4 * 64], tail_p[6 * 64:7 * 64])
        assert not tail_d[:3 * 64].any() and not tail_d[4 * 64:].any(), "only the request's row"
        for dp, pp in ((1, 10), (2, 11)):
            assert np.array_equal(swa_d[dp * 16:(dp + 1) * 16], swa_p[pp * 16:(pp + 1) * 16])
        assert not swa_d[3 * 16:4 * 16].any(), "the page only the decode's window has is not written"
        assert np.array_equal(row_d[5 * 16:6 * 16], row_p[2 * 16:3 * 16])
        s.clear()
        r.clear()

        # No live tail tokens on either side: nothing to move for that state.
        s, r = pair.start(6, [4], state_indices=[[], [5], [6]])
        s.send(np.array([9], np.int32), state_indices=[[], [12], [3]])
        assert pump_until(lambda: r.poll() == KVPoll.Success and s.poll() == KVPoll.Success, []), r.reason
        s.clear()
        r.clear()
    finally:
        pair.close()


@pytest.mark.parametrize("decode_states, prefill_states, why", [
    ([[3, 2, 4, 0, 2, 8], [1], [5]], [[6, 2, 4, 0, 2, 16], [10], [2]], "rings of 16 slots on the prefill and 8"),
    ([[], [1], [5]], [[], [10], [2, 3]], "request_row state: the prefill sent 2 indices, this decode expects 1"),
])
def test_state_payloads_that_cannot_pair_fail_the_room_with_both_values(decode_states, prefill_states, why):
    from sglang.srt.disaggregation.base.conn import KVPoll

    pair = Pair(32, states=[(8, 64, "dsa_tail"), (16, 16, "swa"), (8, 16, "request_row")])
    try:
        s, r = pair.start(7, [1], state_indices=decode_states)
        s.send(np.array([7], np.int32), state_indices=prefill_states)
        assert pump_until(lambda: r.poll() == KVPoll.Failed, [s.poll])
        with pytest.raises(pair.ks.KvlinkTransferError, match=why):
            r.failure_exception()
        r.clear()
        assert pump_until(lambda: s.poll() == KVPoll.Failed, [])
    finally:
        pair.close()


def test_a_state_type_this_backend_does_not_know_stops_it_at_start():
    with pytest.raises(ValueError, match=r"does not know SGLang state types \['hologram'\]"):
        Pair(8, states=[(8, 16, "hologram")])


def test_a_kv_layout_name_longer_than_a_kvlink_tag_still_starts():
    """DeepSeek-V4 names its main and compressed KV layouts (SGLang's ``get_pd_kv_layout``), which
    with the dtype and page size is over the 32 bytes of a kvlink layout tag: the engine gets a
    digest of it, and the registry still compares the names in full."""
    import kvlink.sglang as ks
    from kvlink.sglang.settings import layout_tag as _layout_tag
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


def test_which_state_types_a_decode_of_another_tp_size_reads_by_head():
    """SWA pages of a known layout are read by head (token-major pages repeat the local heads
    once per token); every other state type, or SWA pages whose heads or layout are unknown,
    only between equal attention TP sizes, with the reason the route then gives."""
    from kvlink.sglang import states

    assert states.page_heads("swa", (8, 4), 16, "nhd") == (8, 4, 16)
    assert states.page_heads("swa", (8, 4), 16, "hnd") == (8, 4, 1)
    for args in (("swa", None, 16, "nhd"), ("swa", (8, 4), 16, "vectorized_5d"), ("mamba", (8, 4), 16, "nhd")):
        assert states.page_heads(*args) is None, args
    assert "heads are not known" in states.split_reason("swa")
    assert states.split_reason("mamba") == (
        "kvlink reads SGLang's mamba state whole, between equal attention TP sizes only"
    )


def test_state_engine_addresses_and_reasons_come_per_type_in_rank_order_and_hostile_ones_are_dropped():
    from kvlink.sglang import bootstrap, states

    ranks = [{"state_addrs": ["a:1", "b:1"]}, {"state_addrs": ["a:2"]}, {"state_addrs": "x"}, {}]
    assert states.addresses(ranks, 2) == [["a:1", "a:2", "", ""], ["b:1", "", "", ""]]
    assert states.addresses([{"state_addrs": [7]}], 1) == [[""]]
    entry = {"dp_rank": 0, "tp_rank": 0, "tp_size": 1, "dp_size": 1, "page_size": 16,
             "addr": "h:1", "dtype": "auto", "engine_id": "e"}
    assert bootstrap._check_entry(dict(entry, state_addrs=["h:2", ""]))["state_addrs"] == ["h:2", ""]
    assert bootstrap._check_entry(entry)["state_addrs"] == []
    for bad in (["h:2"] * 17, "h:2", [3], ["x" * 257]):
        with pytest.raises(ValueError, match="state_addrs"):
            bootstrap._check_entry(dict(entry, state_addrs=bad))
    # Why each state type cannot be read between TP sizes, as a prefill registers it.
    assert bootstrap._check_entry(dict(entry, state_split=["", "no"]))["state_split"] == ["", "no"]
    for bad in ([""] * 17, "no", [None], ["x" * 513]):
        with pytest.raises(ValueError, match="state_split"):
            bootstrap._check_entry(dict(entry, state_split=bad))
    assert states.unsplittable(["swa", "mamba"], ["", "whole"], " on the prefill") == "mamba state on the prefill: whole"
    assert states.unsplittable(["swa"], [""]) is None and states.unsplittable(["swa"], [7]) is None


def test_mamba_state_tensors_split_as_sglang_describes_them():
    """A gated delta net's conv slot (query, key and value sub-blocks, each sharded on its own)
    is one piece per sub-block with its channels as heads; a temporal slot is its heads; a slot
    every rank holds whole is read whole; a Mamba-2 conv state SGLang describes no sub-blocks of
    is split by those the model gives; a conv state with no sub-blocks described or given, or
    with sub-blocks inside rows, is refused with the reason."""
    from kvlink.sglang import states

    # TP 2: 1024 + 1024 + 2048 local channels of 3 bf16 positions each.
    conv = states.tensor_slices(4096 * 6, 4096, 1, [2048, 2048, 4096], 2)
    assert conv == [(0, 6144, (2048, 1024, 1)), (6144, 6144, (2048, 1024, 1)), (12288, 12288, (4096, 2048, 1))]
    assert states.tensor_slices(16 * 128 * 128 * 4, 16, 1, None, 2) == [(0, 16 * 128 * 128 * 4, (32, 16, 1))]
    assert states.tensor_slices(100, 0, 1, None, 2) == [(0, 100, None)]
    assert states.tensor_slices(3 * 512 * 2, 512, 3, None, 2) == [(0, 3072, (1024, 512, 3))]
    assert "sit inside each of its 3 rows" in states.tensor_slices(3 * 512 * 2, 512, 3, [256, 256, 512], 2)
    assert "do not split evenly" in states.tensor_slices(512 * 6, 512, 1, [256, 256, 256], 2)
    assert "is not 1 rows of 7 channels" in states.tensor_slices(100, 7, 1, None, 1)
    both = states.mamba_slices([4096 * 6, 16 * 128 * 128 * 4], [4096, 16], [1, 1], [[2048, 2048, 4096], None], 2)
    assert isinstance(both, list) and len(both) == 2 and len(both[0]) == 3
    assert "describes no sub-blocks" in states.mamba_slices([5120 * 6, 64 * 64 * 128 * 4], [5120, 64], [1, 1],
                                                           [None, None], 2)
    # A Mamba-2 conv SGLang describes no sub-blocks of, given them from the model (x, B, C):
    # the conv tensor (5,120 channels here) in three pieces, the temporal state by heads.
    mamba2 = states.mamba_slices([5120 * 6, 64 * 64 * 128 * 4], [5120, 64], [1, 1], [None, None], 2,
                                 ([8192, 1024, 1024], 5120))
    assert mamba2 == [[(0, 4096 * 6, (8192, 4096, 1)), (4096 * 6, 512 * 6, (1024, 512, 1)),
                       (4608 * 6, 512 * 6, (1024, 512, 1))], [(0, 64 * 64 * 128 * 4, (128, 64, 1))]], mamba2
    assert "no TP slice sizes" in states.mamba_slices([6], [], [], [], 2)
