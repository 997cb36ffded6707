"""kvlink's vLLM connector driven through two real vLLM Schedulers in two processes (prefill
and decode), on KV caches vLLM itself computed and allocated for real model configurations
(``models/``): vLLM's factory loads ``kvlink.vllm.KvlinkConnector`` in both roles, the
prefill's ``request_finished`` makes the transfer parameters the decode consumes, and every
byte the decode receives is checked. Run by tools/test.sh in a venv with vLLM."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sys
import time
from typing import Any, Dict, List, Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import engine_process  # noqa: E402

BLOCKS = 400
LLAMA = "llama-3.1-8b"
GPT_OSS = "gpt-oss-20b"
DEEPSEEK = "deepseek-v2-lite"
GRANITE_H = "granite-4.0-h-tiny"
GEMMA_3N = "gemma-3n-e2b"
# Long enough that only the tests' own reject/cancel/abort paths free a hold in time.
ABORT_TIMEOUT = 300.0


class Proc:
    """An engine process and its command pipe."""

    def __init__(self, name: str, extra: Optional[Dict[str, Any]] = None, model: str = LLAMA, asynchronous: bool = True, **options: Any):
        """``options``: ``engine_process.Engine``'s (``tp``, ``layout``, ``kernel_block``,
        ``block_size``, ``dp_index``, ``supported``)."""
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        extra = {"abort_timeout": ABORT_TIMEOUT, "request_timeout": 20.0, **(extra or {})}
        options = dict(options, model=model, asynchronous=asynchronous)
        self.proc = ctx.Process(target=engine_process.serve, args=(child, name, BLOCKS, extra, options), daemon=True)
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


@pytest.fixture(scope="module")
def pair():
    prefill, decode = Proc("prefill"), Proc("decode")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


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


def test_many_requests_with_prefix_hits_every_byte(pair):
    prefill, decode = pair
    rng = random.Random(1234)
    shared = [rng.randrange(10, 1000) for _ in range(3 * engine_process.BLOCK_SIZE + 5)]
    prompts: Dict[str, List[int]] = {}
    for i in range(24):
        n = rng.randrange(2, 250)
        body = [rng.randrange(10, 1000) for _ in range(n)]
        # A third of them share a 53-token prefix: the decode holds its first three blocks
        # after the first of them and reads only the rest.
        prompts[f"p{i}"] = (shared + body) if i % 3 == 0 else body
    # Prefill in waves so the decode runs while other prefills are in flight.
    ids = list(prompts)
    decode_ids: Dict[str, str] = {}
    decoded = 0
    for wave in (ids[:8], ids[8:16], ids[16:]):
        params = run_prefill(prefill, {r: prompts[r] for r in wave})
        for rid in wave:
            # The decode's own request id: vLLM gives every request an internal id, and the
            # two engines' ids differ.
            did = f"d-{rid}-{rng.randrange(1 << 30):x}"
            decode_ids[did] = rid
            decode.call("add", did, prompts[rid], 4, params[rid])
        finished = step_until(
            [decode, prefill],
            lambda f: decoded + sum(x["engine"] == "decode" for x in f) >= len(decode_ids),
            what="decode of a wave",
        )
        assert all(x["reason"] == "length" for x in finished if x["engine"] == "decode"), finished
        decoded += sum(x["engine"] == "decode" for x in finished)
    state = decode.call("state")
    assert state["bad"] == [], state["bad"]
    assert sorted(state["verified"]) == sorted(decode_ids), set(decode_ids) ^ set(state["verified"])
    reads = state["reads"]
    assert set(reads) == set(decode_ids), set(reads) ^ set(decode_ids)
    # Partial local prefix hits read fewer blocks than the prompt has.
    partial = [d for d, r in decode_ids.items() if len(prompts[r]) > 52 and reads[d] < -(-len(prompts[r]) // 16)]
    assert len(partial) >= 4, (partial, reads)
    assert state["connector_stats"].get("Num reads", 0) == len(decode_ids), state["connector_stats"]
    assert state["engine_stats"]["reads_done"] >= len(decode_ids)
    assert_no_leak([prefill, decode])
    pstate = prefill.call("state")
    assert pstate["engine_stats"]["sends_done"] >= len(decode_ids), pstate["engine_stats"]


def test_decode_rejected_before_admission_frees_the_prefill(pair):
    prefill, decode = pair
    params = run_prefill(prefill, {"rej-1": list(range(100, 180))})
    assert prefill.call("state")["in_flight"][1] == 1
    # Aborted before it was ever scheduled on the decode: vLLM calls request_finished with
    # the parameters untouched; the prefill is told and frees its blocks at once (its abort
    # timeout is 300 s).
    failed_before = prefill.call("state")["engine_stats"]["sends_failed"]
    decode.call("add", "d-rej-1", list(range(100, 180)), 4, params["rej-1"])
    decode.call("abort", ["d-rej-1"])
    assert_no_leak([prefill, decode], limit=20.0)
    assert prefill.call("state")["engine_stats"]["sends_failed"] == failed_before + 1


def test_unusable_params_are_computed_locally_and_the_prefill_told(pair):
    """Parameters from a prefill this engine cannot read (blocks of another number of KV cache
    groups) and malformed ones (they come from clients) never crash either engine: the decode
    computes the prompt itself and, when it can tell which prefill it was, frees that
    prefill's blocks at once."""
    prefill, decode = pair
    prompt = list(range(300, 390))
    params = run_prefill(prefill, {"tp-1": prompt})
    blocks = params["tp-1"]["remote_block_ids"]
    other_groups = dict(params["tp-1"], remote_block_ids=[blocks, blocks])
    failed_before = prefill.call("state")["engine_stats"]["sends_failed"]
    decode.call("add", "d-tp-1", prompt, 2, other_groups)
    bad = [
        dict(params["tp-1"], remote_block_ids="not a list"),
        dict(params["tp-1"], remote_block_ids=[-1, 2**40]),
        dict(params["tp-1"], remote_addresses=[17]),
        dict(params["tp-1"], remote_num_tokens="many"),
        {"do_remote_prefill": True},
    ]
    for i, p in enumerate(bad):
        decode.call("add", f"d-bad-{i}", prompt, 2, p)
    want = {"d-tp-1"} | {f"d-bad-{i}" for i in range(len(bad))}
    finished = step_until([decode, prefill], lambda f: want <= {x["id"] for x in f}, what="local compute of unusable params")
    assert all(x["reason"] == "length" for x in finished if x["id"] in want), finished
    assert decode.call("state")["reads"].keys().isdisjoint(want)
    assert_no_leak([prefill, decode], limit=20.0)
    assert prefill.call("state")["engine_stats"]["sends_failed"] == failed_before + 1


