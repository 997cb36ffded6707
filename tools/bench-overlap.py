"""How much of a request's KV transfer a progressive read hides behind the prefill's compute
(tools/bench-overlap.sh runs it). Two engines in this process, over TCP loopback (or the
same-host path): a prefill that emulates its compute, layer group by layer group and chunk by
chunk, and a decode that reads the request's KV.

- whole: the prefill computes the whole prompt, then holds its blocks; the decode reads them
  (today's flow, the read starting the moment the prefill ends).
- progressive: the decode follows the request from the start (Engine.follow_blocks); the
  prefill holds a growing hold and, after each layer group of each chunk, makes that group's
  tensors of the chunk's blocks final (extend_hold(tensors=...)); it seals after the last.

Exposed time, per request: the moment the decode holds every byte, confirmed, minus the moment
the prefill's last layer group was done. The floor is the exposed time of a read of one block
(the fixed cost of a read: request, confirmation, report).

Compute is emulated by sleeping, not by a busy wait: a GPU's compute takes none of the CPU
that moves the bytes, and on a machine of two cores a busy wait would take half of it. Its
length keeps the ratio of compute to transfer of the real system: the prefill time of the
model (its FLOPs at 40% of an H100's 989 dense BF16 TFLOPS: the rate NVIDIA's published
Llama 3.1 70B time to first token of 472 ms for 32,768 tokens on GH200 NVL32 works out to)
over the time its KV takes at 400 Gb/s, times the time this machine's transport takes for the
emulated request's bytes (measured first, a read of the whole request, median of three). The
ratio does not depend on TP (compute and KV per GPU both shrink with it). Requests at once
share one prefill engine: its GPU computes them in one batch, so each request's compute is
that many times as long, as its share of the link is that many times smaller. The KV is the
model's layer count, with fewer bytes per token (--token-bytes per tensor), so that 8 requests
of 32K tokens fit in memory; the fixed costs of a read do not shrink with them, which makes
every exposed time here longer, and the progressive one more so (it reads more parts).

What the emulation cannot show: the engine's own timing (CUDA events, graphs, the save hooks'
place in the forward), a NIC's and HBM's contention with the compute, and a scheduler's
delays between the legs (here both start at once).
"""

import argparse
import itertools
import json
import statistics
import sys
import threading
import time

import numpy as np

import kvlink

H100_BF16 = 989e12  # dense BF16 FLOP/s, NVIDIA H100 SXM datasheet
MFU = 0.40  # NVIDIA's GH200 NVL32 figure for Llama 3.1 70B, 32K tokens, 472 ms (see above)
NIC = 400e9 / 8  # 400 Gb/s, in bytes per second

MODELS = {
    # layers, hidden size, parameters, KV bytes per token (bf16, 8 KV heads of 128)
    "llama3-8b": (32, 4096, 8.03e9, 32 * 2 * 8 * 128 * 2),
    "llama3-70b": (80, 8192, 70.6e9, 80 * 2 * 8 * 128 * 2),
}


def ratio(model, tokens):
    """The prefill's compute time over its KV's transfer time at 400 Gb/s."""
    layers, hidden, params, kv = MODELS[model]
    flops = 2 * params * tokens + 2 * layers * hidden * tokens * tokens
    return (flops / (H100_BF16 * MFU)) / (kv * tokens / NIC)


def size(text):
    text = text.strip().upper()
    return int(text[:-1]) * 1024 if text.endswith("K") else int(text)


class Finished:
    """When each request finished on an engine, from one thread that waits for them."""

    def __init__(self, engine):
        self.engine, self.at, self.failed = engine, {}, {}
        self.lock, self.stop = threading.Condition(), False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop:
            f = self.engine.wait_finished(0.05)
            now = time.monotonic()
            with self.lock:
                for i in f.receiving:
                    self.at[i] = now
                for x in f.failures:
                    self.failed[x["id"]] = x["reason"]
                self.lock.notify_all()

    def wait(self, rid, limit=120.0):
        end = time.monotonic() + limit
        with self.lock:
            while rid not in self.at:
                if rid in self.failed:
                    raise RuntimeError(f"{rid} failed: {self.failed[rid]}")
                if not self.lock.wait(max(0.0, end - time.monotonic())):
                    raise RuntimeError(f"{rid} not received within {limit} s")
            return self.at.pop(rid)


