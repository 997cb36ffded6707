"""kvlink's SGLang backend driven by SGLang's own queues and state machine (SGLang 0.5.23 from
PyPI, installed by tools/test.sh): prefill and decode sides in processes of their own (one per
rank), each with SGLang's real scheduler queues, KV pool (sized by SGLang's ModelConfig from a
real model's config.json) and metadata buffers on CPU, the backend loaded by SGLang's plugin
loader from kvlink's entry point. Every byte each decode rank receives is checked, and the first
output token travels in SGLang's aux (metadata) row."""

from __future__ import annotations

import random
import time

import pytest

from harness import PEER_GONE, assert_all_arrived, mixed_requests, run_pair


def test_chunked_prefill_every_byte_and_the_aux_row_arrive():
    rng = random.Random(16)
    reqs = []
    for i in range(16):
        # Page edges first, then random lengths: most are prefilled in several chunks.
        n = [1, 15, 16, 17][i] if i < 4 else rng.randint(2, 600)
        reqs.append({"rid": f"r{i}", "room": 1000 + rng.randint(0, 1 << 40) * 8 + i, "n": n,
                     "chunk": 16 * rng.randint(1, 8)})
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs)
    chunked = 0
    for r in reqs:
        d = d_ends[r["rid"]]
        assert d["end"] == "ok", d
        assert d["bytes_ok"], d
        assert d["first_token_ok"], f"the aux row did not carry the first token: {d}"
        assert p_ends[r["rid"]]["end"] == "ok", p_ends[r["rid"]]
        chunked += r["n"] > r["chunk"]
    assert chunked >= 5, "the plan must chunk several prefills"
    # Nothing held or read any more; the decode's pages all came back.
    assert p_sum["held"] == 0 and p_sum["senders"] == 0, p_sum
    assert d_sum["receiving"] == 0 and d_sum["receivers"] == 0 and d_sum["free_pages_back"], d_sum
    assert p_sum["bad_messages"] == d_sum["bad_messages"] == 0
    # One want per request, one chunk message per chunk; every hold confirmed.
    assert p_sum["stats"]["messages_received"] == len(reqs)
    assert d_sum["stats"]["messages_received"] == p_sum["stats"]["messages_sent"] >= len(reqs) + chunked
    assert p_sum["stats"]["sends_failed"] == d_sum["stats"]["reads_failed"] == 0
    assert d_sum["stats"]["reads_done"] == p_sum["stats"]["sends_done"]


@pytest.mark.parametrize("prefill,decode", [({"tp": 1}, {"tp": 2}), ({"tp": 2}, {"tp": 1}), ({"tp": 2}, {"tp": 2})],
                         ids=["tp1-to-tp2", "tp2-to-tp1", "tp2-to-tp2"])
def test_attention_tp_sizes_pair_by_head(prefill, decode):
    """Llama 3.1 8B's 8 KV heads: a decode rank of TP 2 reads its 4 heads of the one prefill
    rank's 8; a decode rank of TP 1 reads 4 heads from each of two prefill ranks, side by side
    in its pages. Each decode rank checks every byte of its own heads, and the first token
    (the aux row) arrives on every rank."""
    reqs = mixed_requests(7, 8)
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs, prefill=prefill, decode=decode)
    assert_all_arrived(reqs, p_ends, p_sum, d_ends, d_sum)
    # Every prefill rank's hold was confirmed by each decode rank that read it.
    assert d_sum["stats"]["reads_done"] * max(1, prefill["tp"] // decode["tp"]) == p_sum["stats"]["sends_done"]


@pytest.mark.parametrize("prefill,decode", [({"tp": 1}, {"tp": 2}), ({"tp": 2}, {"tp": 1})],
                         ids=["tp1-to-tp2", "tp2-to-tp1"])
def test_mla_latents_move_whole_between_attention_tp_sizes(prefill, decode):
    """DeepSeek-V2-Lite's MLA pool (SGLang's MLATokenToKVPool, a 576-wide latent per token, whole
    on every rank): each decode rank of TP 2 reads the one prefill rank's pages; a decode rank
    of TP 1 reads its pages shared out between the two prefill ranks, which both hold them."""
    reqs = mixed_requests(13, 6)
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs, prefill=prefill, decode=decode, model="deepseek-v2-lite")
    assert_all_arrived(reqs, p_ends, p_sum, d_ends, d_sum)


@pytest.mark.parametrize("prefill,decode", [({"tp": 1}, {"tp": 1}), ({"tp": 1}, {"tp": 2}), ({"tp": 2}, {"tp": 1})],
                         ids=["1to1", "1to2", "2to1"])