def test_decode_aborted_while_reading_is_cancelled(pair):
    prefill, decode = pair
    prompt = [int(x) for x in random.Random(5).choices(range(10, 1000), k=200)]
    params = run_prefill(prefill, {"ab-1": prompt})
    before = decode.call("state")["engine_stats"]
    # Freeze the prefill process: the decode's read is sent and never answered.
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        decode.call("add", "d-ab-1", prompt, 4, params["ab-1"])
        # Steps until the scheduler has handed the read to the worker, then aborts at once.
        for _ in range(50):
            decode.call("step")
            if "d-ab-1" in decode.call("state")["reads"]:
                break
        st = decode.call("state")
        assert "d-ab-1" in st["reads"], ("the read was never started", st["requests"], st["in_flight"])
        decode.call("abort", ["d-ab-1"])
        decode.call("step")  # hands the cancel to the worker
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    # The decode's blocks come back once the read ends; the prefill's once the abort reaches
    # it (well before its 300 s abort timeout).
    assert_no_leak([prefill, decode], limit=30.0)
    after = decode.call("state")["engine_stats"]
    # Nothing was received. The read ended cancelled, or (rarely, when the frozen prefill made
    # it fail first) failed on its own; either way it ended, and nothing leaked.
    assert after["reads_done"] == before["reads_done"], (before, after)
    assert after["reads_failed"] == before["reads_failed"] + 1, (before, after)
    assert after["reads_cancelled"] - before["reads_cancelled"] in (0, 1), (before, after)


def test_prefill_abort_leaks_nothing(pair):
    prefill, decode = pair
    # Aborted while its prompt is being prefilled in chunks (256 tokens per step): nothing
    # was held.
    prefill.call("add", "pa-1", list(range(10, 700)), 1, {"do_remote_decode": True})
    prefill.call("step")
    assert prefill.call("state")["in_flight"][1] == 0, "a partial prompt is not held"
    prefill.call("abort", ["pa-1"])
    # Aborted after its prompt completed (held) but before it finished generating: the hold
    # is released and no parameters are offered.
    prefill.call("add", "pa-2", list(range(10, 90)), 3, {"do_remote_decode": True})
    prefill.call("step")
    assert prefill.call("state")["in_flight"][1] == 1, "held at the step that completed the prompt"
    prefill.call("abort", ["pa-2"])
    out = prefill.call("step")
    assert all(f["params"] is None for f in out["finished"]), out
    assert prefill.call("state")["in_flight"][1] == 0, "released"
    assert_no_leak([prefill, decode])


