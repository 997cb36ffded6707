"""The connector's scheduler side: what each worker must hold, read, cancel or reject per
step, per KV cache group, and the validation of the transfer parameters a client relays."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.logger import init_logger

import kvlink

from .. import core
from .layout import layer_specs, state_layout, tokens_per_state
from .metadata import KvlinkConnectorMetadata, KvlinkHandshakeMetadata, ReadSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from .connector import KvlinkConnector

logger = init_logger(__name__)


@dataclass
class _Producing:
    request: Request
    held: list[list[int]] | None = None
    """Per KV cache group, the block at each position of the prompt (0 where none is sent)."""
    hold: int = 0
    """The token every worker's hold of the request is made under (sent to the decode as
    ``remote_hold``: only this hold confirms its reads, never a later one of a reused id)."""


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


class _SchedulerSide:
    """The scheduler's view: what each worker must hold, read, cancel or reject per step."""

    def __init__(self, owner: KvlinkConnector, kv_cache_config: KVCacheConfig | None):
        self.owner = owner
        self.block_size = owner._block_size
        self.groups = _group_specs(kv_cache_config, self.block_size)
        self.block_sizes = [g.block_size for g in self.groups]
        # The prefill holds a sliding-window group's last blocks, one more than the window
        # spans (it may not be aligned with the blocks).
        self.tails = [math.ceil(g.window / g.block_size) + 1 if g.window else 0 for g in self.groups]
        # With state, the prefill computes the prompt but its last token, whose state the
        # decode computes from the state it reads (as vLLM's NixlConnector does): a state
        # holds the tokens before it only, so the decode cannot recompute a token it read.
        self.backoff = 1 if any(g.state for g in self.groups) else 0
        # With attention chunks, the decode reads the prompt but its last token: vLLM counts a
        # load of the whole prompt as computed, drops the chunks before the next token's, then
        # computes the last token again, whose chunk it has dropped when the prompt ends one.
        self.leave_last = any(g.chunk for g in self.groups)
        # Why this engine's Mamba-kind state cannot be read between TP sizes (its conv layout or
        # kind), or None: then each rank reads its slice of the prefill ranks' state.
        self.state_whole: str | None = None
        if any(g.sharded for g in self.groups):
            hf = getattr(getattr(owner._vllm_config, "model_config", None), "hf_text_config", None)
            self.state_whole = state_layout(kv_cache_config, owner._tp_size, hf)[1]
        self.addresses: list[str] | None = None
        self.producing: dict[str, _Producing] = {}
        self.local_hits: dict[str, int] = {}
        self.meta = KvlinkConnectorMetadata()
        # Decode: reads handed to the workers and not reported finished yet.
        self.reading: set[str] = set()
        # Requests whose unusable parameters were already logged.
        self.warned: set[str] = set()

    def set_addresses(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        ranks = sorted(metadata)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"KvlinkConnector: handshake metadata for TP ranks {ranks}")
        addresses = []
        for r in ranks:
            m = metadata[r]
            if not isinstance(m, KvlinkHandshakeMetadata):
                raise TypeError(f"KvlinkConnector: rank {r} sent {type(m).__name__}, not KvlinkHandshakeMetadata")
            addresses.append(m.address)
        self.addresses = addresses
        logger.info("KvlinkConnector: prefill addresses per TP rank: %s", addresses)

    # -- decode side --

    def _usable(self, remote: _Remote) -> str | None:
        """Why this engine cannot read from the prefill the parameters name, if it cannot."""
        tp = self.owner._tp_size
        try:
            kvlink.tp_sources(0, tp, len(remote.addresses))
        except kvlink.InvalidArgument:
            return (
                f"the prefill has {len(remote.addresses)} TP ranks and this engine {tp}; one "
                "must be a multiple of the other"
            )
        if len(remote.addresses) != tp and self.state_whole is not None:
            return (
                f"the prefill has {len(remote.addresses)} TP ranks and this engine {tp}, and this "
                f"engine's Mamba-kind state cannot be read by TP slice: {self.state_whole}"
            )
        if len(remote.blocks) != len(self.tails):
            return f"the prefill sent blocks of {len(remote.blocks)} KV cache groups; this engine has {len(self.tails)}"
        if len(remote.block_sizes) != len(remote.blocks):
            return f"the prefill sent {len(remote.block_sizes)} block sizes for {len(remote.blocks)} KV cache groups"
        if remote.block_sizes != self.block_sizes:
            ours, theirs = set(self.block_sizes), set(remote.block_sizes)
            a, b = self.block_sizes[0], remote.block_sizes[0]
            if len(ours) > 1 or len(theirs) > 1 or max(a, b) % min(a, b):
                return (
                    f"the prefill's blocks hold {remote.block_sizes} tokens per KV cache group and "
                    f"this engine's {self.block_sizes}: reads between block sizes need one size per "
                    "engine, one a multiple of the other"
                )
        return None

    def on_new_request(self, request: Request) -> None:
        """A prefill's request for a remote decode, with state groups: its last prompt token
        is dropped (and it makes one token), so that the state it holds is the one before the
        token the decode computes. Once per request (a preempted request comes back here)."""
        params = request.kv_transfer_params
        if not self.backoff or not params or not params.get("do_remote_decode"):
            return
        if params.get("_kvlink_backed_off") or request.num_prompt_tokens <= self.backoff:
            return
        if request.prompt_token_ids is None:
            return  # prompt embeddings: the decode computes the whole prompt
        del request.prompt_token_ids[-self.backoff :]
        del request._all_token_ids[-self.backoff :]
        request.num_prompt_tokens -= self.backoff
        request.max_tokens = 1
        params["_kvlink_backed_off"] = True

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params:
            return 0, False
        if params.get("do_remote_decode"):
            self.producing.setdefault(request.request_id, _Producing(request))
            return 0, False
        if not params.get("do_remote_prefill"):
            return 0, False
        remote = _remote(params, self.block_sizes)
        if not isinstance(remote, str):
            why = self._usable(remote)
            if why is not None:
                remote = why
        if isinstance(remote, str):
            # Malformed or unusable parameters come from a client: compute locally, and let
            # after_alloc tell whatever prefill the parameters name.
            if request.request_id not in self.warned:
                self.warned.add(request.request_id)
                logger.warning("KvlinkConnector: %s: %s; computing it locally", request.request_id, remote)
            return 0, False
        # Only what the prefill can deliver counts: its tokens, within the blocks it offered
        # (a state group's one block holds the state after all of them).
        offered = min(
            (len(g) * b for g, b, k in zip(remote.blocks, remote.block_sizes, self.groups) if not k.state),
            default=remote.num_tokens,
        )
        available = min(remote.num_tokens, offered, request.num_prompt_tokens - self.leave_last)
        count = available - num_computed_tokens
        self.local_hits[request.request_id] = num_computed_tokens
        if count > 0:
            return count, True
        return 0, False

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False
        rid = request.request_id
        local_hit = self.local_hits.pop(rid, 0)
        self.warned.discard(rid)
        remote = _remote(params, self.block_sizes)
        if num_external_tokens <= 0:
            # Nothing to read (a local hit, or parameters this engine cannot use): the
            # prefill may free its blocks now.
            if not isinstance(remote, str):
                self.meta.rejects.append(
                    (remote.addresses, remote.request_id, "nothing to read from this prefill", remote.hold)
                )
            return
        assert not isinstance(remote, str), remote  # checked by matched_tokens
        total = local_hit + num_external_tokens
        local_groups, remote_groups, first_tokens = [], [], []
        refused = ""
        for g, (local_all, theirs) in enumerate(zip(blocks.get_block_ids(), remote.blocks)):
            if self.groups[g].state:
                state = _pair_state(list(local_all), theirs, self.groups[g].scratch)
                if isinstance(state, str):
                    refused = f"KV cache group {g}: {state}"
                    break
                local_groups.append(state[0])
                remote_groups.append(state[1])
                first_tokens.append(0)
                continue
            # A sliding window's or an attention chunk's group needs only the blocks of the
            # tokens the next one attends to: vLLM skips the others (and the prefill may have
            # freed them).
            need = max(local_hit, self.groups[g].first_needed(total))
            sizes = (self.block_sizes[g], remote.block_sizes[g])
            paired = _pair_group(list(local_all), theirs, need, total, sizes)
            if isinstance(paired, str):
                refused = f"KV cache group {g}: {paired}"
                break
            local_groups.append(paired[0])
            remote_groups.append(paired[1])
            first_tokens.append(paired[2])
        if refused:
            logger.error("KvlinkConnector: %s: %s", rid, refused)
            local_groups = [list(ids) for ids in blocks.get_block_ids()]
            remote_groups = [[] for _ in local_groups]
        self.meta.reads[rid] = ReadSpec(
            remote_addresses=remote.addresses,
            remote_request_id=remote.request_id,
            local_blocks=local_groups,
            remote_blocks=remote_groups,
            refused=refused,
            remote_block_size=remote.block_sizes[0] if remote.block_sizes != self.block_sizes else 0,
            first_tokens=first_tokens if any(first_tokens) and not refused else [],
            hold=remote.hold,
        )
        self.reading.add(rid)

    def update_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving or ():
            self.reading.discard(rid)

    # -- both --

    def build_meta(self, so: SchedulerOutput) -> KvlinkConnectorMetadata:
        for rid in getattr(so, "preempted_req_ids", None) or ():
            p = self.producing.get(rid)
            if p is not None and p.held is not None:
                self.meta.releases.append(rid)
                self.meta.holds.pop(rid, None)
                self.meta.hold_tokens.pop(rid, None)
                p.held = None
        for rid, n in so.num_scheduled_tokens.items():
            p = self.producing.get(rid)
            if p is None or p.held is not None:
                continue
            req = p.request
            if req.num_computed_tokens + n < req.num_prompt_tokens:
                continue  # the prompt is not complete after this step
            manager = self.owner._kv_cache_manager
            if manager is None:
                raise RuntimeError("KvlinkConnector: the scheduler did not bind its KV cache manager")
            held = [
                _running_state(list(ids), g.scratch)
                if g.state
                else _held_blocks(list(ids), tail, g, req.num_prompt_tokens)
                for ids, tail, g in zip(manager.get_block_ids(rid), self.tails, self.groups)
            ]
            # Held in this step, before its output (and the request's transfer parameters)
            # can reach the decode; vLLM's null block (0) is never held.
            self.meta.holds[rid] = [[b for b in ids if b] for ids in held]
            p.held = held
            p.hold = secrets.randbits(63) + 1
            self.meta.hold_tokens[rid] = p.hold
        meta, self.meta = self.meta, KvlinkConnectorMetadata()
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        params = request.kv_transfer_params
        self.local_hits.pop(rid, None)
        p = self.producing.pop(rid, None)
        if p is not None:
            normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            if p.held is None:
                self.meta.holds.pop(rid, None)
                self.meta.hold_tokens.pop(rid, None)
                return False, None
            if not normal or self.addresses is None:
                if self.addresses is None:
                    logger.error(
                        "KvlinkConnector: no handshake metadata from the workers; %s is not offered to a decode", rid
                    )
                self.meta.holds.pop(rid, None)
                self.meta.hold_tokens.pop(rid, None)
                self.meta.releases.append(rid)
                return False, None
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_addresses": list(self.addresses),
                "remote_request_id": rid,
                "remote_hold": p.hold,
                # One list per KV cache group (a flat list when there is one group).
                "remote_block_ids": [list(g) for g in p.held] if len(p.held) > 1 else list(p.held[0]),
                "remote_num_tokens": request.num_prompt_tokens,
                # Tokens per block of each KV cache group (a decode of another size reads
                # token ranges).
                "remote_block_sizes": list(self.block_sizes),
                "remote_engine_id": self.owner._kv_transfer_config.engine_id,
                "tp_size": len(self.addresses),
            }
        self.warned.discard(rid)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Finished (aborted, refused) before its blocks were allocated: never read.
            params["do_remote_prefill"] = False
            remote = _remote(params, self.block_sizes)
            if not isinstance(remote, str):
                self.meta.rejects.append(
                    (remote.addresses, remote.request_id, "request finished before its read started", remote.hold)
                )
        elif rid in self.reading:
            # Aborted while its read is in flight: vLLM keeps the blocks until the worker
            # reports the read finished, which the cancel brings about at once.
            self.meta.cancels.append(rid)
        return False, None


