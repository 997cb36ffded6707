"""Python-side cost of one read_blocks call for a 4,096-token request (256 block ids), as seen by
an engine worker: the call returns once the request is validated and queued; the transfer runs in
kvlink's threads. Reference: vLLM measured about 3 ms per request for descriptor preparation in
Python (issue 23780).

    .venv/bin/python tools/bench_python_overhead.py
"""

import statistics
import time

import numpy as np

import kvlink

BLOCKS_PER_REQUEST = 4096 // 16
CACHE_BLOCKS = 2 * BLOCKS_PER_REQUEST
CALLS = 2000


def main() -> None:
    # Small blocks (64 tensors x 64 bytes) so the transfers themselves are cheap and the
    # measurement is the call, not the copy.
    prefill, decode = kvlink.Engine(), kvlink.Engine()
    pc = [np.ones((CACHE_BLOCKS, 64), dtype=np.uint8) for _ in range(64)]
    dc = [np.zeros((CACHE_BLOCKS, 64), dtype=np.uint8) for _ in range(64)]
    prefill.register_kv_caches(pc, 16, "bf16")
    decode.register_kv_caches(dc, 16, "bf16")
    peer = prefill.handshake_address
    decode.connect(peer)
    rng = np.random.default_rng(0)
    local_np = rng.permutation(CACHE_BLOCKS)[:BLOCKS_PER_REQUEST].astype(np.int64)
    remote_np = rng.permutation(CACHE_BLOCKS)[:BLOCKS_PER_REQUEST].astype(np.int64)
    results = {}
    for name, local, remote in [
        ("python lists", local_np.tolist(), remote_np.tolist()),
        ("numpy int64 arrays", local_np, remote_np),
    ]:
        samples = []
        for i in range(CALLS):
            prefill.hold_blocks(f"{name}-{i}", remote)
            t0 = time.perf_counter()
            decode.read_blocks(peer, f"{name}-{i}", local, remote)
            samples.append(time.perf_counter() - t0)
            if i % 50 == 49:
                # Let transfers drain so in-flight work stays bounded.
                done = 0
                while done < 50:
                    done += len(decode.wait_finished(5.0).receiving)
        results[name] = samples
    for name, s in results.items():
        s = sorted(s)
        print(
            f"read_blocks, {BLOCKS_PER_REQUEST} block ids as {name}: "
            f"median {statistics.median(s) * 1e6:.1f} us, p99 {s[int(len(s) * 0.99)] * 1e6:.1f} us "
            f"over {len(s)} calls"
        )


if __name__ == "__main__":
    main()