def test_dead_prefill_leads_to_recompute(pair):
    _, decode = pair
    doomed = Proc("doomed-prefill")
    try:
        doomed.wait_ready()
        prompt = list(range(200, 300))
        params = run_prefill(doomed, {"dead-1": prompt})
    finally:
        doomed.proc.kill()
        doomed.proc.join(10)
    before = decode.call("state")["engine_stats"]
    decode.call("add", "d-dead-1", prompt, 2, params["dead-1"])
    finished = step_until([decode], lambda f: any(x["id"] == "d-dead-1" for x in f), what="recompute after a dead prefill")
    assert finished[-1]["reason"] == "length", finished
    after = decode.call("state")["engine_stats"]
    assert after["reads_failed"] == before["reads_failed"] + 1, (before, after)
    assert_no_leak([decode])


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
    assert s["bad"] == [] and len(s["verified"]) == count, s
    assert_no_leak([prefill, decode])
    return s


def pair_of(name: str, prefill: Dict[str, Any], decode: Dict[str, Any]):
    return Proc(name + "-prefill", **prefill), Proc(name + "-decode", **decode)


def close(*procs: Proc) -> None:
    for p in procs:
        p.close()


@pytest.mark.parametrize(
    "model, layout",
    [(LLAMA, "LBNHC"), (LLAMA, "BLHNC"), (LLAMA, "BLNHC"), (DEEPSEEK, None)],
)
def test_layouts_on_vllms_memory_with_the_synchronous_scheduler(model, layout):
    """Every block-dense layout vLLM allocates (the connector's LBHNC is the other tests'
    default) and MLA's latent, end to end with vLLM's synchronous Scheduler (the other tests
    use its default, the AsyncScheduler)."""
    opts = dict(model=model, layout=layout, asynchronous=False)
    prefill, decode = pair_of(f"layout-{layout}", opts, opts)
    try:
        s = transfer(prefill, decode, 4, seed=3)
        assert layout is None or s["layout"] == layout
    finally:
        close(prefill, decode)


def test_connector_asks_for_head_major_blocks_and_vllm_takes_it():
    """With backends that prefer a per-head-split layout (ROCm's attention lists LHBNC first),
    vLLM resolves the connector's LBHNC; MLA models state no preference."""
    prefill, decode = pair_of("prefer", dict(supported=["LHBNC", "LBHNC"]), dict(model=DEEPSEEK, supported=["BLNHC", "LBNHC"]))
    try:
        assert prefill.wait_ready()["layout"] == "LBHNC"
        assert decode.wait_ready()["layout"] == "BLNHC"  # MLA: the backend's own choice
    finally:
        close(prefill, decode)


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_per_head_split_layouts_are_refused_at_start_with_what_to_set(layout):
    """A user forcing a layout whose blocks are one piece per head: the worker refuses to
    start, naming the layouts that work."""
    p = Proc(f"split-{layout}", layout=layout)
    try:
        with pytest.raises(AssertionError, match=f"{layout} stores each block as one piece per KV head"):
            p.wait_ready()
    finally:
        p.close()


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_cross_layer_kv_sharing(decode_tp):
    """Gemma 3n (its last layers reuse earlier layers' caches, and sliding-window and full
    groups): vLLM hands the connector the shared layers as aliases of their targets, outside
    the KV cache config; the connector sends each cache once, and every byte of every layer
    that owns a cache arrives, with the same and another TP size."""
    prefill, decode = pair_of(f"kvshare{decode_tp}", dict(model=GEMMA_3N), dict(model=GEMMA_3N, tp=decode_tp))
    try:
        s = transfer(prefill, decode, 4, seed=19)
        assert s["engine_stats"]["reads_done"] == 4 * decode_tp, s["engine_stats"]
    finally:
        close(prefill, decode)


