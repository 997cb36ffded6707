"""`kvlink-events index`, the KV-event index service, driven as a router would: engines'
streams from independent Python publishers (events_peers.py), overlap queries, a dump and
Prometheus metrics over HTTP; an engine registered and another removed while it runs, engines
from a file it re-reads, and a clean stop on SIGTERM. Then a kvlink engine whose ring no longer
holds its history: the service, and a Python subscriber with `kvlink.events.Index`, load its
snapshot and are exact at once."""

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("zmq", reason="pyzmq not installed in this venv")

from events_peers import PyPublisher  # noqa: E402
from test_events_interop import (  # noqa: E402, F401 (fixtures)
    Cli,
    bound,
    cleanup,
    events_bin,
    free_endpoint,
    removed,
    stored,
    to_wire,
    ts_of,
)

from kvlink.events import Index, Publisher, Subscriber  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ports import free_port  # noqa: E402

PROMPT = list(range(1000, 1064))  # four blocks of 16


def http(port, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            text = r.read().decode()
            return r.status, (json.loads(text) if "json" in r.headers["Content-Type"] else text)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def until(check, what, timeout=15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout} s")


def best(port, tokens=PROMPT):
    status, got = http(port, "POST", "/query", {"token_ids": tokens})
    assert status == 200, got
    return [(m["engine"], m["blocks"], m["state"]) for m in got["matches"]]


def engine(cleanup, blocks, parent=None):
    """A Python publisher that stores `blocks` (hashes) of PROMPT from its start; its spec."""
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep, ring=100))
    n = len(blocks)
    pub.publish([to_wire(stored(blocks, parent, PROMPT[: 16 * n]), "current")], ts=ts_of(0))
    return pub, f"{pub_ep},{rep_ep}"


def test_the_index_service_answers_a_router_and_follows_engines_coming_and_going(
    events_bin, cleanup, tmp_path
):
    a, a_spec = engine(cleanup, [1, 2, 3])
    b, b_spec = engine(cleanup, [1])
    port = free_port()
    engines = tmp_path / "engines.txt"
    engines.write_text(f"# the fleet\nb={b_spec}\n")
    cli = cleanup(Cli(events_bin, ["index", "--listen", f"127.0.0.1:{port}",
                                   "--engine", f"a={a_spec}", "--engines-file", str(engines)]))
    cli.wait_stderr("listening on")
    # Both bootstrap from their replay (their batches went out before anyone listened).
    until(lambda: best(port) == [("a", 3, "exact"), ("b", 1, "exact")], "both engines indexed")
    status, got = http(port, "POST", "/query_by_hash", {"block_hashes": [1, 2]})
    assert got["best"]["engine"] == "a" and got["best"]["blocks"] == 2 and got["best"]["tokens"] == 32
    # A removal on a's stream ends its match there.
    a.publish([to_wire(removed([2]), "current")], ts=ts_of(1))
    until(lambda: best(port)[0] == ("a", 1, "exact") or None, "the removal applied")
    # c registers while it runs; b leaves the file.
    c, c_spec = engine(cleanup, [1, 2, 3, 4])
    ep, rep = c_spec.split(",")
    assert http(port, "POST", "/register", {"name": "c", "endpoint": ep, "replay_endpoint": rep})[0] == 200
    engines.write_text("# b is gone\n")
    until(lambda: best(port) == [("c", 4, "exact"), ("a", 1, "exact")], "c in, b out")
    # a restarts: nothing it held before counts.
    a.restart()
    a.publish([to_wire(stored([9], None, [5] * 16), "current")], ts=ts_of(0))
    until(lambda: best(port) == [("c", 4, "exact")], "a's old blocks dropped")
    status, engines_now = http(port, "GET", "/engines")
    by_name = {e["name"]: e for e in engines_now["engines"]}
    assert set(by_name) == {"a", "c"} and by_name["a"]["restarts"] == 1, engines_now
    status, dump = http(port, "GET", "/dump")
    held = {(h["engine"], tuple(h["block_hashes"])) for h in dump["holders"]}
    assert held == {("a", (9,)), ("c", (1, 2, 3, 4))}, dump
    status, metrics = http(port, "GET", "/metrics")
    assert 'kvlink_index_holder_blocks{engine="c",dp_rank="0",medium="GPU",group="0"} 4' in metrics
    assert 'kvlink_index_resyncs_total{engine="a",reason="publisher_restart"} 1' in metrics
    assert http(port, "POST", "/query", {"token_ids": "no"})[0] == 400
    assert http(port, "POST", "/unregister", {"name": "c"})[1] == {"unregistered": True}
    assert best(port) == []
    cli.proc.send_signal(signal.SIGTERM)
    cli.assert_exit_ok(time.monotonic() + 10)
    cli.wait_stderr("stopped;")


def churned_engine(cleanup):
    """A kvlink publisher that stored PROMPT's four blocks, then stored and removed 40 more:
    its ring (4 batches) no longer holds the store of PROMPT."""
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(Publisher(bound(pub_ep), replay_endpoint=bound(rep_ep), buffer_steps=4))
    pub.publish([stored([1, 2, 3, 4], None, PROMPT)])
    for i in range(40):
        pub.publish([stored([100 + i], None, [7 + i] * 16)])
        pub.publish([removed([100 + i])])
    until(lambda: pub.stats()["published"] == 81, "the batches sent")
    assert pub.stats()["live_blocks"] == 4
    return pub, pub_ep, rep_ep


def test_a_late_index_loads_a_kvlink_engines_snapshot_and_is_exact_at_once(events_bin, cleanup):
    pub, pub_ep, rep_ep = churned_engine(cleanup)
    port = free_port()
    cli = cleanup(Cli(events_bin, ["index", "--listen", f"127.0.0.1:{port}",
                                   "--engine", f"k={pub_ep},{rep_ep}"]))
    cli.wait_stderr("listening on")
    # Replayed from 0, the ring starts at 77: the publisher answers with its live blocks.
    until(lambda: best(port) == [("k", 4, "exact")], "the snapshot loaded")
    status, metrics = http(port, "GET", "/metrics")
    assert 'kvlink_index_snapshots_total{engine="k"} 1' in metrics, metrics
    assert 'kvlink_index_resyncs_total{engine="k",reason="history_lost"} 0' in metrics
    # The stream goes on from the snapshot's sequence.
    pub.publish([removed([4])])
    until(lambda: best(port) == [("k", 3, "exact")] or None, "a live removal applied")
    assert pub.stats()["snapshots"] == 1
    # The same from Python: a subscriber asking for snapshots, and the index it feeds.
    sub = Subscriber(pub_ep, replay_endpoint=rep_ep, start_from=0, snapshots=True)
    index = Index()
    item = until(lambda: sub.next(0.5), "the first item")
    assert item["kind"] == "snapshot", item
    # The snapshot the service got (a second ago at most) and the ring since, or a new one.
    assert [e["block_hashes"] for b in item["batches"] for e in b["events"]] in ([[1, 2, 3, 4]], [[1, 2, 3]])
    index.apply("k", item)
    while item["seq"] < 81:
        item = until(lambda: sub.next(0.5), "the removal")
        index.apply("k", item)
    got = index.overlap_tokens(PROMPT, 16)
    assert [(m["blocks"], m["state"]) for m in got] == [(3, "exact")]
    assert index.stats()["snapshots"] == 1 and sub.stats()["snapshots"] == 1
    cli.proc.send_signal(signal.SIGTERM)
    cli.assert_exit_ok(time.monotonic() + 10)
