"""kvlink's KV-cache event stream against an independent Python peer (events_peers.py): the
`kvlink-events publish` CLI read by a pyzmq subscriber, and `kvlink-events tail` reading a pyzmq
publisher, in both event encodings, with gaps filled by replay, restarts, lost history and
malformed input. The first tests check the Python peers themselves and need no Rust build."""

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("zmq", reason="pyzmq not installed in this venv")
pytest.importorskip("msgpack", reason="msgpack not installed in this venv")

import msgpack  # noqa: E402
import zmq  # noqa: E402

import events_peers as ep  # noqa: E402
from events_peers import END_SEQ, PyPublisher, PySubscriber, decode_payload, seq_frame  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ports import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 15.0  # seconds, for anything that should take well under one


# ---------------------------------------------------------------------------------------------
# Harness

@pytest.fixture(scope="module")
def events_bin():
    env = os.environ.get("KVLINK_EVENTS_BIN")
    if env:
        if not os.access(env, os.X_OK):
            pytest.fail(f"KVLINK_EVENTS_BIN={env} is not an executable file")
        return env
    for build in ("debug", "release"):
        path = REPO / "target" / build / "kvlink-events"
        if os.access(path, os.X_OK):
            return str(path)
    pytest.skip("kvlink-events not built: cargo build -p kvlink-events-cli")


@pytest.fixture
def cleanup():
    """Registers objects with a close() method; closes them all, last first, at teardown."""
    items = []

    def add(item):
        items.append(item)
        return item

    yield add
    errors = []
    for item in reversed(items):
        try:
            item.close()
        except Exception as e:  # close the rest, then report
            errors.append(e)
    if errors:
        raise errors[0]


_GIVEN_PORTS = set()


def free_endpoint():
    """A loopback endpoint on a free port, never one already handed out in this session: the
    kernel may give a just-released port again, and two endpoints of one test must differ."""
    while True:
        port = free_port()
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return f"tcp://127.0.0.1:{port}"


def bound(endpoint):
    """The endpoint kvlink's publisher must be given to listen on it: vLLM's rule binds only
    endpoints with `*` (or `::`, or ipc) and connects to the others."""
    return endpoint.replace("tcp://127.0.0.1:", "tcp://*:")


class Cli:
    """A running kvlink-events process; stdout and stderr are drained by threads so that every
    wait can have a timeout."""

    def __init__(self, binary, args):
        self.args = args
        self.proc = subprocess.Popen([binary, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        self._stdout = queue.Queue()
        self._stderr = []
        self._stderr_done = False
        self._cond = threading.Condition()
        self._pumps = [threading.Thread(target=f, daemon=True) for f in (self._pump_stdout, self._pump_stderr)]
        for t in self._pumps:
            t.start()

    def _pump_stdout(self):
        for line in self.proc.stdout:
            self._stdout.put(line)
        self._stdout.put(None)

    def _pump_stderr(self):
        for line in self.proc.stderr:
            with self._cond:
                self._stderr.append(line)
                self._cond.notify_all()
        with self._cond:
            self._stderr_done = True
            self._cond.notify_all()

    def stderr(self):
        with self._cond:
            return "".join(self._stderr)

    def _context(self):
        return f"kvlink-events {' '.join(self.args)}\nstderr:\n{self.stderr()}"

    def wait_stderr(self, needle, timeout=TIMEOUT):
        def seen():
            return any(needle in line for line in self._stderr)

        with self._cond:
            self._cond.wait_for(lambda: seen() or self._stderr_done, timeout)
            found = seen()
        assert found, f"no {needle!r} on stderr within {timeout} s; {self._context()}"

    def send(self, obj):
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def close_stdin(self):
        self.proc.stdin.close()

    def read_json(self, deadline):
        """The next stdout line parsed as JSON, or None at EOF; fails at the deadline."""
        try:
            line = self._stdout.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no stdout line in time; {self._context()}") from None
        if line is None:
            self._stdout.put(None)  # later reads see EOF too
            return None
        try:
            return json.loads(line)
        except ValueError:
            raise AssertionError(f"stdout line is not JSON: {line!r}") from None

    def read_until(self, done, timeout=TIMEOUT):
        """Stdout JSON lines up to and including the first one for which ``done`` is true."""
        deadline, lines = time.monotonic() + timeout, []
        while True:
            obj = self.read_json(deadline)
            assert obj is not None, f"stdout closed after {lines}; {self._context()}"
            lines.append(obj)
            if done(obj):
                return lines

    def lines_until_exit(self, timeout=TIMEOUT):
        """Every remaining stdout JSON line; asserts the process then exits with status 0."""
        deadline, lines = time.monotonic() + timeout, []
        while (obj := self.read_json(deadline)) is not None:
            lines.append(obj)
        self.assert_exit_ok(deadline)
        return lines

    def assert_exit_ok(self, deadline):
        try:
            rc = self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running; {self._context()}") from None
        assert rc == 0, f"exit status {rc}; {self._context()}"

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=TIMEOUT)
        # The pumps read to the pipes' end (the process is gone) before the pipes are closed
        # under them.
        for t in self._pumps:
            t.join(timeout=TIMEOUT)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                pipe.close()
            except OSError:
                pass  # stdin already broken or closed


# ---------------------------------------------------------------------------------------------
# Events in the CLI's JSON form (every field present, null when unset) and their wire forms

def stored(hashes, parent, tokens, block_size=16, *, medium="GPU", lora_id=None, lora_name=None,
           group_idx=None, kind=None, window=None):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": block_size, "lora_id": lora_id,
            "medium": medium, "lora_name": lora_name, "group_idx": group_idx,
            "extra_keys": None, "kv_cache_spec_kind": kind,
            "kv_cache_spec_sliding_window": window, "token_offset": None, "locality": None,
            "ownership": None, "session_id": None, "lookahead_token_ids": None,
            "cache_salt": None}


