"""Shared by the tests and the prefill worker: a Llama-like layout scaled down (K and V per
layer, blocks of 16 tokens x 8 KV heads x 128 dims x bf16 = 32 KiB) and its fill pattern."""

import numpy as np

BLOCK_BYTES = 16 * 8 * 128 * 2


def make_caches(layers: int, blocks: int, block_bytes: int, seed: int):
    """2 x layers arrays of shape (blocks, block_bytes), filled from ``seed`` (0: zeros)."""
    out = []
    for t in range(2 * layers):
        if seed == 0:
            out.append(np.zeros((blocks, block_bytes), dtype=np.uint8))
        else:
            rng = np.random.default_rng(seed * 1000 + t)
            out.append(rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8))
    return out
