"""A hybrid linear-attention model's memory on one SGLang rank, as SGLang builds it: its
``HybridReqToTokenPool`` (prefill) or ``HybridMambaDecodeReqToTokenPool`` (decode) with the
``MambaPool`` of the model's own cache parameters (``mambaish_config`` of SGLang's
``ModelConfig``, at this rank's attention TP size), and the ``HybridLinearKVPool`` of its
full-attention layers over that pool. The stand-in forward writes each state slot's channels as
a function of (room, layer, state tensor, global channel over the TP group, position in the
channel), the global channel from SGLang's own description of how TP shards the tensor (its
conv sub-blocks, ``conv_shard_groups``, or for a Mamba-2 conv, which it does not describe, the
sub-blocks its own mixer makes its conv of: ``conv_blocks``), so a decode of any TP size checks
its slice channel by channel."""

from __future__ import annotations

from typing import Any, List

import torch

POOL_SLOTS = 64


def cache_params(config) -> Any:
    """SGLang's cache parameters of the model's linear-attention state, or None (no such state)."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    found = mambaish_config(config)
    return None if found is None else found.mamba2_cache_params


def conv_blocks(config) -> Any:
    """Where SGLang describes no sub-blocks of the conv state (a Mamba-2 model's), those its own
    ``MambaMixer2`` makes its conv of: the output sizes of the mixer's ``conv1d`` (x, B and C,
    each sharded on its own over the ranks), the mixer built on the meta device with the
    arguments SGLang's Nemotron-H or Granite 4.0-H layer gives it. None where SGLang describes them (a gated delta
    net's) or the conv is one block (groups replicated over the ranks)."""
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.layers.attention.mamba.mamba import MambaMixer2

    found = mambaish_config(config)
    if found is None or getattr(found.mamba2_cache_params.shape, "conv_shard_groups", None):
        return None
    # The configuration fields each of SGLang's Mamba-2 layers passes its mixer.
    names = {"nemotron_h": ("use_conv_bias", "use_bias", "layer_norm_epsilon", "mamba_hidden_act"),
             "granitemoehybrid": ("mamba_conv_bias", "mamba_proj_bias", "rms_norm_eps", "hidden_act")}
    conv_bias, bias, eps, act = (getattr(found, n) for n in names[found.model_type])
    with torch.device("meta"):
        mixer = MambaMixer2(cache_params=found.mamba2_cache_params, hidden_size=found.hidden_size,
                            use_conv_bias=conv_bias, use_bias=bias, n_groups=found.mamba_n_groups, rms_norm_eps=eps,
                            activation=act, reduce_results=False, prefix="conv-blocks")
    sizes = getattr(mixer.conv1d, "output_sizes", None)
    return list(sizes) if sizes and len(sizes) > 1 else None


def req_pool(shape, role: str):
    """The rank's request pool with its mamba state pool, as SGLang's prefill or decode makes it."""
    kw = dict(size=32, max_context_len=1024, device="cpu", enable_memory_saver=False, cache_params=shape.mamba,
              mamba_layer_ids=list(shape.mamba.layers), enable_mamba_extra_buffer=False,
              enable_overlap_schedule=False)
    if role == "decode":
        from sglang.srt.disaggregation.decode import HybridMambaDecodeReqToTokenPool

        return HybridMambaDecodeReqToTokenPool(speculative_num_draft_tokens=None, pre_alloc_size=32,
                                               mamba_size=POOL_SLOTS, **kw)
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    return HybridReqToTokenPool(mamba_size=POOL_SLOTS, mamba_spec_state_size=32, **kw)


def kv_pool(shape, r2t, tokens: int, page: int):
    """The KV pool of the full-attention layers beside the request pool's state, and its
    allocator."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    pool = HybridLinearKVPool(size=tokens, dtype=torch.float16, page_size=page, head_num=shape.heads,
                              head_dim=shape.head_dim, full_attention_layer_ids=shape.attn_layers, device="cpu",
                              mamba_pool=r2t.mamba_pool)
    return pool, PagedTokenToKVPoolAllocator(tokens, page, torch.float16, "cpu", pool, need_sort=False)


def _global_channels(shape, field: str, dim: int) -> torch.Tensor:
    """The global numbers (over the attention-TP group) of this rank's ``dim`` channels of a
    state tensor: a conv state's sub-blocks each sharded on its own when SGLang says so."""
    groups = (getattr(shape.mamba.shape, "conv_shard_groups", None) or shape.conv_blocks) if field == "conv" else None
    if not groups:
        return torch.arange(shape.rank * dim, (shape.rank + 1) * dim)
    out, full = [], 0
    for g in groups:
        local = g // shape.tp
        out.append(torch.arange(full + shape.rank * local, full + (shape.rank + 1) * local))
        full += g
    return torch.cat(out)


def _expected(shape, room: int, n: int, entry: int, field: str, slot_shape, axis: int, dtype) -> torch.Tensor:
    """A slot's content: a function of the room, its prompt length, the entry, each value's
    global channel and its place in the channel (small integers, exact in bf16)."""
    dim = slot_shape[axis]
    channels = _global_channels(shape, field, dim)
    rest = torch.arange(int(torch.tensor(slot_shape).prod()) // dim).reshape(
        [s for i, s in enumerate(slot_shape) if i != axis])
    ch = channels.reshape([-1] + [1] * rest.dim())
    value = ((room % 97) * 3 + n * 7 + entry * 5 + ch * 11 + rest.unsqueeze(0) * 13) % 251
    return value.movedim(0, axis).to(dtype)


def _entries(r2t):
    """SGLang's own list of the state tensors it transfers, one per layer and kind."""
    return list(r2t.mamba_pool._iter_transfer_state_entries())


def _slot(r2t, req) -> int:
    return int(r2t.req_index_to_mamba_index_mapping[req.kv.req_pool_idx])


def write_state(r2t, shape, room: int, n: int, req) -> None:
    """The stand-in forward's state after the prompt: every state tensor of the request's slot."""
    slot = _slot(r2t, req)
    for i, (field, tensor, axis, _) in enumerate(_entries(r2t)):
        axis = 0 if axis is None else axis
        tensor[slot] = _expected(shape, room, n, i, field, tuple(tensor.shape[1:]), axis, tensor.dtype)


def wrong_state(r2t, shape, room: int, n: int, req) -> List[str]:
    """The state tensors of the request's slot that are not what the prefill computed."""
    slot, bad = _slot(r2t, req), []
    for i, (field, tensor, axis, layer) in enumerate(_entries(r2t)):
        axis = 0 if axis is None else axis
        want = _expected(shape, room, n, i, field, tuple(tensor.shape[1:]), axis, tensor.dtype)
        if not torch.equal(tensor[slot], want):
            bad.append(f"{field} state of layer {layer}")
    return bad