def removed(hashes, medium="GPU", group_idx=None):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium,
            "group_idx": group_idx, "locality": None, "ownership": None}


def cleared():
    return {"type": "AllBlocksCleared", "medium": None}


def sparse(event):
    """The JSON form without its null fields (the CLI reads absent as null)."""
    return {k: v for k, v in event.items() if v is not None}


def wire_hash(h):
    return bytes.fromhex(h["bytes"]) if isinstance(h, dict) else h


def to_wire(event, encoding, extra_keys=None):
    """The msgpack-ready wire form of a JSON-form event, built by the Python peer."""
    kind = event["type"]
    if kind == "BlockStored":
        assert event["token_offset"] is None, "the Python peer has no ATOM token_offset"
        parent = event["parent_block_hash"]
        return ep.block_stored(
            [wire_hash(h) for h in event["block_hashes"]],
            None if parent is None else wire_hash(parent), event["token_ids"],
            event["block_size"], event["lora_id"], event["medium"], event["lora_name"],
            extra_keys=extra_keys, group_idx=event["group_idx"],
            kv_cache_spec_kind=event["kv_cache_spec_kind"],
            kv_cache_spec_sliding_window=event["kv_cache_spec_sliding_window"],
            encoding=encoding)
    if kind == "BlockRemoved":
        return ep.block_removed([wire_hash(h) for h in event["block_hashes"]], event["medium"],
                                group_idx=event["group_idx"], encoding=encoding)
    assert kind == "AllBlocksCleared" and event["medium"] is None
    return ep.all_blocks_cleared(encoding=encoding)


def tokens(start, blocks, block_size=16):
    return list(range(start, start + blocks * block_size))


def batch_line(seq, ts, events, dp_rank=0, topic=""):
    """What tail prints for a batch with nothing skipped."""
    return {"seq": seq, "topic": topic, "ts": ts, "dp_rank": dp_rank, "events": events,
            "skipped": []}


def ts_of(seq):
    return 1_700_000_000.5 + seq * 0.25  # exact in binary, so it survives JSON both ways


H32 = "9f" + "00" * 30 + "a1"  # a 32-byte digest (sha256-sized bin hash)
H32B = "".join(f"{i:02x}" for i in range(32))


def publisher_batches():
    """(ts, dp_rank, JSON-form events) fed to `kvlink-events publish`."""
    events = [
        [stored([2**64 - 1, 2**63], None, tokens(0, 2))],
        [stored([2**63 + 5], 2**63, tokens(32, 1), medium="CPU")],
        [stored([12345], 2**63 + 5, tokens(48, 1), lora_id=3, lora_name="adapter-a")],
        [removed([2**64 - 1, 2**63])],
        [stored([-1, -2**63], None, tokens(100, 2), group_idx=1, kind="sliding_window",
                window=128)],
        [removed([12345], medium="CPU", group_idx=2)],
        [stored([{"bytes": H32}], {"bytes": H32B}, tokens(200, 1))],
        [cleared()],
        [stored([7, 8], 2**64 - 2, tokens(300, 2)), removed([2**63 + 5]),
         stored([9], 8, [1, 2, 3, 4, 5], block_size=5)],
        [removed([7], medium=None)],
    ]
    return [(ts_of(i), i % 2, evs) for i, evs in enumerate(events)]


