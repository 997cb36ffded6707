"""ATOM prefill and decode engines in separate processes, each ATOM's own CoreManager,
EngineCore (its real Scheduler and step loop) and TP worker processes, moving the KV cache ATOM's
attention builders allocated through kvlink over TCP. Every decode step checks every KV byte it
computes from (``kvmodel``), every test ends with ATOM's block pools back to their totals and
the connector waiting for nothing (ATOM's own metrics)."""

from __future__ import annotations

import json
import socket
import time
from contextlib import contextmanager

import pytest

import kvmodel
from harness import Engine, close_all, free_ports, idle_all, prompt

LLAMA, DEEPSEEK, DEEPSEEK_V4 = "llama-3.1-8b", "deepseek-v2-lite", "deepseek-v4-flash"
QWEN3_NEXT, KIMI_LINEAR = "qwen3-coder-next", "kimi-linear"


@contextmanager
def pair(tmp_path, model=LLAMA, ptp=1, dtp=1, prefix=False, penv=None, denv=None, block_size=16, dtype="bf16"):
    pranks = ptp * int((penv or {}).get("KVLINK_ATOM_DP", "1"))  # one port per (DP, TP) rank
    base = free_ports(pranks + dtp)
    common = {"KVLINK_ATOM_BLOCK_SIZE": str(block_size), "KVLINK_ATOM_KV_DTYPE": dtype}
    P = Engine(str(tmp_path), "prefill", "kv_producer", model, ptp, base, prefix, {**common, **(penv or {})})
    D = Engine(str(tmp_path), "decode", "kv_consumer", model, dtp, base + pranks, prefix, {**common, **(denv or {})})
    try:
        P.ready()
        D.ready()
        P.tp = ptp
        yield P, D
    finally:
        close_all(P, D)


def prefill(P, key, tokens, max_tokens=1):
    """The prefill's half of a request: its parameters, as ATOM's router passes them on."""
    P.add(key, tokens, max_tokens, {"do_remote_decode": True})
    r = P.result(key)
    assert r["reason"] == "max_tokens" and r["tokens"] == kvmodel.expected(tokens, 1), r
    params = dict(r["params"])
    # What ATOM's router adds (mesh/src/core/placement/backend/atom.rs, enrich_decode_kv).
    params.update(remote_dp_size=1, remote_tp_size=P.tp, remote_dp_rank=params["dp_rank"])
    return params


def decode(D, key, tokens, params, max_tokens=6):
    D.add(key, tokens, max_tokens, params)
    return D.result(key)


def settle(*engines, fallbacks=0):
    """Every engine idle: blocks back, nothing pending; no forward saw a wrong KV byte. On the
    decode (the last engine), every read completed except ``fallbacks`` (a local prefill
    computes the same tokens, so tokens alone cannot tell a read from a fallback)."""
    metrics = idle_all(*engines)
    for e in engines:
        assert e.kv_errors() == [], f"{e.name}: {e.kv_errors()}"
    c = counters(metrics[-1])
    assert c["fallbacks"] == fallbacks and c["received"] == c["reads"] - fallbacks - c["aborted_reads"], c
    return metrics


def counters(m):
    return {k[len("kvlink_"):]: v for k, v in (m.get("offload") or {}).items() if k != "kvlink_pending"}


def test_full_transfer_then_prefix_hit_read_incrementally(tmp_path):
    with pair(tmp_path, prefix=True) as (P, D):
        prompts = {f"r{i}": prompt(i, n) for i, n in enumerate((70, 33, 16, 129))}
        params = {k: prefill(P, k, p) for k, p in prompts.items()}
        for k, p in prompts.items():  # all parked and read at once
            D.add(k, p, 6, params[k])
        for k, p in prompts.items():
            r = D.result(k)
            assert r["tokens"] == kvmodel.expected(p, 6), (k, r)
        _, d = settle(P, D)
        c = counters(d)
        assert c["reads"] == 4 and c["blocks_read"] == 5 + 3 + 1 + 9 and c["blocks_cached"] == 0, c
        # The decode now holds r0's first 4 blocks in its prefix cache: a prompt sharing them
        # reads only its own blocks.
        shared = prompts["r0"][:64] + prompt(9, 30)
        r = decode(D, "again", shared, prefill(P, "again", shared))
        assert r["tokens"] == kvmodel.expected(shared, 6), r
        _, d = settle(P, D)
        c2 = counters(d)
        assert c2["blocks_cached"] == 4 and c2["blocks_read"] - c["blocks_read"] == 2, c2