def test_mamba_hybrid_is_refused_at_start_by_name():
    """Granite 4.0-H (Mamba-2 and attention layers): vLLM gives the SSM state a KV cache group
    of its own; the connector refuses it when vLLM creates the scheduler, naming the group's
    kind, instead of sending state blocks as if they were attention blocks."""
    p = Proc("mamba", model=GRANITE_H)
    try:
        with pytest.raises(AssertionError, match="holds SSM state of kind MambaSpec"):
            p.wait_ready()
    finally:
        p.close()


def test_two_tp_ranks_each_read_their_peer_rank():
    """TP 2 on both sides: each decode rank reads its peer prefill rank's blocks (the ranks'
    bytes differ), vLLM's aggregator releases a request once both ranks reported it, and the
    prefill frees its blocks only when both ranks' reads were confirmed."""
    prefill, decode = pair_of("tp2", dict(tp=2), dict(tp=2))
    try:
        s = transfer(prefill, decode, 6, seed=77, tokens=3)
        assert len(set(prefill.ready["addresses"])) == 2
        assert s["engine_stats"]["reads_done"] == 12, s["engine_stats"]
        p = prefill.call("state")
        assert p["engine_stats"]["sends_done"] == 12 and p["finished_sending"] == 6, p
    finally:
        close(prefill, decode)


@pytest.mark.parametrize(
    "prefill_tp, decode_tp, model, prefill_layout, decode_layout",
    [
        (1, 2, LLAMA, None, None),
        (2, 1, LLAMA, None, "BLHNC"),
        (1, 4, LLAMA, "LBNHC", "BLNHC"),
        (4, 1, LLAMA, "BLNHC", "LBNHC"),
        (2, 1, DEEPSEEK, None, None),
        (1, 2, DEEPSEEK, None, None),
    ],
)
def test_heterogeneous_tp_every_head_of_every_byte(prefill_tp, decode_tp, model, prefill_layout, decode_layout):
    """A prefill and a decode of different TP sizes on vLLM's memory: each decode rank reads
    its share of a prefill rank's KV heads (decode larger), or gathers the heads of several
    prefill ranks into its blocks (prefill larger); MLA's latent is read whole. The layer may
    sit inside or outside the block on either side (LB.. and BL.. layouts). Every head of
    every position is checked, and each prefill rank frees its blocks only once every decode
    rank reading it confirmed."""
    name = f"tp{prefill_tp}to{decode_tp}-{model}"
    prefill, decode = pair_of(
        name, dict(model=model, tp=prefill_tp, layout=prefill_layout), dict(model=model, tp=decode_tp, layout=decode_layout)
    )
    try:
        s = transfer(prefill, decode, 5, seed=prefill_tp * 10 + decode_tp, lengths=(20, 150))
        # Each decode rank read each request once, from as many prefill ranks as it pairs with.
        assert s["engine_stats"]["reads_done"] == 5 * decode_tp, s["engine_stats"]
        p = prefill.call("state")
        assert p["engine_stats"]["sends_done"] == 5 * prefill_tp and p["finished_sending"] == 5, p
    finally:
        close(prefill, decode)


@pytest.mark.parametrize("layout, decode_tp", [("LBNHC", 1), (None, 1), ("LBNHC", 2)])
def test_kernel_block_splitting(layout, decode_tp):
    """64-token blocks that the attention backend splits into 16-token kernel blocks (vLLM
    makes the view's first dimension four times the blocks): a block is read as the four
    kernel blocks it is, with the same TP and a decode of another TP size."""
    opts = dict(block_size=64, kernel_block=16, layout=layout)
    prefill, decode = pair_of(f"kernel-{layout}-{decode_tp}", opts, dict(opts, tp=decode_tp))
    try:
        transfer(prefill, decode, 4, seed=11, lengths=(60, 300))
    finally:
        close(prefill, decode)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 1), (1, 2)])
