"""A KV-cache event publisher and subscriber in plain Python (pyzmq + msgpack), written from the
wire formats of vLLM, SGLang and ATOM KV-cache events, to check kvlink against an independent
implementation.

Live stream: PUB sends ``[topic, seq (8 bytes big-endian), payload]``, payload being msgpack of
``[ts, events, dp_rank]``. Replay: a ROUTER answers ``[id, "", start_seq]`` with every buffered
batch whose seq >= start_seq, then an end marker whose seq frame is 0xFF * 8.
"""

import collections
import threading
import time

import msgpack
import zmq

END_SEQ = b"\xff" * 8

BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"

# BlockStored fields with a default (omitted from a map when unset), in legacy array order.
STORED_OPTIONAL = ("extra_keys", "group_idx", "kv_cache_spec_kind",
                   "kv_cache_spec_sliding_window")


def _encode_event(tag, required, optional, encoding):
    """One event in either encoding.

    ``required`` and ``optional`` are lists of (name, value) pairs in declaration order. Current
    encoding: a map with "type" first, required fields always, optional ones only when set.
    Legacy: an array, tag first, then every declared field positionally, nil when unset (what
    msgspec writes for an array-like struct).
    """
    if encoding == "current":
        event = {"type": tag}
        event.update(required)
        event.update((k, v) for k, v in optional if v is not None)
        return event
    if encoding == "legacy":
        return [tag] + [v for _, v in required] + [v for _, v in optional]
    raise ValueError(f"unknown encoding {encoding!r}")


def block_stored(block_hashes, parent_block_hash, token_ids, block_size, lora_id=None,
                 medium="GPU", lora_name=None, *, extra_keys=None, group_idx=None,
                 kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None,
                 encoding="current"):
    """A BlockStored event; hashes may be ints (u64 or i64) or bytes (msgpack bin)."""
    required = [("block_hashes", list(block_hashes)), ("parent_block_hash", parent_block_hash),
                ("token_ids", list(token_ids)), ("block_size", block_size),
                ("lora_id", lora_id), ("medium", medium), ("lora_name", lora_name)]
    optional = list(zip(STORED_OPTIONAL, (extra_keys, group_idx, kv_cache_spec_kind,
                                          kv_cache_spec_sliding_window)))
    return _encode_event(BLOCK_STORED, required, optional, encoding)


def block_removed(block_hashes, medium="GPU", *, group_idx=None, encoding="current"):
    """A BlockRemoved event."""
    required = [("block_hashes", list(block_hashes)), ("medium", medium)]
    return _encode_event(BLOCK_REMOVED, required, [("group_idx", group_idx)], encoding)


def all_blocks_cleared(*, encoding="current"):
    """An AllBlocksCleared event (no fields)."""
    return _encode_event(ALL_BLOCKS_CLEARED, [], [], encoding)


def seq_frame(seq):
    return seq.to_bytes(8, "big")


def decode_payload(payload):
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