@pytest.mark.parametrize("ptp,dtp,block_size,dtype", [(2, 2, 64, "bf16"), (2, 1, 16, "bf16"), (1, 2, 32, "bf16"), (2, 1, 32, "fp8")])
def test_tensor_parallel_mixes(tmp_path, ptp, dtp, block_size, dtype):
    """TP ranks through ATOM's KVOutputAggregator; heads split between sizes (kvlink's head
    slices), scheduler blocks of several physical blocks (block_ratio 4 and 2); an fp8 cache
    with its fp32 scale planes."""
    with pair(tmp_path, ptp=ptp, dtp=dtp, block_size=block_size, dtype=dtype) as (P, D):
        for i, n in enumerate((100, 200)):
            p = prompt(10 + i, n)
            r = decode(D, f"r{i}", p, prefill(P, f"r{i}", p))
            assert r["tokens"] == kvmodel.expected(p, 6), r
        settle(P, D)


def test_prefill_data_parallel_ranks(tmp_path):
    """A prefill of two DP ranks (two ATOM engine cores): each request is read from the ports
    of the DP rank that computed it (ATOM's side-channel port layout)."""
    with pair(tmp_path, penv={"KVLINK_ATOM_DP": "2"}) as (P, D):
        for rank in (1, 0):
            p = prompt(70 + rank, 40)
            P.add(f"r{rank}", p, 1, {"do_remote_decode": True}, dp_rank=rank)
            params = P.result(f"r{rank}")["params"]
            assert params["dp_rank"] == rank and params["remote_dp_size"] == 2, params
            params.update(remote_tp_size=1, remote_dp_rank=rank)
            assert decode(D, f"r{rank}", p, params)["tokens"] == kvmodel.expected(p, 6)
        settle(P, D)


def test_mla_latents_from_a_larger_prefill(tmp_path):
    with pair(tmp_path, model=DEEPSEEK, ptp=2, dtp=1) as (P, D):
        p = prompt(20, 90)
        r = decode(D, "m", p, prefill(P, "m", p))
        assert r["tokens"] == kvmodel.expected(p, 6), r
        settle(P, D)


@pytest.mark.parametrize("ptp,dtp", [(1, 1), (2, 1), (1, 2)])
def test_deepseek_v4_pages_and_per_request_state(tmp_path, ptp, dtp):
    """DeepSeek-V4 Flash (dsv4): ATOM's own DeepSeek-V4 builder sizes and allocates its
    memory, 256-token PAGE blocks (the compressed latents and the C4 indexer) and a STATE slot
    per request (its compressors' state and sliding window, a full SLOT region numbered from
    its end). kvlink reads a request's blocks and its slot (block group 1) into the decode's
    own blocks and slot; every decode step checks every PAGE byte and that the slot holds the
    state of every token before it, so tokens equal only when both arrived. Latents and state
    are whole on every rank (read from one rank, or shared out over two)."""
    with pair(tmp_path, model=DEEPSEEK_V4, ptp=ptp, dtp=dtp, block_size=256) as (P, D):
        for i, n in enumerate((300, 40, 600)):
            p = prompt(40 + i, n)
            r = decode(D, f"v{i}", p, prefill(P, f"v{i}", p))
            assert r["tokens"] == kvmodel.expected(p, 6), r
        settle(P, D)


@pytest.mark.parametrize("model,tp", [(QWEN3_NEXT, 1), (QWEN3_NEXT, 2), (KIMI_LINEAR, 1), (KIMI_LINEAR, 2)],
                         ids=["qwen3-next-1", "qwen3-next-2", "kimi-linear-1", "kimi-linear-2"])
def test_gated_delta_net_state_moves_with_the_attention_kv(tmp_path, model, tp):
    """Qwen3-Coder-Next (three gated delta net layers to one of full attention) and
    Kimi-Linear (three KDA layers to one of MLA), through ATOM's own builders for them (GDN's;
    Kimi's MLA and GDN one): the full-attention layers' paged KV (Kimi's: MLA latents) and each
    linear-attention layer's conv and temporal state in a STATE slot per request, which the
    builder hands the connector as the layers' state views (``gdn``). kvlink reads the
    request's KV blocks and its slot of every state view into the decode's blocks and slot;
    every decode step checks every KV element and that the slot holds the state of every
    token before it."""
    with pair(tmp_path, model=model, ptp=tp, dtp=tp) as (P, D):
        for i, n in enumerate((100, 17)):
            p = prompt(60 + i, n)
            r = decode(D, f"g{i}", p, prefill(P, f"g{i}", p))
            assert r["tokens"] == kvmodel.expected(p, 6), r
        settle(P, D)


