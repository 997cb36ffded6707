"""kvlink's vLLM connector on the KV cache memory vLLM allocates, in two engine processes
(``harness``): every layout vLLM allocates, the model kinds (dense GQA, MLA, sliding-window
hybrid, cross-layer KV sharing, a Mamba hybrid's state), prefill and decode of other TP
sizes, kernel block splitting and different block sizes, every byte checked. Run by
tools/test.sh in a venv with vLLM."""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import (  # noqa: E402
    BLOCKS,
    DEEPSEEK,
    DEEPSEEK_V4,
    DEEPSEEK_V41,
    GEMMA_3N,
    GPT_OSS,
    GRANITE_H,
    JAMBA,
    LLAMA,
    LLAMA_4,
    MINIMAX_M3,
    NEMOTRON_H,
    QWEN3_5,
    QWEN3_NEXT,
    Proc,
    assert_no_leak,
    close,
    pair_of,
    prefix_hit,
    read_one,
    run_prefill,
    step_until,
    transfer,
)

# Nemotron-H's state pages are 4 MB a layer (128 heads of 64 x 128 float32), Qwen3.5's 2 MB
# (32 value heads of 128 x 128), Jamba's seven Mamba-1 layers 0.6 MB each: fewer blocks of them.
BLOCKS_OF = {NEMOTRON_H: 48, QWEN3_5: 96, JAMBA: 120}


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
    prefill, decode = pair_of(
        "prefer", dict(supported=["LHBNC", "LBHNC"]), dict(model=DEEPSEEK, supported=["BLNHC", "LBNHC"])
    )
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


@pytest.mark.parametrize(
    "model, prefix_caching, conv",
    [
        (GRANITE_H, True, None),
        (GRANITE_H, False, "DS"),
        (QWEN3_NEXT, True, None),
        (QWEN3_5, True, None),
        (NEMOTRON_H, True, "DS"),
        (JAMBA, True, None),
    ],
    ids=["granite-align", "granite-none-DS", "qwen3-next-align", "qwen3.5-align", "nemotron-h-align-DS", "jamba-align"],
)
def test_mamba_hybrid_state_and_attention_arrive_whole(model, prefix_caching, conv):
    """Granite 4.0-H (Mamba-2 and attention layers) and Qwen3-Coder-Next (gated delta net
    and attention layers): vLLM gives the state a KV cache group of its own (``MambaSpec``,
    a page per state block holding each layer's conv and SSM state).
    The prefill stops one token short of the prompt, so that the state it holds is the one
    before the token the decode computes; the decode reads each layer's running-state block
    beside the attention blocks, and both are byte-exact (a state of another length of the
    prompt, layer or rank does not match). Both of vLLM's mamba cache modes: "align" (prefix
    caching: the running state in the block of its position) and "none" (one state block per
    request, spanning the model's length). Both conv state layouts (``VLLM_SSM_CONV_STATE_LAYOUT``
    SD, vLLM's default, and DS, where each TP-sharded piece is read as a tensor of its own)."""
    opts = dict(model=model, prefix_caching=prefix_caching, conv_layout=conv, blocks=BLOCKS_OF.get(model, BLOCKS))
    prefill, decode = pair_of(f"state-{model}-{int(prefix_caching)}-{conv}", opts, opts)
    try:
        s = transfer(prefill, decode, 4, seed=23)
        assert s["engine_stats"]["reads_done"] == 4, s["engine_stats"]
        # 97 tokens, 96 computed by the prefill: its state ends a block, and in the "align"
        # mode the decode's next block (for token 97) is not where vLLM looks for it.
        s = transfer(prefill, decode, 1, seed=24, lengths=(97, 98))
        assert s["engine_stats"]["reads_done"] == 5, s["engine_stats"]
    finally:
        close(prefill, decode)


