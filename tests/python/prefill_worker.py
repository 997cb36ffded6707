"""A prefill worker process for the Python tests: registers numpy KV caches filled with a
deterministic pattern, holds the given requests (every block granted to each), prints its handshake address, then reports
finished sends until stdin closes."""

import sys
import threading

import kvlink

from kv_layout import make_caches


def main() -> None:
    layers, blocks, block_bytes, seed, held = (int(x) for x in sys.argv[1:6])
    engine = kvlink.Engine(request_timeout=20.0, abort_timeout=60.0)
    caches = make_caches(layers, blocks, block_bytes, seed)
    engine.register_kv_caches(caches, 16, "bf16")
    for i in range(held):
        engine.hold_blocks(f"req-{i}", list(range(blocks)))
    print(f"ADDR {engine.handshake_address}", flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    while not done.is_set():
        f = engine.wait_finished(0.2)
        for rid in f.sending:
            print(f"SENT {rid}", flush=True)
        for rid, _side, _expired, reason in f.failed:
            print(f"FAILED {rid} {reason}", flush=True)


if __name__ == "__main__":
    main()
