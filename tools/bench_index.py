#!/usr/bin/env python3
"""KV-event index against Dynamo's: the same prefix-caching trace published over ZeroMQ by
the same publishers (pyzmq PUB sockets, one per engine, vLLM's framing and map events), read
by `kvlink-events index` and by Dynamo's standalone indexer (`python -m dynamo.indexer`), one
after the other (each round, the other first); then the same overlap queries over HTTP to both
(one kept-alive connection each, a query to one and then the other), and in process: kvlink's
`kvlink.events.Index` against Dynamo's `RadixTree`.

Prints `ingest: kvlink X events/s, Dynamo Y events/s, Nx`, `query p99: kvlink A us, Dynamo B
us, Mx` (Dynamo's over kvlink's) for HTTP and in process, and memory per million blocks.
Run by tools/bench-index.sh, which builds kvlink and installs Dynamo into a venv of its own.
"""

import argparse
import gc
import http.client
import json
import os
import random
import socket
import struct
import subprocess
import sys
import time

import msgpack
import zmq

BS = 16


def trace(engines, requests, prefixes, seed, per_batch=8):
    """Per engine, a list of batches (lists of events): each request stores a shared system
    prompt (one of `prefixes`, 8 to 32 blocks, stored once per engine) and a suffix of its own
    (2 to 24 blocks), `per_batch` requests per batch, chained by engine hashes that depend
    only on the tokens (the same tokens have the same hash on every engine); an engine over
    its capacity removes its oldest suffixes. The last batch stores a sentinel block of its
    own."""
    rnd = random.Random(seed)
    ids: dict = {}

    def chain(parent, toks):
        key = (parent, tuple(toks))
        if key not in ids:
            ids[key] = len(ids) + 1
        return ids[key]

    systems = [[rnd.randrange(1, 150_000) for _ in range(BS * rnd.randint(8, 32))] for _ in range(prefixes)]
    out, prompts, events = [], [], 0
    for e in range(engines):
        batches: list = []
        held, stored_prefix, live = 0, set(), []
        for r in range(requests):
            p = rnd.randrange(prefixes)
            suffix = [rnd.randrange(1, 150_000) for _ in range(BS * rnd.randint(2, 24))]
            toks = systems[p] + suffix
            hashes, parent = [], None
            for b in range(len(toks) // BS):
                parent = chain(parent, toks[b * BS : (b + 1) * BS])
                hashes.append(parent)
            n_sys = len(systems[p]) // BS
            batch = []
            if p not in stored_prefix:
                stored_prefix.add(p)
                batch.append(stored(hashes[:n_sys], None, toks[: n_sys * BS]))
                held += n_sys
            batch.append(stored(hashes[n_sys:], hashes[n_sys - 1], toks[n_sys * BS :]))
            held += len(hashes) - n_sys
            live.append(hashes[n_sys:])
            while held > 4000 and len(live) > 1:
                old = live.pop(0)
                batch.append({"type": "BlockRemoved", "block_hashes": list(reversed(old)), "medium": "GPU"})
                held -= len(old)
            events += len(batch)
            # A scheduler step finishes several requests: one batch for each `per_batch`.
            if r % per_batch == 0 or not batches:
                batches.append(batch)
            else:
                batches[-1].extend(batch)
            if r % 50 == 0:
                prompts.append(toks)
        sentinel = [900_000 + e] * BS
        batches.append([stored([chain(None, sentinel)], None, sentinel)])
        events += 1
        out.append((batches, sentinel))
    return out, prompts, events


def stored(hashes, parent, toks):
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": toks,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


class Publishers:
    """One PUB socket per engine, with no high-water mark (nothing is dropped)."""

    def __init__(self, engines, base_port):
        self.ctx = zmq.Context()
        self.socks = []
        for e in range(engines):
            s = self.ctx.socket(zmq.PUB)
            s.setsockopt(zmq.SNDHWM, 0)
            s.bind(f"tcp://127.0.0.1:{base_port + e}")
            self.socks.append(s)
        self.endpoints = [f"tcp://127.0.0.1:{base_port + e}" for e in range(engines)]

    def publish(self, payloads):
        """Sends every engine's payloads, round robin across engines (as a fleet would)."""
        longest = max(len(p) for p in payloads)
        for i in range(longest):
            for e, p in enumerate(payloads):
                if i < len(p):
                    self.socks[e].send_multipart([b"", struct.pack(">Q", i), p[i]])

    def close(self):
        for s in self.socks:
            s.close(linger=0)
        self.ctx.term()


class Service:
    """An index service over HTTP (kvlink's or Dynamo's), on one kept-alive connection."""

    def __init__(self, name, argv, port, query_extra, log):
        self.name, self.port, self.extra = name, port, query_extra
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 60
        while True:
            try:
                self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                self.call("GET", "/health")
                break
            except (OSError, http.client.HTTPException):
                assert time.monotonic() < end and self.proc.poll() is None, f"{name} did not start"
                time.sleep(0.2)

    def call(self, method, path, body=None):
        data = None if body is None else json.dumps(body)
        self.conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = self.conn.getresponse()
        text = r.read()
        assert r.status == 200, (self.name, path, r.status, text[:200])
        return text

    def query(self, tokens):
        return json.loads(self.call("POST", "/query", {"token_ids": tokens, **self.extra}))

    def holds(self, engine, tokens):
        got = self.query(tokens)
        if "matches" in got:  # kvlink
            return any(m["engine"] == str(engine) and m["blocks"] == 1 for m in got["matches"])
        return got.get("scores", {}).get(str(engine), {}).get("0") == BS  # Dynamo: tokens

    def cpu_s(self):
        """CPU seconds the service has used, all its threads."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def ingest(service, pubs, payloads, sentinels, events):
    """Events per second from the first send until every engine's sentinel is queryable."""
    time.sleep(2.0)  # the service's SUB sockets subscribe
    before, cpu0 = service.rss_mb(), service.cpu_s()
    t0 = time.perf_counter()
    pubs.publish(payloads)
    sent = time.perf_counter() - t0
    pending = set(range(len(sentinels)))
    while pending:
        # A pass over the engines not caught up, then a pause: the poll (about 0.3 ms of this
        # Python client's CPU per query) must not take the CPU the service ingests with.
        time.sleep(0.005)
        for e in list(pending):
            if service.holds(e, sentinels[e]):
                pending.discard(e)
        assert time.perf_counter() - t0 < 600, f"{service.name}: {len(pending)} engines never caught up"
    took = time.perf_counter() - t0
    cpu_ns = (service.cpu_s() - cpu0) / events * 1e9
    return events / took, took, sent, service.rss_mb() - before, cpu_ns


def http_latency(services, prompts, n):
    """Per service, p50 and p99 of `n` queries over one kept-alive connection each, from a lean
    client: each request's bytes are made before the clock starts and the answer is read, not
    parsed (http.client and json take about 250 us of this Python's time per query, which
    would hide both services' own). The services take the same prompts in turn, one query
    each, so that the machine's slow spells fall on both alike."""
    rnd = random.Random(7)
    picks = [rnd.choice(prompts) for _ in range(n)]
    reqs, socks = [], []
    try:
        for svc in services:
            reqs.append([query_bytes(svc, p) for p in picks])
            socks.append(socket.create_connection(("127.0.0.1", svc.port), timeout=30))
            socks[-1].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        lat: list = [[] for _ in services]
        bufs = [b""] * len(services)
        for i in range(n):
            for j, sock in enumerate(socks):
                a = time.perf_counter()
                sock.sendall(reqs[j][i])
                bufs[j] = read_answer(sock, bufs[j])
                lat[j].append(time.perf_counter() - a)
    finally:
        for s in socks:
            s.close()
    return [pct(x) for x in lat]


def query_bytes(service, tokens):
    """A `/query` request for `tokens`, whole."""
    body = json.dumps({"token_ids": tokens, **service.extra}).encode()
    head = "POST /query HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


def read_answer(sock, buf):
    """Reads one HTTP answer (status 200, a Content-Length body: both services send one); what
    came after it."""
    while b"\r\n\r\n" not in buf:
        buf += recv(sock)
    head, buf = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    assert " 200 " in lines[0] + " ", lines[0]
    fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    assert "content-length" in fields, f"an answer without a Content-Length: {fields}"
    size = int(fields["content-length"])
    while len(buf) < size:
        buf += recv(sock)
    return buf[size:]


def recv(sock):
    data = sock.recv(1 << 16)
    assert data, "the service closed the connection"
    return data


def pct(lat):
    lat = sorted(lat)
    return lat[len(lat) // 2] * 1e6, lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6


def in_process(work, prompts, n, dynamo_py):
    """kvlink.events.Index and Dynamo's RadixTree fed the same events, then the same queries
    (each timed with its hashing: kvlink hashes the tokens itself, Dynamo's query takes
    compute_block_hash_for_seq's hashes). Dynamo runs in its own venv's interpreter."""
    from kvlink.events import Index

    ix = Index()
    t0 = time.perf_counter()
    for e, (batches, _) in enumerate(work):
        for b in batches:
            ix.apply_events(str(e), b, dp_rank=0)
    k_ingest = time.perf_counter() - t0
    rnd = random.Random(7)
    lat = []
    gc.disable()  # as timeit does, on both sides: a collection over the trace is not a query's
    for _ in range(n):
        q = rnd.choice(prompts)
        a = time.perf_counter()
        ix.overlap_tokens(q, BS)
        lat.append(time.perf_counter() - a)
    gc.enable()
    k = pct(lat)
    spec = json.dumps({"work": [[b for b in batches] for batches, _ in work], "prompts": prompts, "n": n})
    out = subprocess.run(
        [dynamo_py, __file__, "--dynamo-in-process"], input=spec, capture_output=True, text=True, check=True
    )
    d = json.loads(out.stdout)
    return k_ingest, k, d["ingest_s"], (d["p50"], d["p99"])


def dynamo_in_process():
    """In Dynamo's venv: the same events into RadixTree, the same queries."""
    from dynamo.llm import RadixTree, compute_block_hash_for_seq

    spec = json.load(sys.stdin)
    tree, eid = RadixTree(), 0
    msgs = []
    for e, batches in enumerate(spec["work"]):
        for b in batches:
            for ev in b:
                eid += 1
                if ev["type"] == "BlockStored":
                    tl = compute_block_hash_for_seq(ev["token_ids"], BS)
                    pairs = [{"block_hash": h, "tokens_hash": t} for h, t in zip(ev["block_hashes"], tl)]
                    data = {"stored": {"parent_hash": ev["parent_block_hash"], "blocks": pairs}}
                else:
                    data = {"removed": {"block_hashes": ev["block_hashes"]}}
                msgs.append((e, json.dumps({"event_id": eid, "dp_rank": 0, "data": data}).encode()))
    t0 = time.perf_counter()
    for e, m in msgs:
        tree.apply_event(e, m)
    ingest = time.perf_counter() - t0
    rnd = random.Random(7)
    lat = []
    gc.disable()
    for _ in range(spec["n"]):
        q = rnd.choice(spec["prompts"])
        a = time.perf_counter()
        _ = tree.find_matches(compute_block_hash_for_seq(q, BS)).scores  # what a router reads
        lat.append(time.perf_counter() - a)
    gc.enable()
    p50, p99 = pct(lat)
    json.dump({"ingest_s": ingest, "p50": p50, "p99": p99}, sys.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvlink-events", required=True)
    ap.add_argument("--dynamo-python", required=True)
    ap.add_argument("--engines", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--prefixes", type=int, default=64)
    ap.add_argument("--queries", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians reported")
    ap.add_argument("--port", type=int, default=27000)
    ap.add_argument("--log", default="target/bench-index.log")
    ap.add_argument("--only-kvlink", action="store_true", help="scale runs: kvlink's service alone")
    a = ap.parse_args()
    work, prompts, events = trace(a.engines, a.requests, a.prefixes, seed=1)
    blocks = sum(
        len(ev["block_hashes"]) for batches, _ in work for b in batches for ev in b if ev["type"] == "BlockStored"
    )
    payloads = [[msgpack.packb([1.7e9, b, 0]) for b in batches] for batches, _ in work]
    sentinels = [s for _, s in work]
    print(
        f"trace: {a.engines} engines, {events} events ({blocks} blocks stored, removals "
        f"of the oldest suffixes past 4,000 blocks per engine), {len(prompts)} query prompts"
    )
    log = open(a.log, "w")
    names = ("kvlink",) if a.only_kvlink else ("kvlink", "dynamo")
    runs: dict[str, list] = {name: [] for name in names}
    for r in range(a.rounds):
        # Each round ingests into one service, then the other (first in turn), and times both
        # services' queries interleaved.
        order = names if r % 2 == 0 else names[::-1]
        got = one_round(a, order, payloads, sentinels, events, prompts, log)
        for name in names:
            runs[name].append(got[name])
            rate, took, sent, mem, lat, cpu = runs[name][-1]
            print(
                f"round {r + 1}, {name}: {events} events in {took:.2f} s ({rate:,.0f} events/s; the "
                f"publishers sent the last at {sent:.2f} s; service CPU {cpu:,.0f} ns per event, HTTP "
                f"polls included), RSS +{mem:.0f} MB, "
                f"HTTP query p50 {lat[0]:.0f} us, p99 {lat[1]:.0f} us"
            )
    if a.only_kvlink:
        return
    k, d = runs["kvlink"], runs["dynamo"]
    kr, dr = median([x[0] for x in k]), median([x[0] for x in d])
    kl, dl = median([x[4][1] for x in k]), median([x[4][1] for x in d])
    km, dm = median([x[3] for x in k]), median([x[3] for x in d])
    kc, dc = median([x[5] for x in k]), median([x[5] for x in d])
    live = a.engines * 4000 / 1e6  # blocks held at the end, about
    each = ", ".join(f"{x[0] / y[0]:.2f}x" for x, y in zip(k, d))
    print(
        f"ingest (median of {a.rounds}): kvlink {kr:,.0f} events/s, Dynamo {dr:,.0f} events/s, "
        f"{kr / dr:.2f}x (rounds: {each})"
    )
    print(f"service CPU per event (median): kvlink {kc:,.0f} ns, Dynamo {dc:,.0f} ns, {dc / kc:.2f}x")
    each = ", ".join(f"{y[4][1] / x[4][1]:.2f}x" for x, y in zip(k, d))
    print(f"query p99 (HTTP, median): kvlink {kl:.0f} us, Dynamo {dl:.0f} us, {dl / kl:.2f}x (rounds: {each})")
    rounds = [in_process(work, prompts, a.queries, a.dynamo_python) for _ in range(a.rounds)]
    k_ing, d_ing = median([x[0] for x in rounds]), median([x[2] for x in rounds])
    kq50, dq50 = median([x[1][0] for x in rounds]), median([x[3][0] for x in rounds])
    kq, dq = median([x[1][1] for x in rounds]), median([x[3][1] for x in rounds])
    print(
        f"in process (median of {a.rounds}): ingest kvlink {events / k_ing:,.0f} events/s, Dynamo "
        f"{events / d_ing:,.0f} events/s ({d_ing / k_ing:.2f}x); query p50 kvlink {kq50:.1f} us, Dynamo {dq50:.1f} us"
    )
    each = ", ".join(f"{x[3][1] / x[1][1]:.2f}x" for x in rounds)
    print(f"query p99 (in process, median): kvlink {kq:.1f} us, Dynamo {dq:.1f} us, {dq / kq:.2f}x (rounds: {each})")
    print(f"memory per million blocks held (service RSS growth): kvlink {km / live:.0f} MB, Dynamo {dm / live:.0f} MB")


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def one_round(a, order, payloads, sentinels, events, prompts, log):
    """The services of `order` (kvlink's, Dynamo's), each on fresh publishers of its own and
    ingesting while the ones before it idle, then their HTTP queries interleaved; per service
    (rate, took, sent, memory, (p50, p99), CPU per event)."""
    started, ingested = [], {}
    try:
        for k, name in enumerate(order):
            base = a.port + k * (a.engines + 10)
            pubs = Publishers(a.engines, base)
            started.append(pubs)
            svc = start_service(a, name, pubs, base - 1, log)
            started.append(svc)
            ingested[name] = (svc, ingest(svc, pubs, payloads, sentinels, events))
        lats = http_latency([svc for svc, _ in ingested.values()], prompts, a.queries)
        out = {}
        for (name, (_, (rate, took, sent, mem, cpu))), lat in zip(ingested.items(), lats):
            out[name] = (rate, took, sent, mem, lat, cpu)
        return out
    finally:
        for x in reversed(started):
            x.close()


def start_service(a, name, pubs, port, log):
    """kvlink's or Dynamo's index service on `port`, following `pubs`."""
    if name == "kvlink":
        specs = [arg for e, ep in enumerate(pubs.endpoints) for arg in ("--engine", f"{e}={ep}")]
        argv = [a.kvlink_events, "index", "--listen", f"127.0.0.1:{port}", *specs]
        extra = {}
    else:
        workers = ",".join(f"{e}={ep}" for e, ep in enumerate(pubs.endpoints))
        argv = [a.dynamo_python, "-m", "dynamo.indexer", "--port", str(port)]
        argv += ["--block-size", str(BS), "--workers", workers]
        extra = {"model_name": "default"}
    return Service(name, argv, port, extra, log)


if __name__ == "__main__":
    if "--dynamo-in-process" in sys.argv:
        dynamo_in_process()
    else:
        main()
