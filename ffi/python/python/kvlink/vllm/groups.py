"""The connector's KV cache groups: what kind of blocks each holds (``_Group``), and how a
group's blocks pair between a prefill and a decode (attention blocks by token position, a
state group's one running-state block)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks

from .layout import layer_specs, tokens_per_state

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class _Group:
    """What the connector needs of one KV cache group."""

    window: int
    """Its sliding window in tokens (0: full attention, or state)."""
    block_size: int
    """Its tokens per block (the hybrid manager may raise some groups' to unify page sizes)."""
    state: bool = False
    """Per-request state (Mamba-kind: conv and SSM state, gated delta net, short conv; a
    compressor's ring of the open group's rows): one block, the running state after the tokens
    computed, is sent, never a block per position."""
    scratch: int = 0
    """A state group's speculative scratch blocks, after its running-state block."""
    sharded: bool = False
    """A state group whose state each TP rank holds a shard of (not ``tp_replicated``)."""
    chunk: int = 0
    """Its attention chunk in tokens (chunked local attention: a token attends to the tokens
    of its own chunk only), 0 otherwise."""

    def first_needed(self, computed: int) -> int:
        """The first position the next token after ``computed`` tokens attends to (vLLM's
        ``get_num_skipped_tokens``): the window's first or the chunk's, 0 for full attention."""
        if self.window:
            return max(0, computed - self.window + 1)
        if self.chunk:
            return computed // self.chunk * self.chunk
        return 0


def _group_specs(kv_cache_config: KVCacheConfig | None, block_size: int) -> list[_Group]:
    """Per KV cache group, what kind of blocks it holds. Taken: full attention, MLA, sliding
    window, chunked local attention, compressed attention (one state per several tokens, in
    blocks still counted in tokens), Mamba-kind state (``MambaSpec``) and compressor rings
    (``CircularBufferSpec``: one block per request, taken as state); any other kind (sink
    attention, ...) is refused at start, by name, rather than sent as if it were full
    attention. A group vLLM packs of one kind's layers with different pages
    (``UniformTypeKVCacheSpecs``) is taken by its layers' kind."""
    if kv_cache_config is None:
        return [_Group(0, block_size)]
    return [_group_spec(g, group.kv_cache_spec, block_size) for g, group in enumerate(kv_cache_config.kv_cache_groups)]


def _group_spec(g: int, spec: Any, block_size: int) -> _Group:
    """One KV cache group's ``_Group`` (``_group_specs``)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    known: dict[type, bool] = {FullAttentionSpec: False, MLAAttentionSpec: False, SlidingWindowSpec: True}
    try:
        from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

        known[SlidingWindowMLASpec] = True
    except ImportError:
        pass
    size = int(getattr(spec, "block_size", block_size))
    layers = layer_specs(spec)
    first = layers[0]
    kind, kinds = type(first), {type(s) for s in layers}
    if len(kinds) != 1:
        raise ValueError(
            f"KvlinkConnector: KV cache group {g} holds layers of kinds "
            f"{sorted(k.__name__ for k in kinds)}, which kvlink does not transfer as one group"
        )
    if kind is MambaSpec:
        scratch = int(getattr(first, "num_speculative_blocks", 0))
        return _Group(0, size, state=True, scratch=scratch, sharded=not getattr(first, "tp_replicated", False))
    if kind is CircularBufferSpec:
        # The ring of a compressor's open group, at the positions modulo its capacity: like a
        # running state, what it holds after the tokens computed, read whole. Every rank holds
        # the same ring (vLLM builds compressors without TP); rings whose size differs by TP
        # size are refused by the layouts' comparison.
        return _Group(0, size, state=True)
    if kind is ChunkedLocalAttentionSpec:
        return _Group(0, size, chunk=int(first.attention_chunk_size))
    if kind not in known:
        raise ValueError(
            f"KvlinkConnector: KV cache group {g} holds blocks of kind {kind.__name__}, "
            "which kvlink does not transfer; supported: full attention and MLA (compressed too), "
            "sliding window, chunked local attention, Mamba-kind state and compressor rings"
        )
    # A compressed layer's block still spans block_size tokens (block_size / N states): its
    # blocks pair by token position like any attention group's, and are read whole.
    for s in layers:
        tokens_per_state(s)
    windows = {int(s.sliding_window) for s in layers} if known[kind] else {0}
    if len(windows) != 1:
        raise ValueError(f"KvlinkConnector: KV cache group {g} holds sliding windows {sorted(windows)}")
    return _Group(windows.pop(), size)


def _running_state(blocks: list[int], scratch: int) -> list[int]:
    """A state group's block that holds the running state: the last one before the
    speculative scratch blocks, by vLLM's own rule (``clip_ssm_state_blocks``, which its
    NixlConnector reads by); none while none is allocated."""
    return list(clip_ssm_state_blocks(list(blocks), scratch))


def _pair_group(
    local_all: list[int], theirs: list[int], need: int, total: int, sizes: tuple[int, int]
) -> tuple[list[int], list[int], int] | str:
    """One KV cache group's read of tokens ``[need, total)``: this engine's blocks, the
    prefill's, and the tokens of the first block of the larger size before the first one read
    (``sizes``: tokens per block here and at the prefill, one a multiple of the other). The
    read starts at the block of the smaller size that holds ``need``. Why not, when the blocks
    are not there."""
    lsize, rsize = sizes
    small = min(lsize, rsize)
    start = need // small * small
    lo, le = start // lsize, math.ceil(total / lsize)
    ro, re_ = start // rsize, math.ceil(total / rsize)
    if le > len(local_all) or re_ > len(theirs):
        # matched_tokens bounds the count by the remote blocks; this cannot happen unless vLLM
        # allocated fewer blocks than the tokens need. Fail the read, never read less.
        return (
            f"blocks up to token {total} are needed; the prefill offered {len(theirs)}, {len(local_all)} are allocated"
        )
    if lsize == rsize:
        # One size: pairs by position, this engine's null blocks (none of its window) left out.
        pairs = [(local_all[i], theirs[i]) for i in range(lo, le) if local_all[i]]
        local, remote = [mine for mine, _ in pairs], [r for _, r in pairs]
    else:
        local, remote = list(local_all[lo:le]), list(theirs[ro:re_])
    if 0 in remote or 0 in local:
        return "the prefill sent no block (or this engine has none) for a position this engine needs"
    return local, remote, start % max(lsize, rsize)


def _pair_state(local_all: list[int], theirs: list[int], scratch: int) -> tuple[list[int], list[int]] | str:
    """A state group's read: this engine's running-state block and the one block the prefill
    sent, or why not."""
    local = _running_state(local_all, scratch)
    remote = [b for b in theirs if b]
    if len(remote) != 1 or not local or not local[0]:
        return f"a state group needs one block on each side; the prefill sent {len(remote)}, this engine has {local}"
    return local, remote


def _held_blocks(ids: list[int], tail: int, group: _Group, prompt: int) -> list[int]:
    """What a prefill holds of an attention group's blocks for a prompt of ``prompt`` tokens:
    those of the prompt, a sliding window's last ``tail``, an attention chunk's from the chunk
    of the prompt's last token (a decode reads from there, having computed the prompt or all
    but its last token)."""
    ids = ids[: math.ceil(prompt / group.block_size)]
    if group.chunk:
        skip = group.first_needed(max(0, prompt - 1)) // group.block_size
        return [0] * min(skip, len(ids)) + ids[skip:]
    return _clip(ids, tail)


def _clip(ids: list[int], tail: int) -> list[int]:
    """A group's blocks with the positions before its last ``tail`` set to 0 (not sent)."""
    if not tail or len(ids) <= tail:
        return list(ids)
    return [0] * (len(ids) - tail) + list(ids[-tail:])
