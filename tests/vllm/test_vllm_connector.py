"""kvlink's vLLM connector driven through two real vLLM Schedulers in two processes (prefill
and decode, CPU tensors): vLLM's factory loads ``kvlink.vllm.KvlinkConnector`` in both roles,
the prefill's ``request_finished`` makes the transfer parameters the decode consumes, and
every byte the decode receives is checked. Run by tools/test.sh in a venv with vLLM."""

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
# Long enough that only the tests' own reject/cancel/abort paths free a hold in time.
ABORT_TIMEOUT = 300.0


class Proc:
    """An engine process and its command pipe."""

    def __init__(
        self,
        name: str,
        extra: Optional[Dict[str, Any]] = None,
        layout: str = "flash",
        asynchronous: bool = True,
        tp: int = 1,
        hybrid: bool = False,
    ):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        extra = {"abort_timeout": ABORT_TIMEOUT, "request_timeout": 20.0, **(extra or {})}
        self.proc = ctx.Process(target=engine_process.serve, args=(child, name, BLOCKS, extra, layout, asynchronous, tp, hybrid), daemon=True)
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


@pytest.mark.parametrize("layout", ["flashinfer", "mla"])
def test_other_kv_cache_layouts_with_the_synchronous_scheduler(layout):
    """FlashInfer's [num_blocks, 2, ...] (bf16) and MLA's [num_blocks, block_size, 576] (one
    byte per element, as fp8) end to end, with vLLM's synchronous Scheduler (the other tests
    use its default, the AsyncScheduler)."""
    prefill = Proc("fi-prefill", layout=layout, asynchronous=False)
    decode = Proc("fi-decode", layout=layout, asynchronous=False)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        prompts = {f"fi{i}": list(range(10 + i, 10 + i + 17 * (i + 1))) for i in range(4)}
        params = run_prefill(prefill, prompts)
        for rid, prompt in prompts.items():
            decode.call("add", "d-" + rid, prompt, 2, params[rid])
        step_until([decode, prefill], lambda f: sum(x["engine"] == "fi-decode" for x in f) == 4, what="flashinfer decode")
        s = decode.call("state")
        assert s["bad"] == [] and len(s["verified"]) == 4, s
        assert_no_leak([prefill, decode])
    finally:
        prefill.close()
        decode.close()


