#!/usr/bin/env python3
"""A real model's KV cache through kvlink, tokens compared (tools/gpu-check.sh runs it).

A small Llama (tests/gpu/llama-small/config.json, seeded random weights, built by transformers)
prefills 8 prompts of different lengths in one process, writes each prompt's KV into paged
blocks (one tensor per layer and K/V, [blocks, 16 tokens, KV heads, head dim]) registered with
kvlink, and holds them; a decode process with its own registered blocks reads them
(`read_blocks`, transport `local`: CUDA IPC on a GPU, the reader's copy on the host; or `tcp`:
through pinned staging on a GPU), checks the bytes against the prefill's digest, rebuilds the
cache from its blocks and decodes greedily. Its tokens must equal those of the same model run
in one process (the decode's own prefill of the prompt, then greedy). The time to first token is
split into prefill (forward), transfer (read_blocks to received) and the first decode step.
As a check that the comparison can fail, each prompt's digest is also taken over the decode's
blocks shifted by one, which must differ. Exit status 1 on any mismatch.

    gpu_model_check.py --device cuda|cpu --transport local|tcp [--new-tokens 16]
"""

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from typing import Any

BLOCK = 16
PROMPT_LENS = [5, 16, 17, 40, 64, 127, 200, 333]
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu", "llama-small", "config.json")


