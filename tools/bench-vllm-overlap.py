"""The time to first token a progressive transfer saves through vLLM's own schedulers.

Two engines in two processes, as the vLLM connector tests run them (tests/vllm/engine_process.py:
vLLM's real scheduler, kvlink's connector loaded by vLLM's factory on both sides, KV caches
vLLM computed and allocated for Llama 3.1 8B's configuration, here with all its 32 layers), the
forward a stand-in that sleeps its compute layer by layer and calls vLLM's save hook after each
layer. Per prompt length, two flows, alternating:

- sequential: the prefill leg runs to its end; its transfer parameters then go with the decode
  leg (vLLM's usual flow, as kvlink.vllm.proxy runs it without a probe's yes);
- progressive: both legs start at once (kvlink.vllm.proxy's flow): the decode admits the request
  and follows the prefill's hold as its forward writes it (chunks of --chunk tokens, parts of
  --layers-per-part layers).

Time to first token here: from the prefill leg's start to the decode's first step of the
request with its KV loaded (what vLLM then computes, one token, is the same in both flows).
Exposed: that time minus the prefill's emulated compute. The compute keeps the real system's
ratio of compute to transfer (tools/bench-overlap.py's: the model's FLOPs at 40% of an H100
against its KV at 400 Gb/s), times this machine's transfer time for the prompt's KV (measured
first: the sequential flow without compute, median of three).

Runs in a venv with vLLM (the test command's .venv-vllm):
    .venv-vllm/bin/python tools/bench-vllm-overlap.py [--lengths 1024,4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests", "vllm")
sys.path.insert(0, TESTS)

from harness import Proc, close  # noqa: E402


def _overlap_model() -> Any:
    """tools/bench-overlap.py, for its calibration (its name is not a module name)."""
    spec = importlib.util.spec_from_file_location("bench_overlap", os.path.join(HERE, "bench-overlap.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_folder(layers: int) -> str:
    """Llama 3.1 8B's configuration (the tests') with ``layers`` layers, in a folder of its own."""
    folder = tempfile.mkdtemp(prefix="kvlink-bench-llama-")
    with open(os.path.join(TESTS, "models", "llama-3.1-8b", "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


class Pair:
    """A prefill and a decode engine, and the legs of one request."""

    def __init__(self, folder: str, args: argparse.Namespace):
        extra = {"progressive_layers_per_part": args.layers_per_part, "request_timeout": 120.0}
        options = dict(model=folder, blocks=args.blocks, max_model_len=max(args.lengths) + 64, chunk=args.chunk)
        self.prefill = Proc("bprefill", extra, **options)
        self.decode = Proc("bdecode", extra, **options)
        self.prefill.wait_ready(600)
        self.decode.wait_ready(600)
        self.n = 0

    def run(self, tokens: int, progressive: bool) -> tuple[float, float]:
        """One request of ``tokens`` tokens: seconds from its start to the decode's admission,
        and from the prefill's end to it."""
        self.n += 1
        rid, prompt = f"b{self.n}", [(self.n * 7 + i) % 990 + 10 for i in range(tokens)]
        addresses = self.prefill.ready["addresses"]
        if progressive:
            tid, hold = "t-" + rid, secrets.randbits(63) + 1
            p_params = {"do_remote_decode": True, "transfer_id": tid, "transfer_hold": hold}
            d_params = {
                "do_remote_prefill": True,
                "progressive": True,
                "remote_addresses": addresses,
                "remote_request_id": tid,
                "remote_hold": hold,
                "remote_block_sizes": [16],
                "tp_size": len(addresses),
            }
        else:
            p_params = {"do_remote_decode": True}
        start = time.monotonic()
        if progressive:
            self.decode.call("add", "d" + rid, prompt, 1, d_params)
        self.prefill.call("add", rid, prompt, 1, p_params)
        watcher = threading.Thread(target=self._admit, args=("d" + rid,)) if progressive else None
        if watcher is not None:
            watcher.start()
        params = None
        while params is None:
            for f in self.prefill.call("step")["finished"]:
                params = f["params"]
        prefilled = time.monotonic()
        if watcher is None:
            self.decode.call("add", "d" + rid, prompt, 1, params)
            self._admit("d" + rid)
        else:
            watcher.join()
        admitted = self.decode.call("admitted_at", "d" + rid)
        self._drain(rid)
        return admitted - start, admitted - prefilled

    def _admit(self, rid: str, limit: float = 300.0) -> None:
        """Steps the decode until ``rid`` is scheduled with its KV."""
        end = time.monotonic() + limit
        while self.decode.call("admitted_at", rid) is None:
            assert time.monotonic() < end, f"{rid} not admitted within {limit} s"
            if not self.decode.call("step")["scheduled"]:
                time.sleep(0.0005)

    def _drain(self, rid: str) -> None:
        """Both engines stepped until nothing is held, read or running."""
        for _ in range(20000):
            done = True
            for p in (self.prefill, self.decode):
                p.call("step")
                s = p.call("state")
                done = done and s["requests"] == 0 and s["in_flight"] == [0, 0]
            if done:
                return
            time.sleep(0.002)
        raise AssertionError(f"{rid}: the engines did not drain")


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms (min {min(xs) * 1e3:.1f}, max {max(xs) * 1e3:.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,4096", help="prompt lengths in tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--layers-per-part", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (chunked prefill)")
    ap.add_argument("--blocks", type=int, default=600, help="each engine's KV cache, in 16-token blocks")
    ap.add_argument("--out", help="append one JSON line per length")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    ratio = _overlap_model().ratio
    folder = model_folder(args.layers)
    pair = Pair(folder, args)
    try:
        for tokens in args.lengths:
            pair.prefill.call("set_compute", 0.0)
            pair.run(tokens, False)  # warm-up
            xfer = statistics.median(pair.run(tokens, False)[1] for _ in range(3))
            compute = ratio("llama3-8b", tokens) * xfer
            pair.prefill.call("set_compute", compute / (tokens * args.layers))
            got: dict[str, list[float]] = {"sequential": [], "progressive": []}
            for k in range(args.rounds):
                for name in sorted(got, reverse=bool(k % 2)):
                    got[name].append(pair.run(tokens, name == "progressive")[0])
            exposed = {n: [t - compute for t in ts] for n, ts in got.items()}
            hidden = 1 - statistics.median(exposed["progressive"]) / statistics.median(exposed["sequential"])
            print(
                f"{tokens} tokens [transfer {xfer * 1e3:.1f} ms, compute {compute * 1e3:.0f} ms]: "
                f"TTFT sequential {summary(got['sequential'])}, progressive {summary(got['progressive'])}; "
                f"exposed sequential {summary(exposed['sequential'])}, progressive "
                f"{summary(exposed['progressive'])}, hidden {hidden:.1%}",
                flush=True,
            )
            if args.out:
                with open(args.out, "a") as f:
                    row = {"tokens": tokens, "transfer": xfer, "compute": compute, **got}
                    f.write(json.dumps(row) + "\n")
    finally:
        close(pair.prefill, pair.decode)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