class Bench:
    """A prefill and a decode of `layers` layers (K and V tensors each)."""

    def __init__(self, layers, blocks, token_bytes, transport):
        self.layers, self.tokens_per_block = layers, 16
        self.block_bytes = token_bytes * self.tokens_per_block
        self.prefill = kvlink.Engine(transport=transport, request_timeout=300.0)
        self.decode = kvlink.Engine(transport=transport, request_timeout=300.0)
        rng = np.random.default_rng(7)
        self.p = [rng.integers(0, 256, (blocks, self.block_bytes), dtype=np.uint8) for _ in range(2 * layers)]
        # Every page written once now, so that no flow pays for first touching them.
        self.d = [np.full((blocks, self.block_bytes), 0, dtype=np.uint8) for _ in range(2 * layers)]
        self.prefill.register_kv_caches(self.p, self.tokens_per_block, "bf16")
        self.decode.register_kv_caches(self.d, self.tokens_per_block, "bf16")
        self.peer = self.prefill.handshake_address
        self.decode.connect(self.peer)
        self.done = Finished(self.decode)
        self.ids = itertools.count()
        self.drain = threading.Thread(target=self.drain_prefill, daemon=True)
        self.running = True
        self.drain.start()

    def drain_prefill(self):
        """Takes the prefill's finished lists, so they do not pile up."""
        while self.running:
            self.prefill.wait_finished(0.1)

    def close(self):
        # Both waiting threads end before the engines close (and long before the interpreter
        # finalizes: a daemon thread coming back from a call into the engine then would be torn
        # down mid-call).
        self.done.stop = True
        self.running = False
        self.done.thread.join()
        self.drain.join()
        self.decode.close()
        self.prefill.close()

    def rid(self):
        return f"r{next(self.ids)}"

    def check(self, blocks):
        """One tensor's blocks, chosen at random, as the prefill holds them (before the next
        request with these blocks clears them)."""
        t = int(np.random.default_rng().integers(len(self.p)))
        if not (self.d[t][blocks] == self.p[t][blocks]).all():
            raise RuntimeError("the decode's bytes differ from the prefill's")
        for d in self.d:
            d[blocks] = 0

    def whole(self, blocks, compute):
        """Today's flow: compute, hold, read. Returns the exposed seconds."""
        rid = self.rid()
        time.sleep(compute)
        last = time.monotonic()
        self.prefill.hold_blocks(rid, blocks)
        self.decode.read_blocks(self.peer, rid, blocks, blocks)
        return self.done.wait(rid) - last

    def progressive(self, blocks, compute, chunk_blocks, groups):
        """Both legs at once; each layer group of each chunk made final as it is computed."""
        rid = self.rid()
        self.decode.follow_blocks(self.peer, rid, blocks)
        self.prefill.hold_growing(rid, [])
        chunks = [blocks[i : i + chunk_blocks] for i in range(0, len(blocks), chunk_blocks)]
        per_layer = self.layers // groups
        for c in chunks:
            share = compute * len(c) / len(blocks) / groups
            for g in range(groups):
                time.sleep(share)
                if groups == 1:
                    self.prefill.extend_hold(rid, c)
                else:
                    t = (2 * g * per_layer, 2 * (g + 1) * per_layer)
                    self.prefill.extend_hold(rid, c if g == 0 else [], tensors=t)
        last = time.monotonic()
        self.prefill.seal_hold(rid)
        return self.done.wait(rid) - last