def test_a_hybrid_sliding_window_model_moves_its_window_as_sglangs_swa_state(prefill, decode):
    """gpt-oss (sliding-window layers of 128 tokens alternating with full-attention ones): SGLang's
    SWAKVPool and SWA allocator on both sides; the full layers' pages move as KV, the window's
    pages of the sliding-window layers as SGLang's SWA state, each in its own index space. The
    decode checks every full layer whole and every sliding-window layer over the window, head
    by head: between attention TP sizes each decode rank reads its heads of the SWA pages as of
    the KV pages (from the one prefill rank that holds them, or gathered from two)."""
    reqs = mixed_requests(17, 6) + [{"rid": "long", "room": 9001, "n": 700, "chunk": 64}]
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs, prefill=prefill, decode=decode, model="gpt-oss-20b")
    assert_all_arrived(reqs, p_ends, p_sum, d_ends, d_sum)


@pytest.mark.parametrize("prefill,decode", [({"tp": 1}, {"tp": 1}), ({"tp": 1}, {"tp": 2}), ({"tp": 2}, {"tp": 1})],
                         ids=["1to1", "1to2", "2to1"])
def test_deepseek_v4_pools_move_every_region_and_state(prefill, decode):
    """DeepSeek-V4 Flash (compressed MLA per 128 and per 4 tokens, the C4 indexer's keys, 128-token
    sliding-window caches, the compressors' states and the request-scoped C128 state): the
    pools SGLang's own configurator sizes and builds for the model, on both sides (dsv4_side).
    Every region SGLang describes to the backend (the KV pages of each compressed pool, the SWA
    state's window pages and compressor states, the C128 state's request rows) moves at the
    rows SGLang names: every byte of each is checked on each decode rank. A request longer
    than a chunk is sent chunk by chunk (256-token pages)."""
    rng = random.Random(23)
    reqs = [{"rid": f"r{i}", "room": 3000 + rng.randint(0, 1 << 30) * 4 + i, "n": n, "chunk": 256}
            for i, n in enumerate([1, 255, 256, 257, 700, rng.randint(2, 900)])]
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs, prefill=prefill, decode=decode, model="deepseek-v4-flash")
    assert_all_arrived(reqs, p_ends, p_sum, d_ends, d_sum)


@pytest.mark.parametrize("prefill,decode", [({"tp": 1}, {"tp": 1}), ({"tp": 1}, {"tp": 2}), ({"tp": 2}, {"tp": 1})],
                         ids=["1to1", "1to2", "2to1"])
def test_a_gated_delta_net_hybrid_moves_its_state_slice_by_slice(prefill, decode):
    """Qwen3-Coder-Next (gated delta net layers among attention layers): SGLang's
    HybridReqToTokenPool and MambaPool on both sides, a KV pool of the attention layer only.
    Each request's conv and temporal state moves as SGLang's mamba state; between attention TP
    sizes each decode rank reads its slice of every state tensor by SGLang's own description
    of it (the conv state's query, key and value sub-blocks each sharded on its own, the
    temporal state by heads), gathered from two prefill ranks or taken from one. The decode
    checks every channel of every state tensor by its global number, and the attention KV."""
    reqs = mixed_requests(19, 5)
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs, prefill=prefill, decode=decode, model="qwen3-coder-next")
    assert_all_arrived(reqs, p_ends, p_sum, d_ends, d_sum)


@pytest.mark.parametrize("prefill,decode", [({"tp": 1}, {"tp": 1}), ({"tp": 1}, {"tp": 2}), ({"tp": 2}, {"tp": 1})],
                         ids=["1to1", "1to2", "2to1"])
def test_a_mamba2_hybrid_moves_its_state_slice_by_slice(prefill, decode):
    """Nemotron-H (Mamba-2 layers, 8 B/C groups): SGLang describes no sub-blocks of its conv
    state, which is x, B and C, each sharded on its own (one slice across them would mix
    them); kvlink takes them from SGLang's cache parameters of the model, and the stand-in
    labels each channel by the sub-blocks SGLang's own Mamba-2 mixer makes its conv of. Between
    attention TP sizes each decode rank reads its x, B and C channels and its heads of the
    temporal state, gathered from two prefill ranks or taken from one; every channel of every
    state tensor is checked by its global number, and the attention KV."""
    reqs = mixed_requests(23, 4)
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs, prefill=prefill, decode=decode, model="nemotron-h-8b")
    assert_all_arrived(reqs, p_ends, p_sum, d_ends, d_sum)