@pytest.mark.parametrize(
    "model, prefill_tp, decode_tp",
    [(GRANITE_H, 1, 2), (GRANITE_H, 2, 1), (QWEN3_NEXT, 1, 2), (QWEN3_NEXT, 2, 1), (QWEN3_5, 1, 2), (QWEN3_5, 2, 1),
     (NEMOTRON_H, 1, 2), (NEMOTRON_H, 2, 1), (JAMBA, 1, 2), (JAMBA, 2, 1)],
    ids=["granite-1to2", "granite-2to1", "qwen3-next-1to2", "qwen3-next-2to1", "qwen3.5-1to2", "qwen3.5-2to1",
         "nemotron-h-1to2", "nemotron-h-2to1", "jamba-1to2", "jamba-2to1"],
)
def test_mamba_state_between_tp_sizes_is_read_by_slice(model, prefill_tp, decode_tp):
    """A prefill and a decode of different TP sizes, conv state in vLLM's DS layout: each
    decode rank reads its slice of every TP-sharded piece of every state layer (the conv
    state's sub-projections as vLLM's ``derive_mamba_conv_split`` sizes them: Mamba-2's x, B
    and C, with one B/C group that vLLM replicates on every rank in Granite 4.0-H; a gated
    delta net's Q, K and V; then the temporal state by heads), beside the attention heads.
    Each channel of each piece is checked against the prefill's by its number over the TP
    group, so a slice from the wrong rank or offset fails."""
    name = f"state-tp{prefill_tp}to{decode_tp}-{model}"
    p = dict(model=model, tp=prefill_tp, conv_layout="DS", blocks=BLOCKS_OF.get(model, BLOCKS))
    prefill, decode = pair_of(name, p, dict(p, tp=decode_tp))
    try:
        s = transfer(prefill, decode, 3, seed=prefill_tp * 10 + decode_tp, lengths=(20, 120))
        assert s["engine_stats"]["reads_done"] == 3 * decode_tp, s["engine_stats"]
    finally:
        close(prefill, decode)


def test_mamba_state_in_the_sd_layout_between_tp_sizes_is_computed_locally():
    """A decode of TP 2 given a TP 1 prefill's Granite 4.0-H request with the conv state in
    vLLM's default SD layout, where a rank's channels are interleaved with the positions:
    the decode says why (set VLLM_SSM_CONV_STATE_LAYOUT=DS), computes the prompt itself
    (reading nothing) and lets the prefill free its blocks at once."""
    prefill, decode = pair_of("mamba-tp", dict(model=GRANITE_H), dict(model=GRANITE_H, tp=2))
    try:
        prefill.wait_ready()
        decode.wait_ready()
        prompts = {"m0": list(range(10, 60)), "m1": list(range(100, 170))}
        params = run_prefill(prefill, prompts)
        for rid, prompt in prompts.items():
            decode.call("add", "d-" + rid, prompt, 2, params[rid])
        step_until([decode, prefill], lambda f: sum(x["engine"] == decode.name for x in f) == 2, what=decode.name)
        s = decode.call("state")
        assert s["bad"] == [] and s["reads"] == {} and s["engine_stats"].get("reads_done", 0) == 0, s
        assert_no_leak([prefill, decode])
    finally:
        close(prefill, decode)


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
        name,
        dict(model=model, tp=prefill_tp, layout=prefill_layout),
        dict(model=model, tp=decode_tp, layout=decode_layout),
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
    prefill, decode = pair_of(
        f"hybrid{prefill_tp}{decode_tp}", dict(model=GPT_OSS, tp=prefill_tp), dict(model=GPT_OSS, tp=decode_tp)
    )
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


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 1), (1, 2), (2, 1)])
def test_compressed_attention_with_its_compressors_and_indexer(prefill_tp, decode_tp):
    """DeepSeek-V4 Flash (compressed MLA: one latent per 128 tokens in three layers, per 4 in
    the fourth, with its indexer's keys per 4; each compressor's raw keys of the open group
    and a 128-token sliding-window MLA cache per layer), laid out as vLLM's planner packs it
    in the block-outermost layout its indexer backend declares: nine KV cache groups of four
    block sizes, several of them layers with pages of different sizes in one group. The decode
    reads every group; every stored state of every compressed layer below the tokens it loaded
    and every position each window still sees is checked, at the same and other TP sizes (the
    latents are whole on every rank); then a request sharing a prefix hits the decode's cache."""
    opts = dict(model=DEEPSEEK_V4)
    prefill, decode = pair_of(f"dsv4-{prefill_tp}{decode_tp}", dict(opts, tp=prefill_tp), dict(opts, tp=decode_tp))
    try:
        # Prompts past a 128-token group, some past a 256-token block, one ending on a group.
        s = transfer(prefill, decode, 3, seed=61, lengths=(130, 700))
        s = transfer(prefill, decode, 1, seed=62, lengths=(512, 513))
        assert s["layout"] in ("BLHNC", "BLNHC"), s["layout"]
        assert s["engine_stats"]["reads_done"] == 4 * decode_tp, s["engine_stats"]
        rng = random.Random(63)
        shared = [rng.randrange(10, 1000) for _ in range(600)]
        # A prefix hit needs every group's blocks before it, the windows' too, which a read
        # leaves out (the decode holds only the window of a prompt it read): the decode first
        # computes a prompt of the shared prefix itself; then of two read prompts of one
        # length, the one sharing that prefix reads every group's blocks after the 512 tokens
        # it has cached only (the compressed group's first two blocks are not read).
        tail = lambda: [rng.randrange(10, 1000) for _ in range(30)]  # noqa: E731
        decode.call("add", "local-v", shared + tail(), 2, None)
        step_until([decode], lambda f: any(x["id"] == "local-v" for x in f), what="local-v")
        read_one(prefill, decode, "v0", tail() + shared)
        read_one(prefill, decode, "v1", shared + tail())
        s = decode.call("state")
        assert s["bad"] == [] and {"d-v0", "d-v1"} <= set(s["verified"]), s
        assert s["reads"]["d-v1"] < s["reads"]["d-v0"], s["reads"]
        assert_no_leak([prefill, decode])
    finally:
        close(prefill, decode)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 1), (1, 2), (2, 1)])