@dataclass
class _Remote:
    addresses: list[str]
    request_id: str
    blocks: list[list[int]]
    """Per KV cache group, the prefill's block at each position (0: none sent)."""
    num_tokens: int
    block_sizes: list[int]
    """Per KV cache group, the prefill's tokens per block."""
    hold: int | None = None
    """The token of the prefill's hold (None from a prefill of an earlier kvlink)."""


def _block_list(blocks: Any) -> bool:
    return core.block_ids(blocks) is not None


def _remote(params: dict[str, Any], block_sizes: list[int]):
    """The prefill side of ``kv_transfer_params``, validated (they come from a client through
    the proxy), or why they are unusable."""
    try:
        addresses = params["remote_addresses"]
        rid = params["remote_request_id"]
        blocks = params["remote_block_ids"]
    except KeyError as e:
        return f"kv_transfer_params lack {e.args[0]!r}"
    if not isinstance(addresses, (list, tuple)) or not addresses or not all(isinstance(a, str) for a in addresses):
        return "remote_addresses must be a non-empty list of 'host:port' strings"
    if not isinstance(rid, str) or not rid:
        return "remote_request_id must be a non-empty string"
    if _block_list(blocks):
        groups = [list(blocks)]
    elif isinstance(blocks, (list, tuple)) and blocks and len(blocks) <= 64 and all(_block_list(g) for g in blocks):
        groups = [list(g) for g in blocks]
    else:
        return (
            "remote_block_ids must be a list of block ids (integers 0 to 2^32-1), or one such list per KV cache group"
        )
    sizes = params.get("remote_block_sizes")
    if sizes is None:  # a prefill of an earlier kvlink: this engine's sizes
        sizes = block_sizes if len(block_sizes) == len(groups) else [block_sizes[0]] * len(groups)
    if not _block_list(sizes) or not sizes or 0 in sizes:
        return "remote_block_sizes must be a positive integer per KV cache group"
    tokens = params.get("remote_num_tokens")
    if tokens is None:
        tokens = min(len(g) * b for g, b in zip(groups, sizes))
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        return "remote_num_tokens must be a non-negative integer"
    hold = params.get("remote_hold")
    if hold is not None and core.hold_token(hold) is None:
        return "remote_hold must be an integer from 1 to 2^64-1"
    return _Remote(list(addresses), rid, groups, tokens, list(sizes), hold)