# ---------------------------------------------------------------------------------------------
# The Python peers on their own (no Rust build needed)

def test_event_builders_both_encodings():
    got = ep.block_stored([2**63], -1, [1, 2], 2, group_idx=3)
    assert list(got.items()) == [
        ("type", "BlockStored"), ("block_hashes", [2**63]), ("parent_block_hash", -1),
        ("token_ids", [1, 2]), ("block_size", 2), ("lora_id", None), ("medium", "GPU"),
        ("lora_name", None), ("group_idx", 3)]
    assert ep.block_stored([b"\x01"], None, [1], 1, encoding="legacy") == [
        "BlockStored", [b"\x01"], None, [1], 1, None, "GPU", None, None, None, None, None]
    assert ep.block_stored([1], None, [1], 1, group_idx=0, encoding="legacy") == [
        "BlockStored", [1], None, [1], 1, None, "GPU", None, None, 0, None, None]
    assert ep.block_removed([1], "CPU", encoding="legacy") == [
        "BlockRemoved", [1], "CPU", None]
    assert ep.block_removed([1], group_idx=2) == {
        "type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 2}
    assert ep.all_blocks_cleared() == {"type": "AllBlocksCleared"}
    assert ep.all_blocks_cleared(encoding="legacy") == ["AllBlocksCleared"]
    # The msgpack kinds the hashes take on the wire: uint64, int64, bin.
    packed = msgpack.packb([2**64 - 1, -2**63, b"\x00" * 32])
    assert packed[1] == 0xCF and packed[10] == 0xD3 and packed[19:21] == b"\xc4\x20"


@pytest.mark.parametrize("replay_format", ["current", "legacy"])
def test_python_peers_live_and_replay(cleanup, replay_format):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep, topic=b"kv", replay_format=replay_format))
    sub = cleanup(PySubscriber(pub_ep, rep_ep, topic=b"kv"))
    time.sleep(0.3)
    sent = [[pub.block_stored([2**63 + s], None, tokens(s, 1), 16)] for s in range(5)]
    for s, events in enumerate(sent):
        assert pub.publish(events, ts=ts_of(s), skip_live=(s == 2)) == s
    live = [sub.recv(TIMEOUT) for _ in range(4)]
    assert live == [(b"kv", s, [ts_of(s), sent[s], 0]) for s in (0, 1, 3, 4)]
    assert sub.recv(0.2) is None
    assert sub.replay(1, TIMEOUT) == [(s, [ts_of(s), sent[s], 0]) for s in range(1, 5)]
    replies = sub.replay_frames(3, TIMEOUT)
    if replay_format == "current":
        assert [f[:3] for f in replies] == [[b"", b"kv", seq_frame(3)], [b"", b"kv", seq_frame(4)],
                                            [b"", b"", END_SEQ]]
    else:
        assert [f[:2] for f in replies] == [[b"", seq_frame(3)], [b"", seq_frame(4)],
                                            [b"", END_SEQ]]
    assert replies[-1][-1] == b""
    assert sub.replay(5, TIMEOUT) == []


def test_python_publisher_ring_restart_and_bad_requests(cleanup):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep, ring=3))
    sub = cleanup(PySubscriber(pub_ep, rep_ep))
    for s in range(5):
        pub.publish([pub.all_blocks_cleared()], ts=ts_of(s))
    assert [s for s, _ in sub.replay(0, TIMEOUT)] == [2, 3, 4]
    # Malformed requests get no answer; the ROUTER keeps serving.
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(rep_ep)
        dealer.send_multipart([b"", b"\x00\x01"])
        dealer.send_multipart([b"x", seq_frame(0)])
        assert not dealer.poll(300, zmq.POLLIN)
    finally:
        dealer.close()
    pub.restart()
    assert sub.replay(0, TIMEOUT) == []
    assert pub.publish_raw(b"\xc1") == 0
    assert sub.replay_frames(0, TIMEOUT)[0] == [b"", b"", seq_frame(0), b"\xc1"]


# ---------------------------------------------------------------------------------------------
# kvlink-events publish -> Python subscriber