def test_a_compressor_ring_moves_with_its_compressed_attention(prefill_tp, decode_tp):
    """DeepSeek-V4.1 (five layers: two sliding-window only, two of ratio 2, one of ratio 1, the
    second ratio-2 layer reading the first's KV): its ratio-2 compressor keeps the rows of the
    open group in a ring, one block per request (``CircularBufferSpec``), beside the compressed
    MLA and indexer blocks and a sliding-window MLA cache per layer. The prefill computes the
    prompt but its last token; the decode reads the ring after it whole (every rank holds it
    whole) with every other group, and computes that token. Every byte of the ring, every
    stored state and every window position is checked, at the same and other TP sizes."""
    opts = dict(model=DEEPSEEK_V41)
    prefill, decode = pair_of(f"dsv41-{prefill_tp}{decode_tp}", dict(opts, tp=prefill_tp), dict(opts, tp=decode_tp))
    try:
        # Prompts of both parities (an open group of one row, or none), past a window.
        s = transfer(prefill, decode, 3, seed=71, lengths=(40, 300))
        s = transfer(prefill, decode, 2, seed=72, lengths=(129, 131))
        assert s["engine_stats"]["reads_done"] == 5 * decode_tp, s["engine_stats"]
    finally:
        close(prefill, decode)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 1), (1, 2), (2, 1)])
def test_indexer_keys_beside_attention_heads(prefill_tp, decode_tp):
    """MiniMax-M3 (four layers, the fourth with sparse attention): its lightning indexer keeps
    one key per token (MLA's kind, ``MLAAttentionSpec``, the same on every rank) beside 4 KV
    heads split between ranks, in one KV cache group. The decode reads both, the heads by
    slice and the keys whole, at the same and other TP sizes; every byte is checked; then a
    request sharing a prefix hits the decode's prefix cache."""
    opts = dict(model=MINIMAX_M3)
    prefill, decode = pair_of(f"mm3-{prefill_tp}{decode_tp}", dict(opts, tp=prefill_tp), dict(opts, tp=decode_tp))
    try:
        s = transfer(prefill, decode, 3, seed=81, lengths=(20, 300))
        assert s["engine_stats"]["reads_done"] == 3 * decode_tp, s["engine_stats"]
        prefix_hit(prefill, decode, seed=82, prefix=100)
    finally:
        close(prefill, decode)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 1), (1, 2), (2, 1)])