def test_gated_delta_net_state_between_tp_sizes_is_computed_locally(tmp_path):
    """The state is not cut between TP sizes: a decode of TP 2 refuses the TP 1 prefill's
    layout (its blocks and slots are of other sizes) and computes the request itself, with
    the same tokens."""
    with pair(tmp_path, model=QWEN3_NEXT, ptp=1, dtp=2) as (P, D):
        p = prompt(70, 40)
        r = decode(D, "g", p, prefill(P, "g", p))
        assert r["tokens"] == kvmodel.expected(p, 6), r
        settle(P, D, fallbacks=1)


def test_failed_read_falls_back_to_a_local_prefill(tmp_path):
    """A read the prefill refuses (a hold token that is not its own) fails; ATOM's decode
    computes the prompt itself instead of crashing on the parked request's blocks."""
    with pair(tmp_path, penv={"KVLINK_ATOM_KV_CONFIG": json.dumps({"kvlink_abort_timeout": 4.0})}) as (P, D):
        p = prompt(30, 50)
        params = prefill(P, "f", p)
        params["kvlink_hold"] ^= 2
        r = decode(D, "f", p, params)
        assert r["tokens"] == kvmodel.expected(p, 6), r
        # The decode keeps serving transfers afterwards.
        q = prompt(31, 40)
        assert decode(D, "ok", q, prefill(P, "ok", q))["tokens"] == kvmodel.expected(q, 6)
        settle(P, D, fallbacks=1)


class TestOneDefaultPair:
    """Tests on one pair of default engines (one engine start-up, about 20 s of two cores,
    for both); the dead prefill's test kills the prefill, so it comes last."""

    @pytest.fixture(scope="class")
    def engines(self, tmp_path_factory):
        with pair(tmp_path_factory.mktemp("default-pair")) as engines:
            yield engines

    def test_parameters_not_from_kvlink_are_refused_and_the_prefill_told(self, engines):
        """Parameters without kvlink's hold (another connector's prefill): computed locally,
        and the prefill frees its blocks at once (told by the decode) rather than at its abort
        timeout. A request sent to the prefill without ``do_remote_decode`` is never held, and
        ATOM (which parks every request a producer finishes) frees it too."""
        P, D = engines
        plain = prompt(41, 20)
        P.add("plain", plain, 3)
        r = P.result("plain")
        assert r["tokens"] == kvmodel.expected(plain, 3) and r["params"] is None, r
        p = prompt(40, 45)
        params = prefill(P, "x", p)
        del params["kvlink_hold"]
        r = decode(D, "x", p, params)
        assert r["tokens"] == kvmodel.expected(p, 6), r
        _, d = settle(P, D)
        assert counters(d)["refused"] == 1 and counters(d)["reads"] == 0, counters(d)

    def test_dead_prefill(self, engines):
        P, D = engines
        p = prompt(50, 60)
        params = prefill(P, "d", p)
        P.kill()
        t = time.monotonic()
        r = decode(D, "d", p, params)
        assert r["tokens"] == kvmodel.expected(p, 6), r
        assert time.monotonic() - t < 30
        # The test before it on this pair ends with no fallback (its settle checks so).
        settle(D, fallbacks=1)


def test_aborts_on_both_sides(tmp_path):
    """A decode request aborted while its read waits on a peer that never answers: the read is
    cancelled and its blocks freed (ATOM frees none of a parked request's). A prefill request
    aborted mid-forward: its blocks are freed without waiting for a reader."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    with pair(tmp_path, penv={"KVLINK_ATOM_STEP_DELAY": "2"}) as (P, D):
        p = prompt(60, 64)
        params = {
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_handshake_port": silent.getsockname()[1],
            "remote_block_ids": [0, 1, 2, 3],
            "transfer_id": 7,
            "tp_size": 1,
            "kvlink_hold": 12345,
        }
        D.add("a", p, 6, params)
        time.sleep(0.5)
        D.abort("a")
        assert D.result("a")["reason"] == "aborted"
        P.add("b", p, 8, {"do_remote_decode": True})
        time.sleep(0.5)
        P.abort("b")
        r = P.result("b")
        assert r["reason"] == "aborted" and r["params"] is None, r
        _, d = settle(P, D)
        assert counters(d)["aborted_reads"] == 1, counters(d)
    silent.close()
