"""kvlink.events from Python: a Python publisher read by `kvlink-events tail` and by the
independent Python subscriber; the Python subscriber reading a pyzmq+msgpack publisher with
gaps, a restart and lost history; the page splitter against hashlib; the merger; refusals.
(vLLM's own decoder and publisher are in tests/vllm/test_events_vllm.py.)"""

import dataclasses
import hashlib
import time
from typing import List, Optional

import pytest

import kvlink
from kvlink.events import Index, Merger, PageSplitter, Publisher, Subscriber

from events_peers import PyPublisher, PySubscriber
from test_events_interop import (  # noqa: F401 (fixtures)
    batch_line,
    bound,
    cleanup,
    events_bin,
    free_endpoint,
    removed,
    simple_batch,
    start_tail,
    stored,
    to_wire,
    tokens,
    ts_of,
)


# Time for a subscription to reach a kvlink PUB socket (the pure-Rust ZeroMQ takes longer to
# register one than libzmq).
SUBSCRIBED = 1.0


def py_event(event):
    """A JSON-form event (the CLI's) as the dict the Python API takes and returns."""
    out = dict(event)
    if "block_hashes" in out:
        out["block_hashes"] = [bytes.fromhex(h["bytes"]) if isinstance(h, dict) else h for h in out["block_hashes"]]
    return out


def drain(sub, want, limit=10.0):
    got, end = [], time.monotonic() + limit
    while len(got) < want and time.monotonic() < end:
        item = sub.next(0.2)
        if item is not None:
            got.append(item)
    return got


def batches_of(seq_range, base=0):
    return [(seq, [py_event(e) for e in simple_batch(seq, base)]) for seq in seq_range]


@pytest.mark.parametrize("encoding", ["current", "legacy"])
def test_python_publisher_read_by_kvlink_tail(events_bin, cleanup, encoding):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = Publisher(bound(pub_ep), replay_endpoint=bound(rep_ep), encoding=encoding)
    cleanup(type("Closer", (), {"close": lambda self: pub.close()})())
    cli = start_tail(events_bin, cleanup, pub_ep, rep_ep, "--count", "3")
    events = [
        [stored([1, 2], None, tokens(0, 2))],
        [stored([2**64 - 1], 2, tokens(32, 1), medium="CPU", lora_id=3, lora_name="a", group_idx=1)],
        [removed([1, 2]), {"type": "AllBlocksCleared", "medium": None}],
    ]
    for seq, evs in enumerate(events):
        pub.publish([py_event(e) for e in evs], ts=ts_of(seq))
    assert cli.lines_until_exit() == [batch_line(seq, ts_of(seq), evs) for seq, evs in enumerate(events)]
    stats = pub.close()
    assert stats["published"] == 3 and stats["dropped"] == 0, stats
    assert pub.close() is None


def test_python_publisher_read_by_independent_subscriber(cleanup):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    # vLLM's rule: a publisher of DP rank r binds its port + r.
    base = int(pub_ep.rsplit(":", 1)[1]) - 2
    with Publisher(f"tcp://*:{base}", replay_endpoint=bound(rep_ep), topic="kv@pod-1@m", dp_rank=2) as pub:
        assert pub.endpoint.endswith(f":{base + 2}"), pub.endpoint
        sub = cleanup(PySubscriber(pub_ep, pub.replay_endpoint.replace("*", "127.0.0.1"), topic=b"kv@pod-1"))
        time.sleep(SUBSCRIBED)
        negative = -(2**63)
        pub.publish([{"type": "BlockStored", "block_hashes": [negative, b"\x01" * 32], "parent_block_hash": None,
                      "token_ids": [5] * 32, "block_size": 16}], ts=ts_of(0))
        topic, seq, (ts, events, dp_rank, incarnation) = sub.recv(timeout=10)
        assert (topic, seq, ts, dp_rank) == (b"kv@pod-1@m", 0, ts_of(0), 2)
        assert incarnation == pub.incarnation, "kvlink's incarnation, a fourth element"
        (ev,) = events
        # The current encoding: a map whose first key is "type".
        assert list(ev)[0] == "type" and ev["type"] == "BlockStored", ev
        assert ev["block_hashes"] == [negative, b"\x01" * 32] and ev["token_ids"] == [5] * 32, ev
        (replayed_seq, (replayed_ts, _, _, _)), = sub.replay(0, timeout=5)
        assert (replayed_seq, replayed_ts) == (0, ts_of(0))