def test_chunked_local_attention_reads_the_last_chunk(prefill_tp, decode_tp):
    """Llama 4 Scout (chunked local attention layers, three in four, beside full attention;
    its chunk cut to 64 tokens so that the prompts cross chunks): vLLM gives the chunked
    layers a KV cache group of their own (``ChunkedLocalAttentionSpec``). The prefill holds
    that group's blocks from the chunk of the prompt's last token on, the decode reads those
    and every block of the full-attention group, and each position the next token attends to
    is checked (a prompt ending on a chunk boundary included), at the same and other TP
    sizes; then a second request sharing a prefix hits the decode's prefix cache."""
    prefill, decode = pair_of(f"chunked{prefill_tp}{decode_tp}", dict(model=LLAMA_4, tp=prefill_tp), dict(model=LLAMA_4, tp=decode_tp))
    try:
        s = transfer(prefill, decode, 3, seed=41, lengths=(70, 250))
        s = transfer(prefill, decode, 1, seed=42, lengths=(128, 129))
        assert s["engine_stats"]["reads_done"] == 4 * decode_tp, s["engine_stats"]
        # The second reads only what follows the decode's cached prefix (9 blocks of 16 in the
        # full-attention group): fewer blocks than the first, though its prompt is longer.
        prefix_hit(prefill, decode, seed=43, prefix=150, names=("c0", "c1"))
    finally:
        close(prefill, decode)


@pytest.mark.parametrize(
    "prefill_bs, decode_bs, layout",
    [(16, 64, None), (64, 16, None), (16, 64, "LBNHC"), (64, 16, "BLNHC")],
)
def test_different_block_sizes_with_prefix_hits(prefill_bs, decode_bs, layout):
    """A prefill and a decode of different ``--block-size`` (vLLM RFC #26744), head-major
    (the connector's LBHNC) and token-major: the decode reads each prefill block token range by
    token range into its own blocks. Half the prompts share a prefix the decode holds after the
    first of them, so the later ones read only what follows it: with 16-token decode blocks, 48
    of a 53-token prefix are cached and the read starts at token 48 of a 64-token prefill
    block; with 64-token decode blocks, 64 of 70 are cached and it starts at the fifth 16-token
    prefill block. Every position of every request is checked."""
    opts = dict(layout=layout)
    prefill, decode = pair_of(
        f"bs{prefill_bs}to{decode_bs}-{layout}", dict(opts, block_size=prefill_bs), dict(opts, block_size=decode_bs)
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()
        rng = random.Random(prefill_bs * 7 + decode_bs)
        shared = [rng.randrange(10, 1000) for _ in range(53 if decode_bs < prefill_bs else 70)]
        prompts = {}
        for i in range(9):
            body = [rng.randrange(10, 1000) for _ in range(rng.randrange(2, 250))]
            prompts[f"bs{i}"] = (shared + body) if i % 2 == 0 else body
        ids = list(prompts)
        for wave in (ids[:1], ids[1:]):
            params = run_prefill(prefill, {r: prompts[r] for r in wave})
            for rid in wave:
                assert params[rid]["remote_block_sizes"] == [prefill_bs], params[rid]
                decode.call("add", "d-" + rid, prompts[rid], 2, params[rid])
            step_until(
                [decode, prefill], lambda f: sum(x["engine"] == decode.name for x in f) >= len(wave), what="decode"
            )
        s = decode.call("state")
        assert s["bad"] == [] and len(s["verified"]) == len(prompts), s
        # The shared prompts after the first read only what follows the decode's cached prefix.
        partial = [r for r in ids[2::2] if s["reads"]["d-" + r] < -(-len(prompts[r]) // decode_bs)]
        assert len(partial) == 4, (partial, s["reads"])
        assert_no_leak([prefill, decode])
    finally:
        close(prefill, decode)


@pytest.mark.parametrize("prefill_bs, decode_bs", [(16, 64), (64, 16)])
def test_hybrid_groups_between_block_sizes(prefill_bs, decode_bs):
    """gpt-oss's sliding-window and full groups between block sizes: the sliding window's
    first needed token falls inside a block of the larger size, and only what the window
    still sees is read, from the blocks the prefill kept."""
    prefill, decode = pair_of(
        f"hybrid-bs{prefill_bs}to{decode_bs}",
        dict(model=GPT_OSS, block_size=prefill_bs),
        dict(model=GPT_OSS, block_size=decode_bs),
    )
    try:
        transfer(prefill, decode, 4, seed=29, lengths=(150, 400))
    finally:
        close(prefill, decode)