class PyPublisher:
    """Binds a PUB (and optionally a ROUTER serving replay from a ring of recent batches).

    ``encoding`` ("current" or "legacy") is the one the ``block_stored``, ``block_removed`` and
    ``all_blocks_cleared`` methods build events in. The replay ROUTER belongs to a background
    thread from construction until ``close()``; ``replay_format`` "current" replies
    ``[id, "", topic, seq, payload]``, "legacy" (vLLM <= 0.25) ``[id, "", seq, payload]``.
    """

    def __init__(self, endpoint, replay_endpoint=None, topic=b"", encoding="current", ring=10000,
                 replay_format="current"):
        if encoding not in ("current", "legacy"):
            raise ValueError(f"unknown encoding {encoding!r}")
        if replay_format not in ("current", "legacy"):
            raise ValueError(f"unknown replay format {replay_format!r}")
        self.topic = topic
        self.encoding = encoding
        self.replay_format = replay_format
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100000)
        self._pub.bind(endpoint)
        self._seq = 0
        self._ring = collections.deque(maxlen=ring)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._router = None
        self._thread = None
        if replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def block_stored(self, *args, **kwargs):
        return block_stored(*args, encoding=self.encoding, **kwargs)

    def block_removed(self, *args, **kwargs):
        return block_removed(*args, encoding=self.encoding, **kwargs)

    def all_blocks_cleared(self):
        return all_blocks_cleared(encoding=self.encoding)

    def publish(self, events, ts=None, dp_rank=0, skip_live=False):
        """Publishes one batch ``[ts, events, dp_rank]``; returns its seq.

        ``skip_live`` keeps the batch in the ring without sending it live, as a PUB does when it
        drops a message at its high-water mark.
        """
        if ts is None:
            ts = time.time()
        payload = msgpack.packb([float(ts), events, dp_rank], use_bin_type=True)
        return self.publish_raw(payload, skip_live=skip_live)

    def publish_raw(self, payload, skip_live=False):
        """Publishes arbitrary payload bytes under the next seq; returns that seq."""
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._ring.append((seq, payload))
        if not skip_live:
            self._pub.send_multipart([self.topic, seq_frame(seq), payload])
        return seq

    def restart(self):
        """Behaves as a restarted publisher: seq back to 0, replay history gone."""
        with self._lock:
            self._seq = 0
            self._ring.clear()

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                raise RuntimeError("replay thread did not stop")
            self._router.close()
        self._pub.close()
        self._ctx.term()

    def _serve_replay(self):
        while not self._stop.is_set():
            if not self._router.poll(50, zmq.POLLIN):
                continue
            frames = self._router.recv_multipart()
            # [identity, "", start_seq]; anything else is ignored, as vLLM does.
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            with self._lock:
                batches = [(s, p) for s, p in self._ring if s >= start]
            head = [ident, b""] + ([self.topic] if self.replay_format == "current" else [])
            for seq, payload in batches:
                self._router.send_multipart(head + [seq_frame(seq), payload])
            end_head = [ident, b""] + ([b""] if self.replay_format == "current" else [])
            self._router.send_multipart(end_head + [END_SEQ, b""])


class PySubscriber:
    """Connects a SUB (filtered by topic prefix) and, when given, replays from a ROUTER."""

    def __init__(self, endpoint, replay_endpoint=None, topic=b""):
        self.replay_endpoint = replay_endpoint
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100000)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)

    def recv_frames(self, timeout):
        """The next live multipart message as a list of frames, or None after ``timeout`` s."""
        if not self._sub.poll(int(timeout * 1000), zmq.POLLIN):
            return None
        return self._sub.recv_multipart()

    def recv(self, timeout):
        """The next live batch as ``(topic, seq, decoded payload)``, or None after ``timeout``."""
        frames = self.recv_frames(timeout)
        if frames is None:
            return None
        if len(frames) != 3 or len(frames[1]) != 8:
            raise ValueError(f"not a [topic, seq, payload] message: {frames!r}")
        return frames[0], int.from_bytes(frames[1], "big"), decode_payload(frames[2])

    def replay_frames(self, start_seq, timeout):
        """Every reply to one replay request, end marker included, as lists of frames (after
        the DEALER strips the identity). Raises TimeoutError without an end marker in time."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", seq_frame(start_seq)])
            replies = []
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(int(left * 1000) + 1, zmq.POLLIN):
                    raise TimeoutError(f"no replay end marker within {timeout} s")
                frames = dealer.recv_multipart()
                # ["", topic, seq, payload] (vLLM >= 0.26, SGLang) or ["", seq, payload].
                if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                    raise ValueError(f"not a replay reply: {frames!r}")
                replies.append(frames)
                if frames[-2] == END_SEQ:
                    return replies
        finally:
            dealer.close()

    def replay(self, start_seq, timeout):
        """Replays from ``start_seq``: a list of ``(seq, decoded payload)``, end marker excluded."""
        replies = self.replay_frames(start_seq, timeout)
        return [(int.from_bytes(f[-2], "big"), decode_payload(f[-1])) for f in replies[:-1]]

    def close(self):
        self._sub.close()
        self._ctx.term()
