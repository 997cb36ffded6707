"""The connector's scheduler side: what each worker must hold, read, cancel or reject per
step, per KV cache group (the groups' kinds and pairing: ``groups``; the transfer parameters
a client relays: ``params``)."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.logger import init_logger

import kvlink

from .groups import _group_specs, _held_blocks, _pair_group, _pair_state, _running_state
from .layout import state_layout
from .metadata import KvlinkConnectorMetadata, KvlinkHandshakeMetadata, ReadSpec
from .params import _Remote, _remote
from .progressive import PROBE, Growing, describe, progressive_why, transfer_of

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
    growing: Growing | None = None
    """A progressive transfer's hold (under the proxy's transfer id), grown step by step."""


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
        # Why this engine cannot take part in progressive transfers (None: it can).
        self.progressive_why = progressive_why(self.groups)
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
            if request.request_id not in self.producing:
                self.producing[request.request_id] = _Producing(request, growing=self._growing(request))
            return 0, False
        if not params.get("do_remote_prefill"):
            return 0, False
        remote = _remote(params, self.block_sizes)
        if not isinstance(remote, str):
            why = self._usable(remote) or self._followable(remote, num_computed_tokens)
            if why is not None:
                remote = why
        if isinstance(remote, str):
            # Malformed or unusable parameters come from a client: compute locally, and let
            # after_alloc tell whatever prefill the parameters name.
            if request.request_id not in self.warned:
                self.warned.add(request.request_id)
                logger.warning("KvlinkConnector: %s: %s; computing it locally", request.request_id, remote)
            return 0, False
        self.local_hits[request.request_id] = num_computed_tokens
        if remote.follow:
            # The prefill's prompt is this one: its blocks are told as they are held.
            count = request.num_prompt_tokens - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        # Only what the prefill can deliver counts: its tokens, within the blocks it offered
        # (a state group's one block holds the state after all of them).
        offered = min(
            (len(g) * b for g, b, k in zip(remote.blocks, remote.block_sizes, self.groups) if not k.state),
            default=remote.num_tokens,
        )
        available = min(remote.num_tokens, offered, request.num_prompt_tokens - self.leave_last)
        count = available - num_computed_tokens
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
        if remote.follow:
            self._follow(rid, remote, blocks, local_hit, total)
            return
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

    def _followable(self, remote: _Remote, local_hit: int) -> str | None:
        """Why this engine cannot follow the prefill's growing hold ``remote`` (a progressive
        transfer), if it cannot."""
        if not remote.follow:
            return None
        if self.progressive_why is not None:
            return f"a progressive transfer was asked, but {self.progressive_why}"
        if len(remote.addresses) != self.owner._tp_size or remote.block_sizes != self.block_sizes:
            return (
                f"a progressive transfer needs equal TP sizes and block sizes: the prefill has "
                f"{len(remote.addresses)} ranks and {remote.block_sizes} tokens per block, this "
                f"engine {self.owner._tp_size} and {self.block_sizes}"
            )
        if any(local_hit % b for b in self.block_sizes):
            return f"this engine's cached prefix of {local_hit} tokens does not end on a block"
        return None

    def _follow(self, rid: str, remote: _Remote, blocks: KVCacheBlocks, local_hit: int, total: int) -> None:
        """The progressive read of ``rid``: per group, this engine's blocks of the prompt after
        its cached prefix (the prefill's first blocks up to it are skipped)."""
        local, skip, refused = [], [], ""
        for g, ids in enumerate(blocks.get_block_ids()):
            first, last = local_hit // self.block_sizes[g], math.ceil(total / self.block_sizes[g])
            mine = list(ids[first:last])
            if len(mine) != last - first or 0 in mine:
                refused = f"KV cache group {g}: blocks {first} to {last} are needed, {list(ids)} are allocated"
                logger.error("KvlinkConnector: %s: %s", rid, refused)
                mine = list(ids)
            local.append(mine)
            skip.append(first)
        self.meta.reads[rid] = ReadSpec(
            remote_addresses=remote.addresses,
            remote_request_id=remote.request_id,
            local_blocks=local,
            remote_blocks=[[] for _ in local],
            refused=refused,
            hold=remote.hold,
            follow=True,
            skip=skip,
        )
        self.reading.add(rid)

    def update_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving or ():
            self.reading.discard(rid)

    # -- both --

    def build_meta(self, so: SchedulerOutput) -> KvlinkConnectorMetadata:
        for rid in getattr(so, "preempted_req_ids", None) or ():
            p = self.producing.get(rid)
            if p is not None and p.growing is not None:
                # Preempted while it grows: the hold ends (its decode recomputes), and the
                # request, computed again later, grows no more.
                if p.growing.started and not p.growing.dead:
                    self.meta.releases.append(rid)
                self.meta.grows.pop(rid, None)
                self.meta.growth.pop(rid, None)
                p.growing.dead, p.held = True, None
            elif p is not None and p.held is not None:
                self.meta.releases.append(rid)
                self.meta.holds.pop(rid, None)
                self.meta.hold_tokens.pop(rid, None)
                p.held = None
        for rid, n in so.num_scheduled_tokens.items():
            p = self.producing.get(rid)
            if p is not None and p.growing is not None:
                self._grow(p, n)
                continue
            if p is None or p.held is not None:
                continue
            req = p.request
            if req.num_computed_tokens + n < req.num_prompt_tokens:
                continue  # the prompt is not complete after this step
            manager = self._manager()
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

    def _growing(self, request: Request) -> Growing | None:
        """The progressive transfer a prefill request asks for (``transfer_id`` and
        ``transfer_hold`` in its parameters), if this engine can make it; otherwise its blocks
        are held once its prompt is done, as in the sequential flow."""
        asked = transfer_of(request.kv_transfer_params or {})
        why = asked if isinstance(asked, str) else self.progressive_why if asked else None
        if why is not None:
            logger.warning("KvlinkConnector: %s: no progressive transfer: %s", request.request_id, why)
            return None
        return None if asked is None else Growing(*asked)

    def _grow(self, p: _Producing, n: int) -> None:
        """A step of ``n`` tokens of progressive request ``p``: its hold opened at its first
        step, the blocks final before and after the step's forward, sealed at the prompt's end."""
        g, req = p.growing, p.request
        assert g is not None
        ids = [list(x) for x in self._manager().get_block_ids(req.request_id)]
        growth = g.step(ids, self.block_sizes, req.num_computed_tokens, n, req.num_prompt_tokens)
        if growth is None:
            return
        if not g.started:
            self.meta.grows[req.request_id] = (g.transfer_id, g.hold)
            g.started = True
        self.meta.growth[req.request_id] = growth
        if growth.seal:
            p.held = [x[:e] for x, e in zip(ids, g.announced)]
            p.hold = g.hold

    def _manager(self) -> Any:
        manager = self.owner._kv_cache_manager
        if manager is None:
            raise RuntimeError("KvlinkConnector: the scheduler did not bind its KV cache manager")
        return manager

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        params = request.kv_transfer_params
        self.local_hits.pop(rid, None)
        p = self.producing.pop(rid, None)
        if p is not None:
            normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            if p.growing is not None:
                return self._finished_growing(request, p, normal)
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
            return True, self._offer(request, p, rid)
        self.warned.discard(rid)
        if not params:
            return False, None
        if params.get(PROBE):
            return False, {"kvlink": self.describe()}
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

    def _finished_growing(self, request: Request, p: _Producing, normal: bool) -> tuple[bool, dict[str, Any] | None]:
        """A progressive request finished: its blocks are kept for its reader when the hold was
        sealed, else the hold ends (the decode recomputes)."""
        g, rid = p.growing, request.request_id
        assert g is not None
        if not g.started:
            return False, None
        if g.sealed and not g.dead and normal and self.addresses is not None:
            return True, self._offer(request, p, g.transfer_id)
        if not g.dead:
            self.meta.releases.append(rid)
        return False, None

    def _offer(self, request: Request, p: _Producing, held_as: str) -> dict[str, Any]:
        """The transfer parameters of a held request for its decode (``held_as``: the id its
        hold is under)."""
        assert p.held is not None and self.addresses is not None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_addresses": list(self.addresses),
            "remote_request_id": held_as,
            "remote_hold": p.hold,
            # One list per KV cache group (a flat list when there is one group).
            "remote_block_ids": [list(g) for g in p.held] if len(p.held) > 1 else list(p.held[0]),
            "remote_num_tokens": request.num_prompt_tokens,
            # Tokens per block of each KV cache group (a decode of another size reads
            # token ranges).
            "remote_block_sizes": list(self.block_sizes),
            "remote_engine_id": self.owner._kv_transfer_config.engine_id,
            "tp_size": len(self.addresses),
            "progressive": self.progressive_why is None,
        }

    def describe(self) -> dict[str, Any]:
        """What this engine answers a proxy's probe (``kvlink.vllm.progressive.describe``)."""
        return describe(
            self.addresses,
            self.owner._tp_size,
            self.block_sizes,
            self.progressive_why,
            self.owner._kv_transfer_config.engine_id,
        )
