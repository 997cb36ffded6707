"""kvlink's KV events against the engines' own event structs and msgspec encoders and decoders,
run unmodified: vLLM 0.33 (its vllm/distributed/kv_events.py taken from the 0.33.0 wheel, which
runs on the vLLM 0.32 installed here; tools/test.sh fetches it), vLLM 0.32 and SGLang 0.5.23.

Each engine's batches (every field it declares set, newer ones included) go through kvlink and
back to the engine's decoder unchanged: through the Python API (subscriber to dicts, dicts to
publisher), and through the merger when it has to re-encode a batch (one unreadable event in
it)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import msgspec
import pytest
import zmq

from kvlink.events import Merger, Publisher, Subscriber

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ports import free_port  # noqa: E402

TIMEOUT = 15.0


def vllm033():
    path = os.environ.get("KVLINK_VLLM033_KV_EVENTS")
    if not path:
        pytest.skip("KVLINK_VLLM033_KV_EVENTS is not set (tools/test.sh fetches vLLM 0.33.0's kv_events.py)")
    spec = importlib.util.spec_from_file_location("vllm033_kv_events", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def vllm032():
    import vllm.distributed.kv_events as mod

    return mod


def sglang():
    from sglang.srt.disaggregation import kv_events as mod

    return mod


def vllm_batches(m, newer: bool):
    """Batches of vLLM's structs with every field set (the 0.33 fields only when `newer`)."""
    out = []
    for i in range(6):
        extra = dict(locality="REMOTE", ownership=f"tier-{i}", session_id=f"s-{i}",
                     lookahead_token_ids=[[i, i + 1], []]) if newer else {}
        stored = m.BlockStored(
            block_hashes=[2**64 - 1 - i, i], parent_block_hash=(2**63 + i) if i else None,
            token_ids=list(range(i, i + 32)), block_size=16, lora_id=None if i % 2 else 3,
            medium="GPU", lora_name="adapter" if i % 2 else None,
            extra_keys=[("adapter", ("mm-hash", 16 * i)), None], group_idx=i % 2,
            kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096, **extra)
        removed_extra = dict(locality="LOCAL", ownership="tier-9") if newer else {}
        removed = m.BlockRemoved(block_hashes=[i], medium="CPU", group_idx=1, **removed_extra)
        events = [stored, removed] + ([m.AllBlocksCleared()] if i == 5 else [])
        out.append(m.KVEventBatch(ts=1795255560.1496913 + i, events=events, data_parallel_rank=i % 3))
    return out


def sglang_batches(m):
    out = []
    for i in range(6):
        stored = m.BlockStored(
            block_hashes=[-(2**63) + i, -5 - i], parent_block_hash=-1 if i else None,
            token_ids=list(range(i, i + 32)), block_size=16, lora_id=None, medium="CPU_PINNED",
            cache_salt=f"salt-{i}", session_id=f"s-{i}", lora_name="adapter" if i % 2 else None)
        removed = m.BlockRemoved(block_hashes=[-(2**63) + i], medium="GPU" if i % 2 else None)
        events = [stored, removed] + ([m.AllBlocksCleared()] if i == 5 else [])
        out.append(m.KVEventBatch(ts=1795255560.1496913 + i, events=events, attn_dp_rank=i % 2))
    return out


ENGINES = {
    "vllm-0.33": lambda: (vllm033(), lambda m: vllm_batches(m, True)),
    "vllm-0.32": lambda: (vllm032(), lambda m: vllm_batches(m, False)),
    "sglang-0.5.23": lambda: (sglang(), sglang_batches),
}


class RawPub:
    """A bare pyzmq PUB sending payloads as `[topic, seq, payload]`."""

    def __init__(self):
        self.port = free_port()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.seq = 0

    def send(self, payload: bytes):
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self):
        self.ctx.destroy(linger=0)


class RawSub:
    def __init__(self, endpoint):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    def payloads(self, n):
        out = []
        end = time.monotonic() + TIMEOUT
        while len(out) < n and time.monotonic() < end:
            if self.sock.poll(200):
                out.append(self.sock.recv_multipart()[2])
        assert len(out) == n, f"{len(out)} of {n} batches arrived"
        return out

    def close(self):
        self.ctx.destroy(linger=0)


def items(sub, n):
    got, end = [], time.monotonic() + TIMEOUT
    while len(got) < n and time.monotonic() < end:
        item = sub.next(0.2)
        if item is not None and item["kind"] == "batch":
            got.append(item)
    assert len(got) == n, got
    return got


@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_batches_cross_the_python_api_unchanged(engine):
    m, make = ENGINES[engine]()
    batches = make(m)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(m.KVEventBatch)
    src, out_port = RawPub(), free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{src.port}")
    pub = Publisher(f"tcp://*:{out_port}")
    sink = RawSub(f"tcp://127.0.0.1:{out_port}")
    try:
        time.sleep(0.5)
        for b in batches:
            src.send(enc.encode(b))
        for item in items(sub, len(batches)):
            assert item["skipped"] == []
            pub.publish(item["events"], ts=item["ts"], dp_rank=item["dp_rank"])
        got = [dec.decode(p) for p in sink.payloads(len(batches))]
        # As the engine's own decoder reads its own encoding (nested tuples come back as lists).
        assert got == [dec.decode(enc.encode(b)) for b in batches]
        if engine.startswith("vllm"):
            # Same field order as vLLM declares: byte for byte what its encoder writes.
            assert [enc.encode(b) for b in batches] == [enc.encode(g) for g in got]
    finally:
        pub.close()
        src.close()
        sink.close()


@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_batches_cross_the_merger_unchanged_when_it_re_encodes(engine):
    m, make = ENGINES[engine]()
    batches = make(m)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(m.KVEventBatch)
    src, out_port = RawPub(), free_port()
    merger = Merger([(f"tcp://127.0.0.1:{src.port}", None)], f"tcp://*:{out_port}")
    sink = RawSub(f"tcp://127.0.0.1:{out_port}")
    try:
        end = time.monotonic() + TIMEOUT
        while not merger.stats()["inputs"][0]["connected"]:
            assert time.monotonic() < end
            time.sleep(0.05)
        time.sleep(0.5)
        for b in batches:
            # An unreadable event (an integer) in each batch: the merger must re-encode it.
            wire = msgspec.msgpack.decode(enc.encode(b))
            wire[1].insert(1, 42)
            src.send(msgspec.msgpack.encode(wire))
        got = [dec.decode(p) for p in sink.payloads(len(batches))]
        assert got == [dec.decode(enc.encode(b)) for b in batches]
    finally:
        merger.close()
        src.close()
        sink.close()