def build(device: str) -> tuple[Any, Any, Any]:
    """The model (seeded weights, made on the CPU then moved: the same in both processes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with open(CONFIG) as f:
        cfg = LlamaConfig(**json.load(f))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(cfg)  # its `to` is wrapped in a type mypy cannot call
    model = model.to(device=device, dtype=dtype).eval()
    return model, cfg, dtype


def pool(cfg: Any, device: str, dtype: Any, blocks: int, fill: float) -> list[Any]:
    import torch

    shape = (blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    return [torch.full(shape, fill, dtype=dtype, device=device) for _ in range(2 * cfg.num_hidden_layers)]


def layer_kv(cache: Any, i: int) -> tuple[Any, Any]:
    """Layer i's keys and values, [1, KV heads, tokens, head dim], across transformers' cache APIs."""
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[i], cache.value_cache[i]
    return cache[i][0], cache[i][1]


def store(tensors: list[Any], cache: Any, blocks: list[int], seq: int) -> None:
    """Writes a prompt's KV into its blocks (the last one padded with zeros)."""
    import torch

    idx = torch.tensor(blocks, device=tensors[0].device)
    for i in range(len(tensors) // 2):
        for t, dst in zip(layer_kv(cache, i), (tensors[2 * i], tensors[2 * i + 1])):
            x = t[0].permute(1, 0, 2)
            padded = torch.zeros((len(blocks) * BLOCK, *x.shape[1:]), dtype=x.dtype, device=x.device)
            padded[:seq] = x
            dst[idx] = padded.view(len(blocks), BLOCK, *x.shape[1:])


def load(tensors: list[Any], blocks: list[int], seq: int) -> Any:
    """A transformers cache holding the prompt's KV, read from the blocks."""
    import torch
    from transformers import DynamicCache

    idx = torch.tensor(blocks, device=tensors[0].device)
    cache = DynamicCache()
    for i in range(len(tensors) // 2):
        k, v = (tensors[2 * i + j][idx].reshape(-1, *tensors[0].shape[2:])[:seq] for j in (0, 1))
        cache.update(k.permute(1, 0, 2).unsqueeze(0).contiguous(), v.permute(1, 0, 2).unsqueeze(0).contiguous(), i)
    return cache


def digest(tensors: list[Any], blocks: list[int]) -> str:
    """sha256 of the blocks' bytes, every tensor in order."""
    import torch

    h = hashlib.sha256()
    idx = torch.tensor(blocks, device=tensors[0].device)
    for t in tensors:
        h.update(t[idx].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def greedy(model: Any, cache: Any, first: int, n: int, device: str) -> list[int]:
    """`first`, then n - 1 more tokens decoded greedily from `cache`."""
    import torch

    out, tok = [first], first
    with torch.no_grad():
        for _ in range(n - 1):
            r = model(input_ids=torch.tensor([[tok]], device=device), past_key_values=cache, use_cache=True)
            cache, tok = r.past_key_values, int(r.logits[0, -1].argmax())
            out.append(tok)
    return out


def prefill_main(conn: Any, device: str, transport: str) -> None:
    """The prefill process: answers ("prefill", request id, tokens, blocks) with the hold."""
    import torch

    from kvlink import Engine

    model, cfg, dtype = build(device)
    tensors = pool(cfg, device, dtype, blocks=128, fill=0.0)
    engine = Engine(transport=transport)
    engine.register_kv_caches(tensors, BLOCK, str(dtype).removeprefix("torch."))
    conn.send(("ready", engine.handshake_address, engine.capabilities()))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, rid, tokens, blocks = msg
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            r = model(input_ids=torch.tensor([tokens], device=device), use_cache=True)
        first = int(r.logits[0, -1].argmax())
        sync(device)
        took = time.perf_counter() - t0
        store(tensors, r.past_key_values, blocks, len(tokens))
        sync(device)
        hold = engine.hold_blocks(rid, blocks)
        conn.send(("held", hold, first, took, digest(tensors, blocks)))
    sent = engine.wait_finished(5.0).sending
    engine.close()
    conn.send(("bye", len(sent)))


def run(device: str, transport: str, new_tokens: int) -> bool:
    import torch

    from kvlink import Engine

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(theirs, device, transport), daemon=True)
    proc.start()
    model, cfg, dtype = build(device)
    tensors = pool(cfg, device, dtype, blocks=160, fill=7.0)
    engine = Engine(transport=transport)
    engine.register_kv_caches(tensors, BLOCK, str(dtype).removeprefix("torch."))
    assert ours.poll(300), "the prefill process did not start"
    _, peer, caps = ours.recv()
    print(
        f"model check ({device}, {transport}): {cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} KV heads of "
        f"{cfg.head_dim}, {dtype}; kvlink: {', '.join(k for k, (ok, _) in sorted(caps.items()) if ok)}"
    )
    rnd = random.Random(1)
    ok, times = True, []
    next_remote, next_local = 0, 150
    for n, length in enumerate(PROMPT_LENS):
        tokens = [rnd.randrange(3, cfg.vocab_size) for _ in range(length)]
        nb = -(-length // BLOCK)
        remote = list(range(next_remote, next_remote + nb))
        local = list(range(next_local, next_local - nb, -1))
        next_remote, next_local = next_remote + nb, next_local - nb
        rid = f"prompt-{n}"
        ours.send(("prefill", rid, tokens, remote))
        assert ours.poll(300), "the prefill process did not answer"
        _, hold, first, prefill_s, want = ours.recv()
        t0 = time.perf_counter()
        engine.read_blocks(peer, rid, local, remote, hold=hold)
        done = wait_received(engine, rid)
        transfer_s = time.perf_counter() - t0
        got = digest(tensors, local) if done else ""
        shifted = digest(tensors, [b - 1 for b in local])
        cache = load(tensors, local, length)
        sync(device)
        t1 = time.perf_counter()
        ours_tokens = greedy(model, cache, first, 2, device)
        sync(device)
        step_s = time.perf_counter() - t1
        ours_tokens = greedy(model, load(tensors, local, length), first, new_tokens, device)
        with torch.no_grad():
            r = model(input_ids=torch.tensor([tokens], device=device), use_cache=True)
        ref = greedy(model, r.past_key_values, int(r.logits[0, -1].argmax()), new_tokens, device)
        same = done and got == want and ours_tokens == ref and shifted != want
        ok &= same
        times.append((prefill_s, transfer_s, step_s))
        print(
            f"  prompt {n}: {length} tokens in {nb} blocks: {'equal' if same else 'DIFFERENT'} "
            f"(KV bytes {'equal' if got == want else 'differ'}, shifted blocks seen: {shifted != want}, "
            f"{new_tokens} tokens {'equal' if ours_tokens == ref else f'{ours_tokens} vs {ref}'}); "
            f"TTFT: prefill {prefill_s * 1e3:.2f} ms, transfer {transfer_s * 1e3:.2f} ms, "
            f"first decode step {step_s * 1e3:.2f} ms"
        )
    ours.send(("stop",))
    assert ours.poll(60), "the prefill process did not stop"
    _, confirmed = ours.recv()
    proc.join(30)
    engine.close()
    med = [statistics.median(t[i] for t in times) * 1e3 for i in range(3)]
    print(
        f"model ({device}, {transport}): {'PASS' if ok else 'FAIL'}: {sum(1 for _ in times)} prompts, "
        f"greedy tokens {'equal to' if ok else 'NOT equal to'} one process's; sends confirmed {confirmed}; "
        f"TTFT median: prefill {med[0]:.2f} ms + transfer {med[1]:.2f} ms + first decode step {med[2]:.2f} ms"
    )
    return ok


def wait_received(engine: Any, rid: str) -> bool:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        f = engine.wait_finished(1.0)
        if rid in f.receiving:
            return True
        for failed in f.failed:
            if failed[0] == rid:
                print(f"  {rid}: read failed: {failed}")
                return False
    print(f"  {rid}: not received in 60 s")
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--transport", choices=("local", "tcp"), required=True)
    ap.add_argument("--new-tokens", type=int, default=16)
    a = ap.parse_args()
    return 0 if run(a.device, a.transport, a.new_tokens) else 1


if __name__ == "__main__":
    sys.exit(main())