def test_a_mamba2_hybrid_with_one_group_moves_its_state_between_equal_tp_sizes_only():
    """Granite 4.0-H (Mamba-2 layers with one B/C group): at TP 2 SGLang replicates the group on
    both ranks, so a rank's conv channels are not a slice of x, B and C. Between equal attention
    TP sizes the state moves whole and is checked; a decode of another TP size refuses each room
    with the reason rather than read a mixed slice (a decode of one rank, so that each room's end
    is its own reason, not SGLang's "failed on another TP rank")."""
    reqs = mixed_requests(31, 3)
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs, model="granite-4.0-h-tiny")
    assert_all_arrived(reqs, p_ends, p_sum, d_ends, d_sum)
    reqs = mixed_requests(37, 2)
    _, _, d_ends, _, _ = run_pair(reqs, prefill={"tp": 2}, model="granite-4.0-h-tiny", deadline=8)
    for r in reqs:
        # The decode (one rank) could split its state; the prefill (two) cannot, and says so.
        assert "mamba state on the prefill: kvlink reads SGLang's mamba state whole" in d_ends[r["rid"]]["end"], d_ends
        assert "describes no sub-blocks of this model's conv state" in d_ends[r["rid"]]["end"], d_ends


@pytest.mark.parametrize("decode", [{"tp": 2, "dp": 2}, {"tp": 1}], ids=["to-dp2", "to-tp1"])
def test_dp_attention_routes_each_room_to_its_prefill_dp_rank(decode):
    """A prefill of two DP attention ranks (attention TP 1 each), rooms routed by bootstrap
    room as SGLang's router does (room % 2): each decode rank finds a room's prefill through
    the bootstrap server's DP group of it, whichever decode DP rank took it."""
    reqs = mixed_requests(11, 8)
    assert {r["room"] % 2 for r in reqs} == {0, 1}
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs, prefill={"tp": 2, "dp": 2}, decode=decode)
    assert_all_arrived(reqs, p_ends, p_sum, d_ends, d_sum)


def test_aborts_on_either_side_end_both_sides_with_the_reason():
    reqs = [
        {"rid": "ok1", "room": 501, "n": 100, "chunk": 32},
        {"rid": "prefill-abort", "room": 502, "n": 64, "abort_in_bootstrap": True},
        {"rid": "decode-abort", "room": 503, "n": 800, "chunk": 16, "abort_after_first_chunk": True},
        {"rid": "ok2", "room": 504, "n": 33, "chunk": 16},
        {"rid": "prefill-abort-told", "room": 505, "n": 400, "chunk": 16, "abort_after_first_chunk_sent": True},
        {"rid": "prefill-abort-early", "room": 506, "n": 40, "abort_before_want": True, "decode_delay": 1.0},
    ]
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs)
    for rid in ("ok1", "ok2"):
        assert d_ends[rid]["end"] == "ok" and d_ends[rid]["bytes_ok"], d_ends[rid]
    # The prefill aborted in its bootstrap queue: the decode fails it, saying so.
    assert "Abort" in p_ends["prefill-abort"]["end"], p_ends["prefill-abort"]
    assert "prefill aborted" in d_ends["prefill-abort"]["end"], d_ends["prefill-abort"]
    # The decode aborted mid-transfer: its reads stop, the prefill fails the room and frees it.
    assert "Abort" in d_ends["decode-abort"]["end"], d_ends["decode-abort"]
    # (Told by the decode's abort message, or first by its engine's cancel of the read.)
    end = p_ends["decode-abort"]["end"]
    assert "decode aborted" in end or "the reading peer aborted" in end, end
    # The prefill aborted after the decode was told of a chunk (its read maybe in flight): the
    # holds end, the decode never reports the room received, and says why: the abort's
    # message, a read the prefill did not confirm, or, when the next chunk's read reaches the
    # prefill after its hold ended and before the abort message reaches the decode, the read
    # refused because the prefill no longer holds the request.
    assert "Abort" in p_ends["prefill-abort-told"]["end"], p_ends["prefill-abort-told"]
    end = d_ends["prefill-abort-told"]["end"]
    assert end != "ok" and ("prefill aborted" in end or "unconfirmed" in end or "is not held for this reader" in end), end
    # The prefill aborted before the decode asked: the decode's want is answered with the abort.
    assert "prefill aborted" in d_ends["prefill-abort-early"]["end"], d_ends["prefill-abort-early"]
    assert p_sum["held"] == 0 and p_sum["senders"] == 0, p_sum
    assert d_sum["receiving"] == 0 and d_sum["free_pages_back"], d_sum