@pytest.mark.parametrize("encoding", ["current", "legacy"])
def test_python_subscriber_reads_kvlink_stream(events_bin, cleanup, encoding):
    # One case with the default empty topic, one with a topic frame to filter on.
    topic = "" if encoding == "current" else "kv-events"
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    sub = cleanup(PySubscriber(pub_ep, rep_ep, topic=topic.encode()))
    topic_args = ["--topic", topic] if topic else []
    cli = cleanup(Cli(events_bin, ["publish", "--endpoint", bound(pub_ep), "--replay", rep_ep,
                                   *topic_args, "--encoding", encoding, "--linger-ms", "300"]))
    cli.wait_stderr("listening")
    time.sleep(0.5)
    batches = publisher_batches()
    for i, (ts, dp_rank, events) in enumerate(batches):
        # Odd batches leave their null fields out, even ones spell them.
        line_events = events if i % 2 == 0 else [sparse(e) for e in events]
        cli.send({"ts": ts, "dp_rank": dp_rank, "events": line_events})

    live = []
    for seq in range(len(batches)):
        frames = sub.recv_frames(TIMEOUT)
        assert frames is not None, f"batch {seq} never arrived; {cli.stderr()}"
        live.append(frames)
    assert sub.recv_frames(0.3) is None
    incarnations = set()
    for seq, (frames, (ts, dp_rank, events)) in enumerate(zip(live, batches)):
        assert len(frames) == 3
        assert frames[0] == topic.encode()
        assert frames[1] == seq_frame(seq)
        payload = decode_payload(frames[2])
        # kvlink's fourth element, its incarnation: consumers that read three ignore it.
        assert len(payload) == 4 and isinstance(payload[3], int), payload
        incarnations.add(payload[3])
        assert payload[:3] == [ts, [to_wire(e, encoding) for e in events], dp_rank]
        for event in payload[1]:
            if encoding == "current":
                assert isinstance(event, dict) and next(iter(event)) == "type"
            else:
                assert isinstance(event, list) and isinstance(event[0], str)
    assert len(incarnations) == 1, "one run, one incarnation"

    replies = sub.replay_frames(4, TIMEOUT)
    assert replies == [[b"", topic.encode(), seq_frame(s), live[s][2]] for s in range(4, 10)] + [
        [b"", b"", END_SEQ, b""]]
    assert sub.replay(4, TIMEOUT) == [(s, decode_payload(live[s][2])) for s in range(4, 10)]
    assert sub.replay_frames(10, TIMEOUT) == [[b"", b"", END_SEQ, b""]]
    cli.close_stdin()
    cli.assert_exit_ok(time.monotonic() + TIMEOUT)


def test_kvlink_publish_legacy_replay_format(events_bin, cleanup):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    sub = cleanup(PySubscriber(pub_ep, rep_ep, topic=b"t"))
    cli = cleanup(Cli(events_bin, ["publish", "--endpoint", bound(pub_ep), "--replay", rep_ep,
                                   "--topic", "t", "--replay-format", "legacy",
                                   "--linger-ms", "300"]))
    cli.wait_stderr("listening")
    time.sleep(0.5)
    for seq in range(3):
        cli.send({"ts": ts_of(seq), "dp_rank": 0, "events": [removed([seq])]})
    live = [sub.recv_frames(TIMEOUT) for _ in range(3)]
    assert [f[:2] if f else f for f in live] == [[b"t", seq_frame(s)] for s in range(3)]
    # vLLM <= 0.25 replies: no topic frame, 3 frames after the DEALER.
    assert sub.replay_frames(1, TIMEOUT) == [
        [b"", seq_frame(1), live[1][2]], [b"", seq_frame(2), live[2][2]], [b"", END_SEQ, b""]]
    cli.close_stdin()
    cli.assert_exit_ok(time.monotonic() + TIMEOUT)


# ---------------------------------------------------------------------------------------------
# Python publisher -> kvlink-events tail

def start_tail(events_bin, cleanup, pub_ep, rep_ep, *extra, wait_subscribed=True):
    cli = cleanup(Cli(events_bin, ["tail", "--endpoint", pub_ep, "--replay", rep_ep, *extra]))
    if wait_subscribed:
        cli.wait_stderr("subscribed")
        time.sleep(0.3)  # the subscription reaches the PUB asynchronously
    return cli


def simple_batch(seq, base=0):
    """A one-event batch (JSON form) identifying its seq."""
    return [stored([base + seq], None, tokens(seq, 1))]