def test_python_subscriber_fills_gaps_and_reports_restart_and_lost_history(cleanup):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep, ring=100))
    sub = Subscriber(pub_ep, replay_endpoint=rep_ep, replay_timeout=2.0)
    time.sleep(0.3)
    # Seqs 2 and 3 never go out live: the subscriber sees the gap at 4 and replays them.
    for seq, evs in batches_of(range(6)):
        pub.publish([to_wire(e, "current") for e in simple_batch(seq)], ts=ts_of(seq), skip_live=seq in (2, 3))
    got = drain(sub, 7)
    batches = [g for g in got if g["kind"] == "batch"]
    assert [g["seq"] for g in batches] == list(range(6)), got
    assert batches[2]["events"] == [py_event(e) for e in simple_batch(2)]
    assert batches[3]["ts"] == ts_of(3) and batches[3]["dp_rank"] == 0
    # The replay's end is announced after the batches it recovered (and the buffered 4 and 5
    # when they were already there).
    filled = [g for g in got if g["kind"] == "gap_filled"]
    assert len(filled) == 1 and filled[0]["from"] == 2 and filled[0]["through"] >= 4, got
    assert got.index(filled[0]) > got.index(batches[4]), got
    assert sub.stats()["replays"] >= 1
    # A restart: the sequence goes down.
    pub.restart()
    pub.publish([to_wire(e, "current") for e in simple_batch(0, 500)], ts=ts_of(0))
    got = drain(sub, 2)
    assert got[0] == {"kind": "resync", "reason": "publisher_restart", "last": 5, "now": 0}, got
    assert got[1]["kind"] == "batch" and got[1]["seq"] == 0 and got[1]["events"][0]["block_hashes"] == [500]
    assert sub.last_seq == 0


def test_python_subscriber_late_join_with_lost_history(cleanup):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep, ring=3))
    for seq in range(10):  # nobody listens; the ring keeps 7, 8, 9
        pub.publish([to_wire(e, "current") for e in simple_batch(seq)], ts=ts_of(seq))
    sub = Subscriber(pub_ep, replay_endpoint=rep_ep, start_from=0)
    got = drain(sub, 4)
    assert got[0] == {"kind": "resync", "reason": "history_lost", "from": 0, "resumed": 7}, got
    assert [g["seq"] for g in got[1:]] == [7, 8, 9]
    assert sub.next(0.5) is None, "a lossy replay announces no fill"


def test_subscriber_iterates_and_reports_malformed(cleanup):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep))
    sub = Subscriber(pub_ep, replay_endpoint=rep_ep)
    time.sleep(0.3)
    pub.publish_raw(b"\xc1 not msgpack")
    pub.publish([to_wire(e, "current") for e in simple_batch(1)], ts=ts_of(1))
    first, second = sub.next(10.0), sub.next(10.0)
    assert first is not None and second is not None, (first, second)
    assert first["kind"] == "malformed" and first["seq"] == 0 and first["reason"], first
    assert second["kind"] == "batch" and second["seq"] == 1


@dataclasses.dataclass
class BlockStored:
    """Shaped like SGLang's (and vLLM's) event class: the publisher reads its attributes."""

    block_hashes: List[int]
    parent_block_hash: Optional[int]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None


@dataclasses.dataclass
class BlockRemoved:
    block_hashes: List[int]
    medium: Optional[str] = None


def test_publisher_takes_engine_event_objects_and_refuses_bad_events(cleanup):
    pub_ep = free_endpoint()
    with Publisher(bound(pub_ep)) as pub:
        sub = Subscriber(pub_ep)
        time.sleep(SUBSCRIBED)
        pub.publish([BlockStored([11, 12], 10, list(range(32)), 16, medium="GPU"), BlockRemoved([3])], ts=1.5)
        (item,) = drain(sub, 1)
        a, b = item["events"]
        assert a["type"] == "BlockStored" and a["block_hashes"] == [11, 12] and a["parent_block_hash"] == 10
        assert a["token_ids"] == list(range(32)) and a["medium"] == "GPU" and a["lora_id"] is None
        assert b == {"type": "BlockRemoved", "block_hashes": [3], "medium": None, "group_idx": None,
                     "locality": None, "ownership": None}
        for bad, why in [
            ({"block_hashes": [1]}, "type"),
            ({"type": "Nope", "block_hashes": [1]}, "unknown KV event type"),
            ({"type": "BlockRemoved"}, "block_hashes"),
            ({"type": "BlockRemoved", "block_hashes": [2**64]}, "block hash"),
            ({"type": "BlockStored", "block_hashes": [1], "token_ids": [-1]}, "token_ids"),
        ]:
            with pytest.raises(kvlink.InvalidArgument, match=why):
                pub.publish([{"type": "AllBlocksCleared"}, bad])
        final = pub.close()
        assert final["published"] == 1 and final["queued"] == 0, "a refused batch is never queued"


