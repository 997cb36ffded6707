"""kvlink's vLLM connector driven through two real vLLM Schedulers in two processes (prefill
and decode), on KV caches vLLM itself computed and allocated for real model configurations
(``models/``): vLLM's factory loads ``kvlink.vllm.KvlinkConnector`` in both roles, the
prefill's ``request_finished`` makes the transfer parameters the decode consumes, and every
byte the decode receives is checked. This file: requests through one pair of engines (prefix
hits, rejections, aborts, dead peers, refusals), DP ports, the factory; test_vllm_memory.py:
vLLM's layouts, model kinds, TP sizes and block sizes. Run by tools/test.sh in a venv with
vLLM."""

from __future__ import annotations

import os
import random
import signal
import sys
from typing import Dict, List

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import engine_process  # noqa: E402
from harness import (  # noqa: E402
    GPT_OSS,
    Proc,
    assert_no_leak,
    close,
    freeze,
    pair_of,
    run_prefill,
    step_until,
    transfer,
)


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
        dict(params["tp-1"], remote_block_sizes="16"),
        # Block sizes that do not divide: usable parameters, an unusable prefill.
        dict(params["tp-1"], remote_block_sizes=[24]),
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
    freeze(prefill)
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


def test_a_stale_read_is_recomputed_and_never_fed_to_the_decode(pair):
    """A read made for an earlier hold of a request id (its transfer parameters name that
    hold's token) while the prefill holds the id again for someone else: the bytes arrive (the
    id is held, over these blocks), but the prefill refuses to confirm a hold that ended, so the
    decode recomputes the prompt and never decodes from those bytes; the current hold is
    untouched and its own read then completes."""
    prefill, decode = pair
    prompt = list(range(500, 600))
    params = run_prefill(prefill, {"st-1": prompt})["st-1"]
    assert isinstance(params["remote_hold"], int) and params["remote_hold"] > 0, params
    stale = dict(params, remote_hold=params["remote_hold"] ^ 1)
    p0, d0 = prefill.call("state")["engine_stats"], decode.call("state")["engine_stats"]
    decode.call("add", "d-st-stale", prompt, 2, stale)
    finished = step_until([decode, prefill], lambda f: any(x["id"] == "d-st-stale" for x in f), what="recompute of a stale read")
    assert finished[-1]["reason"] == "length", finished
    p1, d1 = prefill.call("state")["engine_stats"], decode.call("state")["engine_stats"]
    assert d1["reads_failed"] == d0["reads_failed"] + 1 and d1["reads_done"] == d0["reads_done"], (d0, d1)
    assert p1["notices_refused"] > p0["notices_refused"], (p0, p1)
    assert prefill.call("state")["in_flight"][1] == 1, "the current hold is untouched"
    decode.call("add", "d-st-1", prompt, 2, params)
    step_until([decode, prefill], lambda f: any(x["id"] == "d-st-1" for x in f), what="the current hold's read")
    s = decode.call("state")
    assert "d-st-1" in s["verified"] and "d-st-stale" not in s["verified"], s
    assert not [b for b in s["bad"] if b.startswith("d-st")], s["bad"]
    assert_no_leak([prefill, decode], limit=20.0)


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
    engine's index in data_parallel_index: rank r of engine d listens on port + d * tp + r.
    Two DP prefill engines of TP 2 with one configured port then serve one decode engine each,
    on one host, every byte checked."""
    from ports import free_ports

    base = free_ports(4)
    engines = [Proc(f"dp{d}", extra={"listen": f"127.0.0.1:{base}"}, tp=2, dp_index=d) for d in range(2)]
    decodes = [Proc(f"dp{d}-decode", tp=2) for d in range(2)]
    try:
        ports = [int(a.rsplit(":", 1)[1]) for e in engines for a in e.wait_ready()["addresses"]]
        assert ports == [base, base + 1, base + 2, base + 3], ports
        for d, (prefill, decode) in enumerate(zip(engines, decodes)):
            transfer(prefill, decode, 3, seed=40 + d)
    finally:
        close(*engines, *decodes)


def test_loaded_by_vllms_factory():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import kvlink.vllm

    cfg = KVTransferConfig(kv_connector="KvlinkConnector", kv_connector_module_path="kvlink.vllm", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(cfg) is kvlink.vllm.KvlinkConnector