@pytest.mark.parametrize("encoding", ["current", "legacy"])
def test_kvlink_reads_python_publisher(events_bin, cleanup, encoding):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep, topic=b"kv", encoding=encoding))
    batches = [
        [stored([2**64 - 1, 2**63], None, tokens(0, 2))],
        [stored([-1, -2**63], 2**63, tokens(32, 2), medium="CPU_PINNED")],
        [stored([{"bytes": H32}], -1, tokens(64, 1), lora_id=7, lora_name="adapter")],
        [stored([5], {"bytes": H32B}, [1, 2, 3, 4, 5], block_size=5, group_idx=2,
                kind="sliding_window", window=4096)],
        [removed([2**64 - 1, -1]), removed([{"bytes": H32}], medium=None, group_idx=3)],
        [cleared(), stored([0], 2**64 - 1, tokens(149_000, 1), medium="STORAGE")],
    ]
    extra_keys = {3: [[["mm", 0]]]}  # by batch
    cli = start_tail(events_bin, cleanup, pub_ep, rep_ep, "--topic", "kv",
                     "--count", str(len(batches) + 2))
    expected = []
    for seq, events in enumerate(batches):
        wire = [to_wire(e, encoding, extra_keys.get(seq)) for e in events]
        shown = [dict(e) for e in events]
        if seq in extra_keys:
            shown[0]["extra_keys"] = extra_keys[seq]
        if seq == 1:
            # A field kvlink does not model: a map's key, or a legacy array's trailing element.
            if encoding == "current":
                wire[0]["future_field"] = {"nested": [1, 2]}
                shown[0]["future_field"] = {"nested": [1, 2]}
            else:
                wire[0] += [None] * (18 - len(wire[0])) + [{"nested": [1, 2]}]
                shown[0]["@18"] = {"nested": [1, 2]}
        pub.publish(wire, ts=ts_of(seq), dp_rank=seq % 3)
        expected.append(batch_line(seq, ts_of(seq), shown, seq % 3, topic="kv"))
    # Older 2-element batches (no dp_rank), and trailing batch elements ignored.
    event = removed([2**63])
    wire = [to_wire(event, encoding)]
    pub.publish_raw(msgpack.packb([ts_of(6), wire]))
    pub.publish_raw(msgpack.packb([ts_of(7), wire, 4, "future"]))
    expected += [batch_line(6, ts_of(6), [event], None, topic="kv"),
                 batch_line(7, ts_of(7), [event], 4, topic="kv")]
    assert cli.lines_until_exit() == expected


@pytest.mark.parametrize("replay_format", ["current", "legacy"])
def test_kvlink_fills_gap_by_replay(events_bin, cleanup, replay_format):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep, replay_format=replay_format))
    cli = start_tail(events_bin, cleanup, pub_ep, rep_ep, "--count", "10")
    for seq in range(10):
        # 3, 4 and 7 are dropped live (as at a PUB high-water mark) but stay replayable.
        pub.publish([to_wire(e, "current") for e in simple_batch(seq)], ts=ts_of(seq),
                    skip_live=seq in (3, 4, 7))
        time.sleep(0.05)
    assert cli.lines_until_exit() == [
        batch_line(seq, ts_of(seq), simple_batch(seq)) for seq in range(10)]


def test_kvlink_late_subscriber_bootstraps_from_zero(events_bin, cleanup):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep))
    for seq in range(4):  # before anyone listens: lost live, kept in the ring
        pub.publish([to_wire(e, "current") for e in simple_batch(seq)], ts=ts_of(seq))
    cli = start_tail(events_bin, cleanup, pub_ep, rep_ep, "--count", "6")
    for seq in range(4, 6):
        pub.publish([to_wire(e, "current") for e in simple_batch(seq)], ts=ts_of(seq))
    assert cli.lines_until_exit() == [
        batch_line(seq, ts_of(seq), simple_batch(seq)) for seq in range(6)]


def test_kvlink_reports_restart(events_bin, cleanup):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep))
    cli = start_tail(events_bin, cleanup, pub_ep, rep_ep, "--count", "8")
    for seq in range(5):
        pub.publish([to_wire(e, "current") for e in simple_batch(seq)], ts=ts_of(seq))
    first = cli.read_until(lambda line: line.get("seq") == 4)
    pub.restart()
    for seq in range(3):
        pub.publish([to_wire(e, "current") for e in simple_batch(seq, 1000)], ts=ts_of(seq))
    assert first + cli.lines_until_exit() == (
        [batch_line(seq, ts_of(seq), simple_batch(seq)) for seq in range(5)]
        + [{"resync": "publisher_restart", "last": 4, "now": 0}]
        + [batch_line(seq, ts_of(seq), simple_batch(seq, 1000)) for seq in range(3)])