def test_page_splitter_chains_sha256_digests():
    tokens_ = list(range(100, 140))
    for kind in ("vllm", "sglang"):
        events, last = PageSplitter(16, kind).split(tokens_, token_offset=64, medium="GPU")
        assert [e["token_offset"] for e in events] == [64, 80, 96]
        assert [len(e["token_ids"]) for e in events] == [16, 16, 8]
        prev = None
        for page, e in zip([tokens_[0:16], tokens_[16:32], tokens_[32:40]], events):
            d = hashlib.sha256((prev or b"") + b"".join(t.to_bytes(4, "little") for t in page)).digest()
            want = int.from_bytes(d[24:], "big") if kind == "vllm" else int.from_bytes(d[:8], "big", signed=True)
            assert e["block_hashes"] == [want], (kind, e)
            parent = None if prev is None else (
                int.from_bytes(prev[24:], "big") if kind == "vllm" else int.from_bytes(prev[:8], "big", signed=True))
            assert e["parent_block_hash"] == parent and e["medium"] == "GPU"
            prev = d
        assert last == prev
        # The next run chains from the last digest.
        more, _ = PageSplitter(16, kind).split([1, 2, 3], parent=last, token_offset=104)
        d = hashlib.sha256(last + b"".join(t.to_bytes(4, "little") for t in [1, 2, 3])).digest()
        assert more[0]["token_offset"] == 104 and more[0]["block_hashes"][0] == (
            int.from_bytes(d[24:], "big") if kind == "vllm" else int.from_bytes(d[:8], "big", signed=True))
    with pytest.raises(kvlink.InvalidArgument, match="32-byte"):
        PageSplitter(16).split([1], parent=b"short")
    with pytest.raises(kvlink.InvalidArgument, match="hash"):
        PageSplitter(16, "md5")


def test_merger_joins_two_python_publishers(cleanup):
    eps = [(free_endpoint(), free_endpoint()) for _ in range(2)]
    pubs = [Publisher(bound(p), replay_endpoint=bound(r)) for p, r in eps]
    out_ep, out_rep = free_endpoint(), free_endpoint()
    merger = Merger(eps, bound(out_ep), replay_endpoint=bound(out_rep))
    try:
        sub = Subscriber(out_ep, replay_endpoint=out_rep)
        time.sleep(SUBSCRIBED)
        for seq in range(3):
            for i, pub in enumerate(pubs):
                pub.publish([py_event(e) for e in simple_batch(seq, 100 * i)], ts=ts_of(seq), dp_rank=i)
        got = [g for g in drain(sub, 6) if g["kind"] == "batch"]
        assert [g["seq"] for g in got] == list(range(6)), got
        hashes = sorted(g["events"][0]["block_hashes"][0] for g in got)
        assert hashes == [0, 1, 2, 100, 101, 102]
        assert sorted({g["dp_rank"] for g in got}) == [0, 1]
        inputs = merger.stats()["inputs"]
        assert [i["batches"] for i in inputs] == [3, 3], inputs
    finally:
        merger.close()
        for p in pubs:
            p.close()


def test_publish_and_stats_from_two_threads_do_not_deadlock():
    """publish holds the publisher's lock; a thread reading stats with the GIL must never wait
    on it while publish waits for the GIL."""
    import threading

    stop = threading.Event()
    pub = Publisher(bound(free_endpoint()), max_queue=1_000_000)
    errors = []

    def reader():
        try:
            while not stop.is_set():
                pub.stats()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    end = time.monotonic() + 1.0
    n = 0
    while time.monotonic() < end:
        pub.publish([{"type": "AllBlocksCleared"}], ts=1.0)
        n += 1
    stop.set()
    t.join(5.0)
    assert not t.is_alive(), "the stats reader hung"
    assert errors == [] and n > 100
    assert pub.close(10.0)["published"] == n