def test_a_stale_read_fails_the_room_and_is_never_decoded_from():
    """The prefill's hold of a chunk ends and the chunk's id is held again (a new hold, a new
    token) before the decode reads it: the read names the old hold's token, so although its
    bytes arrive, the prefill refuses its confirmation; the decode fails the room (SGLang's
    answer to a failed transfer), tells the prefill, and gives its pages back. The other room
    is untouched."""
    reqs = [
        {"rid": "stale", "room": 611, "n": 96, "chunk": 32, "rehold_after_first_chunk": True},
        {"rid": "fine", "room": 612, "n": 40, "chunk": 16},
    ]
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs)
    assert d_ends["fine"]["end"] == "ok" and d_ends["fine"]["bytes_ok"], d_ends["fine"]
    end = d_ends["stale"]["end"]
    assert end != "ok" and "unconfirmed" in end and "another hold" in end, end
    assert p_ends["stale"]["end"] != "ok", p_ends["stale"]
    assert p_sum["held"] == 0 and p_sum["senders"] == 0, p_sum
    assert d_sum["receiving"] == 0 and d_sum["free_pages_back"], d_sum


def test_a_retracted_request_goes_back_to_its_prefill_and_is_read_again():
    """SGLang's decode retracts a request (``add(req, is_rebootstrap=True)``): its new receiver
    asks the prefill again and ``submit_prefill_recompute`` posts SGLang's ``/generate`` body to
    the prefill's HTTP port (registered with the bootstrap server), which computes the prompt
    again and sends its KV; every byte checked. A prefill that refuses the post fails the room
    at once, not at the waiting timeout."""
    reqs = [
        {"rid": "retracted", "room": 621, "n": 80, "chunk": 32, "rebootstrap": True},
        {"rid": "refused", "room": 622, "n": 40, "chunk": 16, "rebootstrap": True, "recompute_fails": True},
        {"rid": "plain", "room": 623, "n": 33, "chunk": 16},
    ]
    start = time.monotonic()
    p_ends, p_sum, d_ends, d_sum, _ = run_pair(reqs, decode_env={"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60"})
    for rid in ("retracted", "plain"):
        assert d_ends[rid]["end"] == "ok" and d_ends[rid]["bytes_ok"], d_ends[rid]
        assert d_ends[rid]["first_token_ok"], d_ends[rid]
    assert "/generate answered 500" in d_ends["refused"]["end"], d_ends["refused"]
    assert time.monotonic() - start < 40, "failed at once, not at the 60 s waiting timeout"
    assert p_sum["generate_posts"] == 2, p_sum
    assert p_sum["held"] == 0 and p_sum["senders"] == 0, p_sum
    assert d_sum["receiving"] == 0 and d_sum["free_pages_back"], d_sum


def test_a_dead_prefill_fails_the_decode_within_seconds():
    """The prefill dies (SIGKILL-like exit) after its first chunk, long before SGLang's
    300-second waiting timeout the decode's room fails, and its pages go back. Two ends are
    right, and which one comes depends on where the death falls against the first chunk's
    message: a message that left before the exit starts a read the dead prefill cannot serve
    (the read fails at once, its retry's handshake refused); otherwise nothing is in flight
    and the room fails once the prefill has been unreachable for KVLINK_PEER_TIMEOUT (2 s
    here)."""
    reqs = [{"rid": "orphan", "room": 777, "n": 300, "chunk": 32, "die_after_first_chunk": True}]
    start = time.monotonic()
    p_ends, _, d_ends, d_sum, code = run_pair(reqs, decode_env=PEER_GONE, deadline=40)
    assert code == 3, "the prefill was to die after its first chunk"
    end = d_ends["orphan"]["end"]
    unreachable = "prefill engine at" in end and "unreachable" in end
    read_lost = "kvlink transfer of room 777 failed" in end and "lost" in end
    assert unreachable or read_lost, end
    assert time.monotonic() - start < 60
    assert d_sum["receiving"] == 0 and d_sum["free_pages_back"], d_sum


def test_a_dead_decode_fails_the_prefill_within_seconds():
    """The decode dies once it read the first chunk of a long prefill: the prefill's session
    with it ends, its room fails after KVLINK_PEER_TIMEOUT and its holds end, instead of
    waiting out the abort timeout (480 s) or the lease; the other room is untouched until
    then and ends too (its decode is the same dead one)."""
    reqs = [{"rid": "widowed", "room": 778, "n": 400, "chunk": 16, "decode_dies_after_first_chunk": True}]
    start = time.monotonic()
    p_ends, p_sum, d_ends, _, _ = run_pair(reqs, prefill_env=PEER_GONE, deadline=40, decode_dies=True)
    end = p_ends["widowed"]["end"]
    assert "decode engine at" in end and "unreachable" in end, end
    assert time.monotonic() - start < 60
    assert p_sum["held"] == 0 and p_sum["senders"] == 0, p_sum