def test_kvlink_drops_a_repeated_sequence_instead_of_reporting_a_restart(events_bin, cleanup):
    # The wire spec drops duplicates by sequence; only a sequence going down is a restart.
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep))
    cli = start_tail(events_bin, cleanup, pub_ep, rep_ep, "--count", "7")
    payloads = [msgpack.packb([ts_of(seq), [to_wire(e, "current") for e in simple_batch(seq)], 0])
                for seq in range(7)]
    for seq in range(6):
        pub.publish_raw(payloads[seq])
    pub._pub.send_multipart([pub.topic, seq_frame(5), payloads[5]])  # seq 5 again
    pub.publish_raw(payloads[6])
    assert cli.lines_until_exit() == [
        batch_line(seq, ts_of(seq), simple_batch(seq)) for seq in range(7)]


def test_kvlink_publish_keeps_every_bit_of_ts(events_bin, cleanup):
    # 17 significant digits: a parser that is not exact loses the last bit of some of these.
    stamps = [1795255560.1496913 + i * 0.0123456789 for i in range(40)]
    pub_ep = free_endpoint()
    sub = cleanup(PySubscriber(pub_ep, None))
    cli = cleanup(Cli(events_bin, ["publish", "--endpoint", bound(pub_ep), "--linger-ms", "300"]))
    cli.wait_stderr("listening")
    time.sleep(0.5)
    for ts in stamps:
        cli.send({"ts": ts, "events": []})  # json writes floats exactly (repr)
    got = []
    for _ in stamps:
        frames = sub.recv_frames(TIMEOUT)
        assert frames is not None, cli.stderr()
        got.append(decode_payload(frames[2])[0])
    assert got == stamps
    cli.close_stdin()
    cli.assert_exit_ok(time.monotonic() + TIMEOUT)


def test_kvlink_reports_history_lost(events_bin, cleanup):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep, ring=3))
    for seq in range(10):  # nobody listens; the ring keeps 7, 8, 9
        pub.publish([to_wire(e, "current") for e in simple_batch(seq)], ts=ts_of(seq))
    cli = start_tail(events_bin, cleanup, pub_ep, rep_ep, "--from", "0", "--count", "3",
                     wait_subscribed=False)
    assert cli.lines_until_exit() == (
        [{"resync": "history_lost", "from": 0, "resumed": 7}]
        + [batch_line(seq, ts_of(seq), simple_batch(seq)) for seq in (7, 8, 9)])


def test_kvlink_skips_malformed_event_keeps_rest(events_bin, cleanup):
    pub_ep, rep_ep = free_endpoint(), free_endpoint()
    pub = cleanup(PyPublisher(pub_ep, rep_ep))
    cli = start_tail(events_bin, cleanup, pub_ep, rep_ep, "--idle-exit", "2")
    good = [stored([2**63 + 1], None, tokens(0, 1)), removed([2**63 + 1])]
    pub.publish([to_wire(good[0], "current"), {"type": "Bogus"}, [1, 2, 3],
                 {"type": "BlockStored", "block_hashes": "not a list"},
                 to_wire(good[1], "current")], ts=ts_of(0))
    pub.publish_raw(b"\xc1\xff")  # seq 1: not msgpack at all
    last = [cleared()]
    pub.publish([to_wire(e, "current") for e in last], ts=ts_of(2))
    lines = cli.lines_until_exit()  # also checks --idle-exit ends it with status 0

    malformed = [line for line in lines if "malformed" in line]
    # Exactly one: the batch of seq 1, which is not msgpack at all.
    assert len(malformed) == 1, lines
    assert malformed[0]["malformed"] == 1 and isinstance(malformed[0]["reason"], str), malformed
    batches = [line for line in lines if "malformed" not in line]
    assert len(batches) == 2, lines
    skipped = batches[0].pop("skipped")
    assert len(skipped) == 3 and all(isinstance(r, str) and r for r in skipped), skipped
    assert batches[0] == {"seq": 0, "topic": "", "ts": ts_of(0), "dp_rank": 0, "events": good}
    assert batches[1] == batch_line(2, ts_of(2), last)