def test_newer_and_unknown_fields_reach_python_and_go_back_out(cleanup):
    # vLLM 0.33's and SGLang's newer fields, and fields kvlink does not model, cross the
    # Python API both ways unchanged, in both encodings.
    for encoding in ("current", "legacy"):
        pub_ep = free_endpoint()
        with Publisher(bound(pub_ep), encoding=encoding) as pub:
            sub = Subscriber(pub_ep)
            time.sleep(SUBSCRIBED)
            extra = {"x_future": {"k": [1, 2.5, b"\x00"], 7: None}} if encoding == "current" else {
                "@20": ["later", True]}
            event = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                     "token_ids": [1, 2], "block_size": 1, "medium": "GPU",
                     "extra_keys": [["lora-a", ["mm", 0]], None], "locality": "REMOTE",
                     "ownership": "tier-2", "session_id": "s-1",
                     "lookahead_token_ids": [[3], [4, 5]], "cache_salt": "salt", **extra}
            pub.publish([event], ts=2.5)
            (item,) = drain(sub, 1)
            got = item["events"][0]
            for k, v in event.items():
                assert got[k] == v, (encoding, k, got[k])
            # What came out goes back in as is.
            pub.publish(item["events"], ts=3.5)
            (again,) = drain(sub, 1)
            assert again["events"] == item["events"]


def test_merger_keeps_topics_and_applies_the_tp_rule(cleanup):
    w0, w1, out = free_endpoint(), free_endpoint(), free_endpoint()
    p0 = cleanup(Publisher(bound(w0), topic="kv@pod-0@llama"))
    p1 = cleanup(Publisher(bound(w1), topic="kv@pod-0@llama"))
    m = cleanup(Merger([(w0, None), (w1, None)], bound(out), keep_topics=True, tp_size=2,
                       input_topic="kv@"))
    sub = Subscriber(out)
    deadline = time.monotonic() + 15
    while not all(i["connected"] for i in m.stats()["inputs"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(SUBSCRIBED)
    rm = lambda h: {"type": "BlockRemoved", "block_hashes": [h]}  # noqa: E731
    p0.publish([rm(1), rm(2)])
    time.sleep(0.2)
    p1.publish([rm(2), rm(3)])
    (item,) = drain(sub, 1)
    assert item["topic"] == "kv@pod-0@llama"
    assert [e["block_hashes"] for e in item["events"]] == [[2]], "only what both workers emitted"
    groups = m.stats()["tp_groups"]
    assert groups == [{"forwarded": 1, "held": 2, "evicted": 0}]


def test_index_fed_by_a_subscriber_answers_overlap_and_drops_a_restarted_engine(cleanup):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep, ring=100))
    sub = Subscriber(pub_ep, replay_endpoint=rep_ep, replay_timeout=2.0)
    time.sleep(SUBSCRIBED)
    prompt = list(range(48))
    # Three blocks of the prompt, in two batches (the second chained to the first's last).
    pub.publish([to_wire(stored([11, 12], None, prompt[:32]), "current")], ts=ts_of(0))
    pub.publish([to_wire(stored([13], 12, prompt[32:]), "current")], ts=ts_of(1))
    index = Index()
    for item in drain(sub, 2):
        index.apply("prefill-0", item)
    index.apply_events("prefill-1", [stored([11], None, prompt[:16])], dp_rank=0)
    got = index.overlap_tokens(prompt + [7, 7], block_size=16)
    assert [(m["engine"], m["blocks"], m["tokens"], m["state"]) for m in got] == [
        ("prefill-0", 3, 48, "exact"),
        ("prefill-1", 1, 16, "exact"),
    ], got
    assert index.overlap_hashes([11, 12])[0]["blocks"] == 2
    assert index.overlap_tokens(prompt, 16, lora_name="adapter") == [], "another adapter's blocks"
    # prefill-0 restarts: none of its blocks counts any more; its new ones do.
    pub.restart()
    pub.publish([to_wire(stored([11], None, prompt[:16]), "current")], ts=ts_of(0))
    for item in drain(sub, 2):
        index.apply("prefill-0", item)
    got = index.overlap_tokens(prompt, 16)
    assert [(m["engine"], m["blocks"]) for m in got] == [("prefill-0", 1), ("prefill-1", 1)], got
    assert index.stats()["restarts"] == 1
    # Lost history withholds what was known; a stale engine counts for nothing.
    index.apply("prefill-0", {"kind": "resync", "reason": "history_lost", "from": 3, "resumed": 5})
    index.set_stale("prefill-1", True)
    assert index.overlap_tokens(prompt, 16) == []
    states = {h["engine"]: h["state"] for h in index.holders()}
    assert states == {"prefill-0": "recovering", "prefill-1": "stale"}
    with pytest.raises(kvlink.InvalidArgument):
        index.apply("prefill-0", {"kind": "surprise"})
