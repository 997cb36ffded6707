"""What the vLLM connector tests share: an engine process (``engine_process``: vLLM's real
scheduler and the connector on KV caches vLLM allocated for a real model configuration) driven
through a pipe, and the steps of a transfer between two of them, with every byte checked."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import engine_process  # noqa: E402

# vLLM's CPU platform, as a CPU deployment selects it: its choices (kernels, the SSM state's
# dtype, the blocks of each kind) are the ones the engines' own layers and allocator make here;
# the forkserver and every engine inherit it.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
BLOCKS = 400
LLAMA = "llama-3.1-8b"
GPT_OSS = "gpt-oss-20b"
DEEPSEEK = "deepseek-v2-lite"
GRANITE_H = "granite-4.0-h-tiny"
QWEN3_NEXT = "qwen3-coder-next"
QWEN3_5 = "qwen3.5"
GEMMA_3N = "gemma-3n-e2b"
NEMOTRON_H = "nemotron-h-8b"
LLAMA_4 = "llama-4-scout"
JAMBA = "jamba-v0.1"
DEEPSEEK_V4 = "deepseek-v4-flash"
DEEPSEEK_V41 = "deepseek-v4.1"
MINIMAX_M3 = "minimax-m3"
# Long enough that only the tests' own reject/cancel/abort paths free a hold in time.
ABORT_TIMEOUT = 300.0
# Every engine process is forked from one server process that has imported torch and the vLLM
# modules an engine uses (multiprocessing's forkserver): each engine still gets a process of
# its own, fresh from those imports, without paying them again (seconds each on 2 cores, about
# 60 engines a suite). The server imports nothing of kvlink and starts no engine: what a
# process holds of vLLM's or kvlink's state is made after its fork. A module missing from a
# release is skipped by the server's import.
PRELOAD = [
    "engine_process",
    "vllm.config",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.core.sched.async_scheduler",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.kv_cache_planning",
    "vllm.v1.worker.utils",
    "vllm.v1.structured_output",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.distributed.kv_transfer.kv_connector.utils",
    "vllm.model_executor.models",
    "preload_models",
]


def freeze(proc: "Proc", limit: float = 10.0) -> None:
    """Stops every thread of ``proc``'s process (SIGSTOP) and returns once all of them are
    stopped. The kernel delivers the stop to one thread, which stops the others only when it
    next runs: on a busy machine another thread (kvlink's data server, woken by a request)
    can run for a while after ``kill`` returned, so a test that needs the process silent
    waits for every thread's state to read stopped."""
    pid = proc.proc.pid
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + limit
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:  # the thread ended meanwhile
                continue
            states.append(stat[stat.rindex(")") + 2])
        if states and all(s in "tT" for s in states):
            return
        if time.monotonic() > end:
            raise AssertionError(f"{proc.name}: not every thread stopped within {limit} s of SIGSTOP: {states}")
        time.sleep(0.005)


def _context() -> Any:
    """The forkserver context, preloading ``PRELOAD`` (once per test process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class Proc:
    """An engine process and its command pipe."""

    def __init__(self, name: str, extra: Optional[Dict[str, Any]] = None, model: str = LLAMA, asynchronous: bool = True, **options: Any):
        """``options``: ``engine_process.Engine``'s (``tp``, ``layout``, ``kernel_block``,
        ``block_size``, ``dp_index``, ``supported``, ``prefix_caching``), ``conv_layout``
        (``VLLM_SSM_CONV_STATE_LAYOUT``, SD or DS, set in the engine's process) and ``blocks``
        (the blocks' worth of memory given to vLLM, ``BLOCKS`` unless a model's pages are
        large)."""
        ctx = _context()
        self.conn, child = ctx.Pipe()
        extra = {"abort_timeout": ABORT_TIMEOUT, "request_timeout": 20.0, **(extra or {})}
        blocks = options.pop("blocks", BLOCKS)
        options = dict(options, model=model, asynchronous=asynchronous)
        self.proc = ctx.Process(target=engine_process.serve, args=(child, name, blocks, extra, options), daemon=True)
        self.proc.start()
        self.name = name
        self.ready: Optional[Dict[str, Any]] = None

    def wait_ready(self, limit: float = 240.0) -> Dict[str, Any]:
        if self.ready is None:
            self.ready = self._reply(limit)
        return self.ready

    def _reply(self, limit: float = 60.0) -> Any:
        if not self.conn.poll(limit):
            raise AssertionError(f"{self.name}: no answer within {limit} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"{self.name} failed:\n{value}")
        return value

    def call(self, cmd: str, *args: Any) -> Any:
        self.conn.send((cmd, *args))
        return self._reply()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit")
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def run_prefill(prefill: Proc, reqs: Dict[str, List[int]], max_tokens: int = 1, limit: float = 60.0) -> Dict[str, Dict[str, Any]]:
    """Adds prefill requests and steps until each finished; returns their transfer params."""
    for rid, prompt in reqs.items():
        prefill.call("add", rid, prompt, max_tokens, {"do_remote_decode": True})
    params: Dict[str, Dict[str, Any]] = {}
    end = time.monotonic() + limit
    while len(params) < len(reqs):
        assert time.monotonic() < end, f"prefill did not finish {set(reqs) - set(params)}"
        for f in prefill.call("step")["finished"]:
            assert f["params"] and f["params"]["do_remote_prefill"], f
            params[f["id"]] = f["params"]
    return params


def step_until(procs: List[Proc], done, limit: float = 60.0, what: str = "condition") -> List[Dict[str, Any]]:
    """Steps every process until ``done(finished so far)``; returns what finished."""
    finished: List[Dict[str, Any]] = []
    end = time.monotonic() + limit
    while not done(finished):
        assert time.monotonic() < end, f"{what} not reached within {limit} s; finished: {finished}"
        busy = 0
        for p in procs:
            out = p.call("step")
            finished += [dict(f, engine=p.name) for f in out["finished"]]
            busy += out["scheduled"]
        if not busy:
            time.sleep(0.01)
    return finished


def assert_no_leak(procs: List[Proc], limit: float = 30.0) -> None:
    """Every block back in the pool, no request left, nothing held or read."""
    end = time.monotonic() + limit
    while True:
        states = [p.call("state") for p in procs]
        ok = all(
            s["free_blocks"] == s["total_blocks"] and s["requests"] == 0 and s["in_flight"] == [0, 0] for s in states
        )
        if ok:
            return
        if time.monotonic() > end:
            raise AssertionError(
                "leak: " + "; ".join(
                    f"{p.name}: free {s['free_blocks']}/{s['total_blocks']}, requests {s['requests']}, "
                    f"in flight (reading, holding) {s['in_flight']}"
                    for p, s in zip(procs, states)
                )
            )
        for p in procs:
            p.call("step")
        time.sleep(0.02)


def transfer(prefill: Proc, decode: Proc, count: int, seed: int, lengths=(20, 200), tokens: int = 2) -> Dict[str, Any]:
    """Prefills ``count`` random prompts, decodes them, checks every byte and that nothing
    leaked; returns the decode's state."""
    prefill.wait_ready()
    decode.wait_ready()
    rng = random.Random(seed)
    prompts = {f"r{seed}-{i}": [rng.randrange(10, 1000) for _ in range(rng.randrange(*lengths))] for i in range(count)}
    params = run_prefill(prefill, prompts)
    for rid, prompt in prompts.items():
        decode.call("add", "d-" + rid, prompt, tokens, params[rid])
    step_until([decode, prefill], lambda f: sum(x["engine"] == decode.name for x in f) == count, what=decode.name)
    s = decode.call("state")
    assert s["bad"] == [] and {"d-" + rid for rid in prompts} <= set(s["verified"]), s
    assert_no_leak([prefill, decode])
    return s


def read_one(prefill: Proc, decode: Proc, rid: str, prompt: List[int]) -> None:
    """Prefills ``prompt`` as ``rid`` and decodes it (as ``d-<rid>``) until the decode ends it."""
    params = run_prefill(prefill, {rid: prompt})
    decode.call("add", "d-" + rid, prompt, 2, params[rid])
    step_until([decode, prefill], lambda f: any(x["engine"] == decode.name for x in f), what=rid)


def prefix_hit(prefill: Proc, decode: Proc, seed: int, prefix: int, names=("h0", "h1")) -> None:
    """Reads two prompts sharing their first ``prefix`` tokens, the second longer, and checks
    both byte for byte and that the second read fewer blocks than the first: only what follows
    the prefix the decode cached from the first."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 1000) for _ in range(prefix)]
    for rid, extra in zip(names, (30, 50)):
        read_one(prefill, decode, rid, shared + [rng.randrange(10, 1000) for _ in range(extra)])
    s = decode.call("state")
    first, second = ("d-" + n for n in names)
    assert s["bad"] == [] and {first, second} <= set(s["verified"]), s
    assert s["reads"][second] < s["reads"][first], s["reads"]
    assert_no_leak([prefill, decode])


def pair_of(name: str, prefill: Dict[str, Any], decode: Dict[str, Any]):
    return Proc(name + "-prefill", **prefill), Proc(name + "-decode", **decode)


def close(*procs: Proc) -> None:
    for p in procs:
        p.close()