def test_hybrid_kv_cache_groups_full_and_sliding_window(prefill_tp, decode_tp):
    """gpt-oss (sliding-window and full-attention layers) with vLLM's hybrid KV cache manager
    left on (the connector subclasses SupportsHMA): two KV cache groups, each with block ids
    of its own, overlaid in one backing allocation. The decode reads both groups' blocks (the
    sliding window's only as far as it still sees), and every kept position is checked, with
    the same and with another TP size."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    import kvlink.vllm

    assert supports_hma(kvlink.vllm.KvlinkConnector)
    prefill, decode = pair_of(f"hybrid{prefill_tp}{decode_tp}", dict(model=GPT_OSS, tp=prefill_tp), dict(model=GPT_OSS, tp=decode_tp))
    try:
        prefill.wait_ready()
        decode.wait_ready()
        rng = random.Random(5)
        # Long prompts: the window (128 tokens) sees only the last few blocks. The last two
        # are prefilled in chunks of 256 tokens (513: a last chunk of one token, after which
        # the prefill has freed the blocks its window left behind).
        lengths = [rng.randrange(200, 250) for _ in range(3)] + [300, 513]
        prompts = {f"w{i}": [rng.randrange(10, 1000) for _ in range(n)] for i, n in enumerate(lengths)}
        params = run_prefill(prefill, prompts)
        for rid, prompt in prompts.items():
            groups = params[rid]["remote_block_ids"]
            assert len(groups) == 2 and len(groups[0]) == len(groups[1]), groups
            # The sliding window's group sends only its last blocks.
            sent = sorted(sum(1 for b in g if b) for g in groups)
            assert 0 < sent[0] < sent[1], groups
            decode.call("add", "d-" + rid, prompt, 2, params[rid])
        step_until([decode, prefill], lambda f: sum(x["engine"] == decode.name for x in f) == 5, what="hybrid")
        s = decode.call("state")
        assert s["bad"] == [] and len(s["verified"]) == 5, s
        assert_no_leak([prefill, decode])
    finally:
        close(prefill, decode)


def test_failed_read_on_a_hybrid_model_recomputes_without_raising():
    """vLLM raises when a connector reports block-level load errors under several KV cache
    groups; the connector reports the failed request alone, and vLLM recomputes it."""
    decode = Proc("hybrid-dead-decode", model=GPT_OSS)
    doomed = Proc("hybrid-doomed-prefill", model=GPT_OSS)
    try:
        doomed.wait_ready()
        decode.wait_ready()
        prompt = list(range(200, 400))
        params = run_prefill(doomed, {"hd-1": prompt})
        doomed.proc.kill()
        doomed.proc.join(10)
        decode.call("add", "d-hd-1", prompt, 2, params["hd-1"])
        finished = step_until([decode], lambda f: any(x["id"] == "d-hd-1" for x in f), what="hybrid recompute")
        assert finished[-1]["reason"] == "length", finished
        assert decode.call("state")["engine_stats"]["reads_failed"] == 1
        assert_no_leak([decode])
    finally:
        close(decode, doomed)


def test_read_refused_at_the_handshake_frees_the_prefill_at_once():
    """A decode whose blocks order heads and tokens otherwise (LBNHC against the prefill's
    LBHNC): the prefill refuses its handshake, the decode recomputes, and the prefill frees the
    blocks at once (the abort travels on a connection of its own), not at abort_timeout."""
    prefill, decode = pair_of("refused", dict(layout="LBHNC"), dict(layout="LBNHC"))
    try:
        prefill.wait_ready()
        decode.wait_ready()
        prompt = list(range(300, 420))
        params = run_prefill(prefill, {"rf-1": prompt})
        decode.call("add", "d-rf-1", prompt, 2, params["rf-1"])
        finished = step_until([decode], lambda f: any(x["id"] == "d-rf-1" for x in f), what="recompute after a refusal")
        assert finished[-1]["reason"] == "length", finished
        assert decode.call("state")["engine_stats"]["reads_failed"] == 1
        # Far below the prefill's abort timeout (300 s).
        assert_no_leak([prefill, decode], limit=10.0)
        p = prefill.call("state")["engine_stats"]
        assert p["sends_failed"] == 1 and p["sends_expired"] == 0 and p["handshakes_refused"] >= 1, p
    finally:
        close(prefill, decode)


def test_data_parallel_engines_take_their_own_ports():
    """vLLM resets data_parallel_rank to 0 in each engine of a dense model and keeps the
    engine's index in data_parallel_index: rank r of engine d listens on port + d * tp + r."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1] + 100
    engines = [Proc(f"dp{d}", extra={"listen": f"127.0.0.1:{base}"}, tp=2, dp_index=d) for d in range(2)]
    try:
        ports = [int(a.rsplit(":", 1)[1]) for e in engines for a in e.wait_ready()["addresses"]]
        assert ports == [base, base + 1, base + 2, base + 3], ports
    finally:
        close(*engines)


def test_loaded_by_vllms_factory():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import kvlink.vllm

    cfg = KVTransferConfig(kv_connector="KvlinkConnector", kv_connector_module_path="kvlink.vllm", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(cfg) is kvlink.vllm.KvlinkConnector
