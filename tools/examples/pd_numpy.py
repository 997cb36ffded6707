"""Prefill/decode disaggregation in two Python processes with numpy KV caches.

    .venv/bin/python tools/examples/pd_numpy.py

The parent plays the decode worker; it starts a child that plays the prefill worker. The prefill
worker "computes" a request's KV cache (random bytes into its blocks), holds the blocks and hands
its handshake address and block ids to the decode side (in a real deployment these travel in the
request's kv_transfer_params through the router). The decode worker reads exactly those blocks
into its own free blocks, checks them, and the prefill worker sees the send finish and frees its
blocks.
"""

import json
import subprocess
import sys

import numpy as np

import kvlink

LAYERS, BLOCKS, TOKENS_PER_BLOCK = 8, 128, 16
BLOCK_BYTES = TOKENS_PER_BLOCK * 8 * 128 * 2  # 8 KV heads x 128 dims x bf16


def kv_caches():
    # One array per layer for K and one for V: [num_blocks, block bytes] (what vLLM allocates
    # per layer, viewed as bytes).
    return [np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(2 * LAYERS)]


def prefill() -> None:
    engine = kvlink.Engine(tp_rank=0, tp_size=1)
    caches = kv_caches()
    engine.register_kv_caches(caches, TOKENS_PER_BLOCK, "bf16")
    rng = np.random.default_rng(0)
    # A 1,000-token prompt occupies 63 blocks, scattered in the cache.
    blocks = rng.choice(BLOCKS, size=63, replace=False)
    for c in caches:
        c[blocks] = rng.integers(0, 256, size=(len(blocks), BLOCK_BYTES), dtype=np.uint8)
    # Grant exactly these blocks to the reader of req-42.
    engine.hold_blocks("req-42", blocks.tolist(), abort_timeout=60.0)
    checksum = int(sum(int(c[blocks].astype(np.uint64).sum()) for c in caches))
    print(json.dumps({"addr": engine.handshake_address, "blocks": blocks.tolist(), "checksum": checksum}), flush=True)
    while True:
        f = engine.wait_finished(30.0)
        if "req-42" in f.sending:
            print(json.dumps({"freed": "req-42"}), flush=True)
            return
        if f.failed:
            print(json.dumps({"failed": f.failed}), flush=True)
            return


def decode() -> None:
    child = subprocess.Popen([sys.executable, __file__, "prefill"], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    params = json.loads(child.stdout.readline())
    engine = kvlink.Engine()
    caches = kv_caches()
    engine.register_kv_caches(caches, TOKENS_PER_BLOCK, "bf16")
    local = list(range(10, 10 + len(params["blocks"])))  # our free blocks
    engine.read_blocks(params["addr"], "req-42", local, params["blocks"])
    f = engine.wait_finished(30.0)
    assert f.receiving == ["req-42"], f.failed
    checksum = int(sum(int(c[local].astype(np.uint64).sum()) for c in caches))
    assert checksum == params["checksum"], "bytes differ"
    print(
        f"decode: read {len(local)} blocks x {2 * LAYERS} tensors "
        f"({len(local) * 2 * LAYERS * BLOCK_BYTES / 2**20:.1f} MiB) from {params['addr']}, bytes verified"
    )
    print("prefill:", child.stdout.readline().strip())
    child.wait(timeout=30)


if __name__ == "__main__":
    prefill() if sys.argv[1:] == ["prefill"] else decode()