def test_two_tp_ranks_each_read_their_peer_rank():
    """TP 2 on both sides: each decode rank reads its peer prefill rank's blocks (the ranks'
    bytes differ), vLLM's aggregator releases a request once both ranks reported it, and the
    prefill frees its blocks only when both ranks' reads were confirmed."""
    prefill, decode = Proc("tp2-prefill", tp=2), Proc("tp2-decode", tp=2)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        assert len(set(prefill.ready["addresses"])) == 2
        rng = random.Random(77)
        prompts = {f"t{i}": [rng.randrange(10, 1000) for _ in range(rng.randrange(20, 200))] for i in range(6)}
        params = run_prefill(prefill, prompts)
        for rid, prompt in prompts.items():
            assert params[rid]["remote_addresses"] == prefill.ready["addresses"]
            decode.call("add", "d-" + rid, prompt, 3, params[rid])
        step_until([decode, prefill], lambda f: sum(x["engine"] == "tp2-decode" for x in f) == 6, what="TP 2 decode")
        s = decode.call("state")
        assert s["bad"] == [] and len(s["verified"]) == 6, s
        assert s["engine_stats"]["reads_done"] == 12, s["engine_stats"]
        assert_no_leak([prefill, decode])
        p = prefill.call("state")
        assert p["engine_stats"]["sends_done"] == 12 and p["finished_sending"] == 6, p
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize(
    "prefill_tp, decode_tp, layout",
    [(1, 2, "flash"), (2, 1, "flash_hnd"), (1, 4, "flashinfer"), (2, 1, "mla")],
)
def test_heterogeneous_tp_every_head_of_every_byte(prefill_tp, decode_tp, layout):
    """A prefill and a decode of different TP sizes: each decode rank reads its share of a
    prefill rank's KV heads (decode larger), or gathers the heads of several prefill ranks into
    its blocks (prefill larger); MLA's latent is read whole. Every head of every position is
    checked, and each prefill rank frees its blocks only once every decode rank reading it
    confirmed."""
    name = f"tp{prefill_tp}to{decode_tp}-{layout}"
    prefill = Proc(name + "-prefill", layout=layout, tp=prefill_tp)
    decode = Proc(name + "-decode", layout=layout, tp=decode_tp)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        rng = random.Random(prefill_tp * 10 + decode_tp)
        prompts = {f"h{i}": [rng.randrange(10, 1000) for _ in range(rng.randrange(20, 150))] for i in range(5)}
        params = run_prefill(prefill, prompts)
        for rid, prompt in prompts.items():
            assert params[rid]["tp_size"] == prefill_tp
            decode.call("add", "d-" + rid, prompt, 2, params[rid])
        step_until([decode, prefill], lambda f: sum(x["engine"] == decode.name for x in f) == 5, what=name)
        s = decode.call("state")
        assert s["bad"] == [] and len(s["verified"]) == 5, s
        # Each decode rank read each request once, from as many prefill ranks as it pairs with.
        assert s["engine_stats"]["reads_done"] == 5 * decode_tp, s["engine_stats"]
        assert_no_leak([prefill, decode])
        p = prefill.call("state")
        assert p["engine_stats"]["sends_done"] == 5 * prefill_tp and p["finished_sending"] == 5, p
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 1), (1, 2)])
def test_hybrid_kv_cache_groups_full_and_sliding_window(prefill_tp, decode_tp):
    """vLLM's hybrid KV cache manager left on (the connector subclasses SupportsHMA): a
    full-attention group and a sliding-window group, each with block ids of its own. The
    decode reads both groups' blocks (the sliding window's only as far as it still sees), and
    every kept position is checked, with the same and with another TP size."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    import kvlink.vllm

    assert supports_hma(kvlink.vllm.KvlinkConnector)
    name = f"hybrid{prefill_tp}{decode_tp}"
    prefill = Proc(name + "-prefill", tp=prefill_tp, hybrid=True)
    decode = Proc(name + "-decode", tp=decode_tp, hybrid=True)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        rng = random.Random(5)
        # Long prompts: the window (48 tokens) sees only the last few blocks. The last two are
        # prefilled in chunks of 256 tokens (513: a last chunk of one token, after which the
        # prefill has freed the blocks its window left behind).
        lengths = [rng.randrange(60, 220) for _ in range(3)] + [300, 513]
        prompts = {f"w{i}": [rng.randrange(10, 1000) for _ in range(n)] for i, n in enumerate(lengths)}
        params = run_prefill(prefill, prompts)
        for rid, prompt in prompts.items():
            groups = params[rid]["remote_block_ids"]
            assert len(groups) == 2 and len(groups[0]) == len(groups[1]), groups
            # The sliding window's group sends only its last blocks.
            assert 0 < sum(1 for b in groups[1] if b) < sum(1 for b in groups[0] if b), groups
            decode.call("add", "d-" + rid, prompt, 2, params[rid])
        step_until([decode, prefill], lambda f: sum(x["engine"] == decode.name for x in f) == 5, what=name)
        s = decode.call("state")
        assert s["bad"] == [] and len(s["verified"]) == 5, s
        assert_no_leak([prefill, decode])
    finally:
        prefill.close()
        decode.close()


def test_kv_cache_tensors_maps_vllm_layouts():
    import torch

    from kvlink.vllm import kv_cache_tensors

    nb = 10
    fa = torch.zeros(2, nb, 16, 4, 8, dtype=torch.bfloat16)
    fi = torch.zeros(nb, 2, 16, 4, 8, dtype=torch.float16)
    mla = torch.zeros(nb, 16, 576, dtype=torch.uint8)  # fp8 caches are one byte per element
    # HND through a permuted view: blocks stay dense.
    hnd = torch.zeros(2, nb, 4, 16, 8, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    memory, layout = kv_cache_tensors({"fa": fa, "fi": fi, "mla": mla, "hnd": hnd}, nb, {"mla": 1}, (8, 4))
    assert len(memory) == 4
    block = 16 * 4 * 8 * 2
    # Token-major blocks repeat their 4 heads once per token (16 runs), FlashInfer's twice as
    # often (K and V in one block), head-major ones once; MLA's latent declares no heads.
    assert layout[0] == (0, 0, block, block, nb, 0, (8, 4, 16))
    assert layout[1] == (0, nb * block, block, block, nb, 0, (8, 4, 16))
    assert layout[2] == (1, 0, 2 * block, 2 * block, nb, 0, (8, 4, 32))
    assert layout[3] == (2, 0, 16 * 576, 16 * 576, nb, 1, None)
    assert layout[4][2:] == (block, block, nb, 0, (8, 4, 1)) and layout[5][1] == nb * block
    # Without head counts (MLA models), nothing declares heads.
    assert all(t[6] is None for t in kv_cache_tensors({"fa": fa}, nb)[1])
    with pytest.raises(ValueError, match="block index"):
        kv_cache_tensors({"bad": torch.zeros(3, 4)}, nb)
    with pytest.raises(ValueError, match="not dense"):
        kv_cache_tensors({"strided": torch.zeros(nb, 16, 8)[:, ::2]}, nb)


def test_loaded_by_vllms_factory():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import kvlink.vllm

    cfg = KVTransferConfig(kv_connector="KvlinkConnector", kv_connector_module_path="kvlink.vllm", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(cfg) is kvlink.vllm.KvlinkConnector


def test_head_runs_agree_across_tp_sizes():
    """A block's runs of heads are the same whatever the number of heads a rank holds (one
    head included), so ranks of different TP sizes can pair."""
    import torch

    from kvlink.vllm.layout import _head_split

    for heads in (4, 2, 1):
        nhd = torch.zeros(16, heads, 8)
        fi = torch.zeros(2, 16, heads, 8)
        hnd = torch.zeros(heads, 16, 8).permute(1, 0, 2)
        fi_hnd = torch.zeros(2, heads, 16, 8).permute(0, 2, 1, 3)
        assert _head_split(nhd, (4, heads)) == (4, heads, 16)
        assert _head_split(fi, (4, heads)) == (4, heads, 32)
        assert _head_split(hnd, (4, heads)) == (4, heads, 1)
        assert _head_split(fi_hnd, (4, heads)) == (4, heads, 2)