def run_concurrent(fn, jobs):
    """Runs fn(*job) for every job at once; returns their results."""
    out = [None] * len(jobs)
    errors = []

    def one(i, job):
        try:
            out[i] = fn(*job)
        except (RuntimeError, kvlink.KvlinkError) as e:  # raised below, once every thread ended
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def measure(bench, model, tokens, conc, args):
    """Exposed times of both flows for requests of `tokens` tokens, `conc` at once."""
    nblocks = tokens // bench.tokens_per_block
    chunk_blocks = args.chunk // bench.tokens_per_block
    groups = bench.layers // args.layers_per_part
    pools = [list(range(i * nblocks, (i + 1) * nblocks)) for i in range(conc)]
    # This machine's transfer time for one request's bytes, then the compute that keeps the
    # real system's ratio. Requests at once share one prefill engine: its GPU computes them in
    # one batch, each taking `conc` times as long, as they share its link.
    xfer = statistics.median(bench.whole(pools[0], 0.0) for _ in range(3))
    bench.check(pools[0])
    compute = ratio(model, tokens) * xfer * conc
    rounds = max(2, args.requests // conc)
    # Each flow: what runs a request, and its arguments for a pool of blocks.
    flows = {
        "whole": (bench.whole, lambda p: (p, compute)),
        "progressive": (bench.progressive, lambda p: (p, compute, chunk_blocks, groups)),
    }
    got: dict[str, list[float]] = {"whole": [], "progressive": []}
    for k in range(rounds):
        # Each flow runs first in every other round.
        for name in sorted(flows, reverse=bool(k % 2)):
            fn, args = flows[name]
            got[name] += run_concurrent(fn, [args(p) for p in pools])
            for p in pools:
                bench.check(p)
    return xfer, compute, got["whole"], got["progressive"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama3-8b,llama3-70b")
    ap.add_argument("--lengths", default="256,1K,4K,16K,32K")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", type=int, default=4, help="requests per flow and setting")
    ap.add_argument("--chunk", type=int, default=8192, help="chunked prefill's tokens per step")
    ap.add_argument("--layers-per-part", type=int, default=2)
    ap.add_argument("--token-bytes", type=int, default=128, help="KV bytes per token per tensor")
    ap.add_argument("--transport", default="tcp", choices=["tcp", "auto"])
    ap.add_argument("--out", help="append each setting's figures to this JSONL file")
    args = ap.parse_args()
    lengths = [size(x) for x in args.lengths.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    print(
        f"bench-overlap: compute at {MFU:.0%} of {H100_BF16 / 1e12:.0f} TFLOPS, KV at 400 Gb/s, "
        f"chunks of {args.chunk} tokens, parts of {args.layers_per_part} layers, {args.transport}"
    )
    for model in args.models.split(","):
        layers = MODELS[model][0]
        blocks = max(concs) * max(lengths) // 16
        bench = Bench(layers, blocks, args.token_bytes, args.transport)
        floor = [bench.whole([0], 0.0) for _ in range(20)]
        bench.check([0])
        print(
            f"{model}: floor (a read of one block) p50 {pct(floor, 0.5) * 1e3:.2f} ms, "
            f"p99 {pct(floor, 0.99) * 1e3:.2f} ms"
        )
        for conc in concs:
            for tokens in lengths:
                xfer, compute, whole, prog = measure(bench, model, tokens, conc, args)
                w50, p50 = pct(whole, 0.5), pct(prog, 0.5)
                hidden = 1 - p50 / w50 if w50 > 0 else 0.0
                print(
                    f"{model} {tokens:>6} tokens, {conc} at once: exposed: whole {w50 * 1e3:.1f} ms "
                    f"(p99 {pct(whole, 0.99) * 1e3:.1f}), progressive {p50 * 1e3:.1f} ms "
                    f"(p99 {pct(prog, 0.99) * 1e3:.1f}), hidden {hidden:.0%} "
                    f"[transfer {xfer * 1e3:.1f} ms, compute {compute * 1e3:.0f} ms, ratio {ratio(model, tokens):.1f}]",
                    flush=True,
                )
                if args.out:
                    rec = dict(
                        model=model,
                        tokens=tokens,
                        concurrency=conc,
                        transfer_s=xfer,
                        compute_s=compute,
                        whole_s=whole,
                        progressive_s=prog,
                        floor_p50_s=pct(floor, 0.5),
                        transport=args.transport,
                        chunk=args.chunk,
                        layers_per_part=args.layers_per_part,
                    )
                    with open(args.out, "a") as f:
                        f.write(json.dumps(rec) + "\n")
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
