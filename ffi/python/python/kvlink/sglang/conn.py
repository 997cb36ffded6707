"""kvlink's SGLang transfer backend: ``KvlinkKVManager``, ``KvlinkKVSender`` (prefill),
``KvlinkKVReceiver`` (decode), on SGLang's base classes.

kvlink pulls: the decode reads, the prefill holds. So the flow turns SGLang's around while
keeping every poll state where SGLang's schedulers expect it:

1. The decode receiver's ``send_metadata`` keeps the decode's page indices local and tells the
   prefill rank (a ``want`` message over kvlink's authenticated engine messages) how many pages
   it expects, its prefix, and whether it wants the aux row and state indices. Until that
   arrives the prefill sender polls ``Bootstrapping``; then ``WaitingForInput``.
2. Each ``KVSender.send`` (one per prefill chunk) holds the chunk's prefill pages for that decode
   engine only (``hold_blocks`` with the reader) and announces them (a ``chunk`` message). The
   decode reads each chunk into its own pages as it arrives, under its own request id. The last
   chunk also holds and announces the aux row and the state indices, each in its own index space:
   one kvlink engine per space (KV pages, aux rows, each state type), so every read stays
   block-granular and granted.
3. The sender polls ``Success`` once the decode confirmed every hold; the receiver once every
   read is in place. Any failure (a read, a hold expiring, an abort on either side, a timeout)
   fails both sides with the reason, and the other side is told (an ``abort`` message).

Every wait has a deadline: SGLang's bootstrap and waiting timeouts
(``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``, ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``), and
kvlink's request and abort timeouts for reads and holds.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional

import numpy as np

import kvlink
from kvlink.sglang import bootstrap, wire
from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

logger = logging.getLogger(__name__)

_REMEMBERED_ROOMS = 4096
# How long clear() waits for the cancelled reads of a room to stop writing (kvlink waits for
# what is in flight at most its I/O timeout).
_DRAIN_S = 15.0


class KvlinkTransferError(Exception):
    """Why a room's transfer failed, as SGLang's schedulers read it (``failure_reason``,
    ``is_from_another_rank``)."""

    def __init__(self, room: int, reason: str, is_from_another_rank: bool = False):
        super().__init__(reason)
        self.bootstrap_room = room
        self.failure_reason = reason
        self.is_from_another_rank = is_from_another_rank

    def __str__(self) -> str:
        return f"kvlink transfer of room {self.bootstrap_room} failed: {self.failure_reason}"


def _env_seconds(name: str, default: float) -> float:
    try:
        from sglang.srt.environ import envs

        return float(getattr(envs, name).get())
    except Exception:  # noqa: BLE001 - older SGLang, or the variable unset
        return float(os.environ.get(name, default))


def _host() -> str:
    host = os.environ.get("KVLINK_HOST")
    if host:
        return host
    if os.environ.get("KVLINK_AUTH_KEY") or os.environ.get("KVLINK_AUTH_KEY_FILE"):
        try:
            from sglang.srt.utils.network import get_local_ip_auto

            return get_local_ip_auto()
        except Exception:  # noqa: BLE001
            pass
    return "127.0.0.1"


def _attn_tp() -> tuple:
    try:
        from sglang.srt.runtime_context import get_parallel

        g = get_parallel().attn_tp_group
        return int(g.rank_in_group), int(g.world_size)
    except Exception:  # noqa: BLE001 - no parallel context (a bare test): one rank
        return 0, 1


class KvlinkKVManager(BaseKVManager):
    """One per scheduler rank: kvlink engines for the KV pages, the aux rows and each state type,
    the rooms in flight, and the messages and completions that move them."""

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: Optional[bool] = False):
        self.kv_args = args
        self.mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.bootstrap_timeout = _env_seconds("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)
        self.waiting_timeout = _env_seconds("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300)
        _refuse_unsupported(server_args)
        # Both sides number ranks inside the attention-TP group (SGLang's prefill passes the
        # global TP rank as engine_rank, its decode the rank in the group).
        self.tp_rank, self.tp_size = _attn_tp()
        self.engine_rank = self.tp_rank
        self.page_size = int(args.page_size)
        self.dtype = f"{args.kv_cache_dtype_str}/{getattr(args, 'kv_layout', None) or 'default'}/p{self.page_size}"
        host = _host()
        listen = f"[{host}]:0" if ":" in host else f"{host}:0"
        opts = dict(
            transport=os.environ.get("KVLINK_TRANSPORT", "auto"),
            tp_rank=self.engine_rank,
            tp_size=self.tp_size,
            request_timeout=float(os.environ.get("KVLINK_REQUEST_TIMEOUT", 60)),
            abort_timeout=float(os.environ.get("KVLINK_ABORT_TIMEOUT", 480)),
            rdma_device=(getattr(args, "ib_device", None) or os.environ.get("KVLINK_RDMA_DEVICE")) or None,
        )
        # One engine per index space: block ids of one read index every tensor of its layout.
        self.kv = self._engine(listen, opts, args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens,
                               self.page_size, self.dtype)
        aux_ptrs = list(getattr(args, "aux_data_ptrs", None) or [])
        self.aux = (self._engine(listen, opts, aux_ptrs, args.aux_data_lens, args.aux_item_lens, 1,
                                 "sglang-aux") if aux_ptrs else None)
        self.states: List[Optional[kvlink.Engine]] = []
        for i, ptrs in enumerate(getattr(args, "state_data_ptrs", None) or []):
            self.states.append(self._engine(listen, opts, ptrs, args.state_data_lens[i],
                                            args.state_item_lens[i], 1, f"sglang-state-{i}")
                               if ptrs else None)
        self.engines = [e for e in [self.kv, self.aux, *self.states] if e is not None]
        # request id -> the sender or receiver it belongs to
        self.owners: Dict[str, Any] = {}
        # decode: cancelled reads whose last writes may still land (request id -> engine)
        self.draining: Dict[str, kvlink.Engine] = {}
        self.senders: Dict[int, "KvlinkKVSender"] = {}
        self.receivers: Dict[int, "KvlinkKVReceiver"] = {}
        # prefill: wants that came before their sender; rooms a prefill sender gave up on before
        # any want (answered with an abort); attempts a decode aborted before its want came
        self.early_wants: "OrderedDict[int, tuple]" = OrderedDict()
        self.aborted: "OrderedDict[int, str]" = OrderedDict()
        self.withdrawn: "OrderedDict[tuple, str]" = OrderedDict()
        self.req_to_decode_prefix_len: Dict[int, int] = {}
        # decode: what SGLang's decode scheduler reads, and the routes it learned
        self.prefill_info_table: Dict[str, Any] = {}
        self.routes: Dict[tuple, Dict[str, Any]] = {}
        self.bad_messages = 0
        self.unsent_messages = 0
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.register_to_bootstrap()
        logger.info("kvlink %s rank %d: KV engine %s at %s, %d index spaces (%s)", self.mode.value,
                    self.engine_rank, self.kv.engine_id, self.kv.handshake_address, len(self.engines),
                    "RDMA on " + self.kv.rdma_device if self.kv.rdma_device else
                    f"TCP; RDMA: {self.kv.rdma_unavailable_reason}")

    def _engine(self, listen: str, opts: Dict[str, Any], ptrs: List[int], lens: List[int],
                item_lens: List[int], tokens_per_block: int, dtype: str) -> kvlink.Engine:
        e = kvlink.Engine(listen, **opts)
        try:
            regions: Dict[int, int] = {}
            tensors = []
            for ptr, size, item in zip(ptrs, lens, item_lens):
                ptr, size, item = int(ptr), int(size), int(item)
                if item <= 0 or size < item:
                    raise kvlink.InvalidArgument(f"buffer at {ptr:#x}: {size} bytes of {item}-byte items")
                if ptr not in regions:
                    regions[ptr] = e.register_memory(ptr, size)
                tensors.append((regions[ptr], 0, item, item, size // item))
            e.set_layout(tensors, tokens_per_block, dtype)
        except Exception:
            e.close()
            raise
        return e

    def register_to_bootstrap(self) -> None:
        """Tells the bootstrap server this rank's KV engine (retried in the background)."""
        sa = self.server_args
        # The bootstrap server runs beside the first node's tokenizer manager.
        dist = getattr(sa, "dist_init_addr", None)
        host = dist.rsplit(":", 1)[0].strip("[]") if dist else (getattr(sa, "host", None) or "127.0.0.1")
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        port = int(getattr(sa, "disaggregation_bootstrap_port", 8998))
        entry = {"dp_rank": 0, "tp_rank": self.engine_rank, "tp_size": self.tp_size, "dp_size": 1,
                 "addr": self.kv.handshake_address, "engine_id": self.kv.engine_id,
                 "page_size": self.page_size, "dtype": self.dtype}
        bootstrap.register(f"{host}:{port}", entry)

    # -- decode: where the prefill ranks are ---------------------------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: whether every prefill rank behind ``bootstrap_addr`` registered (SGLang asks
        before it initialises receivers, and gives up after some tries)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        info = bootstrap.get(bootstrap_addr, "/kvlink/info")
        if not info or info.get("complete") is not True:
            return False
        from types import SimpleNamespace

        try:
            self.prefill_info_table[bootstrap_addr] = SimpleNamespace(
                dp_size=int(info["dp_size"]), tp_size=int(info["tp_size"]), follow_bootstrap_room=True,
                page_size=info.get("page_size"), dtype=info.get("dtype"))
        except (KeyError, TypeError, ValueError):
            logger.warning("kvlink: the bootstrap server at %s answered %r", bootstrap_addr, info)
            return False
        return True

    def forget_route(self, bootstrap_addr: str) -> None:
        """Drops what was learned about a prefill (it may have restarted on other ports)."""
        self.prefill_info_table.pop(bootstrap_addr, None)
        for key in [k for k in self.routes if k[0] == bootstrap_addr]:
            del self.routes[key]

    def route(self, bootstrap_addr: str, dp_rank: int) -> Dict[str, Any]:
        """The prefill rank this decode rank reads from; raises ``KvlinkTransferError``-ready
        text (``ValueError``) when it is unknown or incompatible."""
        key = (bootstrap_addr, dp_rank, self.engine_rank)
        if key in self.routes:
            return self.routes[key]
        if not self.try_ensure_parallel_info(bootstrap_addr):
            raise ValueError(f"the prefill at {bootstrap_addr} has not registered all its ranks")
        info = self.prefill_info_table[bootstrap_addr]
        if info.tp_size != self.tp_size:
            raise ValueError(f"prefill attention TP {info.tp_size}, decode {self.tp_size}: kvlink pairs equal "
                             "TP sizes only (heterogeneous TP is not supported yet)")
        if info.dtype != self.dtype:
            raise ValueError(f"KV cache {info.dtype!r} on the prefill, {self.dtype!r} here")
        r = bootstrap.get(bootstrap_addr, f"/kvlink/route?dp_rank={dp_rank}&tp_rank={self.engine_rank}")
        if not r or not isinstance(r.get("addr"), str) or not isinstance(r.get("engine_id"), str):
            raise ValueError(f"prefill dp {dp_rank} tp {self.engine_rank} is not registered at {bootstrap_addr}")
        self.routes[key] = r
        return r

    # -- progress --------------------------------------------------------------------------

    def pump(self) -> None:
        """Takes every engine's finished transfers and the KV engine's messages, and hands each
        to its room. Called from every poll; never blocks."""
        for e in self.engines:
            self._finished(e.get_finished())
        for sender_id, body in self.kv.messages():
            try:
                m = wire.decode(body)
            except wire.BadMessage as e:
                self._bad(sender_id, str(e))
                continue
            self._dispatch(sender_id, m)

    def _finished(self, f: Any) -> None:
        if f.is_empty():
            return
        for rid in list(f.sending) + list(f.receiving):
            self.draining.pop(rid, None)
            owner = self.owners.pop(rid, None)
            if owner is not None:
                owner._done(rid)
        for d in f.failures:
            self.draining.pop(d["id"], None)
            owner = self.owners.pop(d["id"], None)
            if owner is not None:
                owner._fail(f"{d['side']} {d['id']} {d['cause']}: {d['reason']}", tell_peer=True)

    def drain(self, rids: List[str]) -> None:
        """Waits until the cancelled reads ``rids`` were reported (their last write landed), at
        most ``_DRAIN_S``: SGLang reuses a failed request's pages right after ``clear()``."""
        end = time.monotonic() + _DRAIN_S
        while any(r in self.draining for r in rids):
            left = end - time.monotonic()
            if left <= 0:
                logger.error("kvlink: cancelled reads %s not reported within %.0f s; their pages may "
                             "still be written", [r for r in rids if r in self.draining], _DRAIN_S)
                return
            engines = {id(e): e for r, e in self.draining.items() if r in rids}
            for e in engines.values():
                self._finished(e.wait_finished(min(left, 0.05)))

    def send(self, peer: str, body: bytes) -> bool:
        """Sends a message; a refusal (peer unreachable with its queue full, engine closed) is
        logged and counted, never raised into SGLang's scheduler."""
        try:
            self.kv.send_message(peer, body)
            return True
        except kvlink.KvlinkError as e:
            self.unsent_messages += 1
            if self.unsent_messages <= 10 or self.unsent_messages % 1000 == 0:
                logger.warning("kvlink: could not send a message to %s (%d so far): %s", peer,
                               self.unsent_messages, e)
            return False

    def _bad(self, sender_id: str, why: str) -> None:
        self.bad_messages += 1
        if self.bad_messages <= 10 or self.bad_messages % 1000 == 0:
            logger.warning("kvlink: dropped a malformed message from engine %s (%d so far): %s",
                           sender_id, self.bad_messages, why)

    def _dispatch(self, sender_id: str, m: Dict[str, Any]) -> None:
        room, kind, nonce = m["room"], m["t"], m["nonce"]
        if self.mode == DisaggregationMode.PREFILL:
            sender = self.senders.get(room)
            if kind == "want":
                if (room, nonce) in self.withdrawn:
                    return
                if sender is not None:
                    sender._on_want(m, sender_id)
                elif room in self.aborted:
                    self.send(m["addr"], wire.abort(room, nonce, self.aborted[room]))
                else:
                    _remember(self.early_wants, room, (m, sender_id))
            elif kind == "abort" and nonce is not None:
                if sender is not None and sender.want is not None and sender.want["nonce"] == nonce:
                    sender._on_peer_abort(m["reason"], sender_id)
                elif sender is None or sender.want is None:
                    # An attempt withdrawn before its want got here: its want will be ignored.
                    _remember(self.withdrawn, (room, nonce), m["reason"])
                    early = self.early_wants.get(room)
                    if early is not None and early[0]["nonce"] == nonce:
                        del self.early_wants[room]
            else:
                self._bad(sender_id, f"a {kind} message on a prefill")
        else:
            receiver = self.receivers.get(room)
            if receiver is None:
                logger.debug("kvlink: %s message for room %d, which this decode rank does not know", kind, room)
            elif nonce is not None and nonce != receiver.nonce:
                logger.debug("kvlink: %s message for an earlier attempt at room %d", kind, room)
            elif kind == "chunk":
                receiver._on_chunk(m, sender_id)
            elif kind == "abort":
                receiver._on_peer_abort(m["reason"], sender_id)
            else:
                self._bad(sender_id, f"a {kind} message on a decode")

    def close(self) -> None:
        for e in self.engines:
            e.close()

    def teardown(self) -> None:
        self.close()


def _refuse_unsupported(sa: Any) -> None:
    """Configurations this backend does not implement yet fail at start, saying which."""
    why = []
    for attr, ok, what in (("pp_size", 1, "pipeline parallelism"), ("attn_cp_size", 1, "attention context parallelism"),
                           ("attn_dp_size", 1, "DP attention"), ("dp_size", 1, "data parallelism")):
        v = getattr(sa, attr, ok)
        if isinstance(v, int) and v > ok:
            why.append(f"{what} ({attr}={v})")
    if getattr(sa, "disaggregation_decode_allocation_policy", "early") not in ("early", None):
        why.append("the prefill_complete decode allocation policy")
    if getattr(sa, "enable_memory_saver", False) is True:
        why.append("the memory saver (KV memory released and remapped)")
    for env in ("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "SGLANG_DISAGG_STAGING_BUFFER"):
        if os.environ.get(env, "").lower() in ("1", "true", "yes"):
            why.append(env)
    if why:
        raise ValueError("the kvlink transfer backend does not support " + ", ".join(why) + " yet")


def _remember(d: "OrderedDict[Any, Any]", room: Any, value: Any) -> None:
    d[room] = value
    d.move_to_end(room)
    while len(d) > _REMEMBERED_ROOMS:
        d.popitem(last=False)


class _Room:
    """What both sides share: the outcome, its reason, and the requests still out."""

    def __init__(self, mgr: KvlinkKVManager, room: int):
        self.kv_mgr = mgr
        self.bootstrap_room = room
        self.outcome: Optional[int] = None  # KVPoll.Success or KVPoll.Failed once concluded
        self.reason: Optional[str] = None
        self.out: Dict[str, str] = {}  # request id -> index space ("kv", "aux", "s<i>")
        self.started: Optional[float] = None
        self.finished_at: Optional[float] = None
        self.bytes = 0

    def _engine(self, space: str) -> Optional[kvlink.Engine]:
        if space == "kv":
            return self.kv_mgr.kv
        if space == "aux":
            return self.kv_mgr.aux
        i = int(space[1:])
        return self.kv_mgr.states[i] if i < len(self.kv_mgr.states) else None

    def _track(self, rid: str, space: str) -> None:
        self.out[rid] = space
        self.kv_mgr.owners[rid] = self

    def _done(self, rid: str) -> None:
        self.out.pop(rid, None)
        self._progress()

    def _progress(self) -> None:  # pragma: no cover - overridden
        pass

    def _fail(self, reason: str, tell_peer: bool = False) -> None:
        if self.outcome is not None:
            return
        self.outcome, self.reason = KVPoll.Failed, reason
        logger.warning("kvlink: room %d failed: %s", self.bootstrap_room, reason)
        self._drop_out()
        if tell_peer:
            self._tell_peer_abort(reason)

    def _drop_out(self) -> None:  # pragma: no cover - overridden
        pass

    def _tell_peer_abort(self, reason: str) -> None:  # pragma: no cover - overridden
        pass

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None
        if self.started is not None and self.finished_at is not None:
            latency = self.finished_at - self.started
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=self.bytes or None)

    def failure_exception(self):
        local = self.reason is not None
        if self.outcome is None:
            # SGLang all-reduces polls: another TP rank failed this room. Our peer rank is told.
            self._fail("failed on another TP rank", tell_peer=True)
        raise KvlinkTransferError(self.bootstrap_room,
                                  self.reason if local else "failed on another TP rank", is_from_another_rank=not local)


class KvlinkKVSender(_Room, BaseKVSender):
    """Prefill side of one room: holds each chunk for the decode that asked, and announces it."""

    def __init__(self, mgr: KvlinkKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        _Room.__init__(self, mgr, int(bootstrap_room))
        self.bootstrap_addr = bootstrap_addr
        self.want: Optional[Dict[str, Any]] = None
        self.reader: Optional[str] = None
        self.num_pages: Optional[int] = None
        self.aux_index: Optional[int] = None
        self.sent_pages = 0
        self.chunks = 0
        self.last_sent = False
        self.created = time.monotonic()
        self.waiting_since: Optional[float] = None
        room = self.bootstrap_room
        old = mgr.senders.get(room)
        if old is not None and old is not self:
            old._fail("a new sender took over the room", tell_peer=True)
        mgr.senders[room] = self
        # A new attempt at the room: an earlier sender's give-up does not apply to it.
        mgr.aborted.pop(room, None)
        if room in mgr.early_wants:
            m, sender_id = mgr.early_wants.pop(room)
            self._on_want(m, sender_id)

    def _on_want(self, m: Dict[str, Any], sender_id: str) -> None:
        if self.want is not None or self.outcome is not None:
            if self.outcome == KVPoll.Failed or self.want["nonce"] != m["nonce"]:
                why = self.reason if self.outcome == KVPoll.Failed else "another attempt holds the room"
                self.kv_mgr.send(m["addr"], wire.abort(self.bootstrap_room, m["nonce"], why or "failed"))
            return
        self.want, self.reader = m, sender_id
        self.kv_mgr.req_to_decode_prefix_len[self.bootstrap_room] = m["prefix"]

    def _on_peer_abort(self, reason: str, sender_id: str) -> None:
        if self.reader is None or sender_id == self.reader:
            self._fail(f"decode aborted: {reason}")

    def poll(self) -> int:
        self.kv_mgr.pump()
        if self.outcome is not None:
            return self.outcome
        now = time.monotonic()
        if self.want is None:
            if now - self.created > self.kv_mgr.bootstrap_timeout:
                self._fail(f"no decode asked for room {self.bootstrap_room} within "
                           f"{self.kv_mgr.bootstrap_timeout:.0f} s (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)",
                           tell_peer=True)
                return KVPoll.Failed
            return KVPoll.Bootstrapping
        if self.chunks == 0 and self.num_pages is not None:
            # As SGLang's own backends: the clock starts at the first poll after init().
            if self.waiting_since is None:
                self.waiting_since = now
            elif now - self.waiting_since > self.kv_mgr.waiting_timeout:
                self._fail(f"no KV chunk was sent within {self.kv_mgr.waiting_timeout:.0f} s "
                           "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT)", tell_peer=True)
                return KVPoll.Failed
        if not self.last_sent:
            return KVPoll.WaitingForInput if self.chunks == 0 else KVPoll.Transferring
        return KVPoll.Transferring if self.out else KVPoll.Success

    def poll_pp_consensus(self) -> int:
        return self.poll()

    def pop_decode_prefix_len(self) -> int:
        return self.kv_mgr.req_to_decode_prefix_len.pop(self.bootstrap_room, 0)

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.num_pages = int(num_kv_indices)
        self.aux_index = None if aux_index is None else int(aux_index)
        if self.want is not None and self.want["pages"] != self.num_pages and self.outcome is None:
            self._fail(f"the prefill sends {self.num_pages} pages, the decode expects {self.want['pages']}",
                       tell_peer=True)

    def get_max_transfer_tokens(self) -> Optional[int]:
        return None

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # A last chunk without pages still concludes the room (aux row, states).
        return num_pages > 0 or last_chunk

    def mark_prefill_complete(self) -> None:
        pass

    def send(self, kv_indices: Any, state_indices: Optional[List] = None,
             num_kv_tokens: Optional[int] = None, **_: Any) -> None:
        # With overlap scheduling SGLang may hand over pages whose KV the previous forward is
        # still writing, with an event to wait on first.
        event = getattr(self, "_early_send_wait_event", None)
        if event is not None:
            event.synchronize()
            self._early_send_wait_event = None
        if self.outcome is not None or self.want is None or self.num_pages is None:
            return
        mgr, room = self.kv_mgr, self.bootstrap_room
        pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        first = self.sent_pages
        self.sent_pages += len(pages)
        last = self.sent_pages >= self.num_pages
        if self.sent_pages > self.num_pages:
            return self._fail(f"{self.sent_pages} pages sent, {self.num_pages} announced", tell_peer=True)
        if self.started is None:
            self.started = time.monotonic()
        # One hold and one message per part: a message names at most MAX_PAGES_PER_MESSAGE pages.
        step = wire.MAX_PAGES_PER_MESSAGE
        parts = [pages[i:i + step] for i in range(0, len(pages), step)] or [[]]
        for n, part in enumerate(parts):
            part_last = last and n == len(parts) - 1
            rid = f"sgl{room}.{self.want['nonce']:x}.c{self.chunks}"
            self.chunks += 1
            spaces = []
            try:
                if part:
                    mgr.kv.hold_blocks(rid, part, reader=self.reader)
                    self._track(rid, "kv")
                    self.bytes += len(part) * sum(int(x) for x in mgr.kv_args.kv_item_lens)
                if part_last:
                    spaces = self._hold_spaces(state_indices)
            except kvlink.KvlinkError as e:
                return self._fail(f"holding chunk {self.chunks - 1}: {e}", tell_peer=True)
            body = wire.chunk(room, self.want["nonce"], rid, first, part, part_last, spaces)
            if not mgr.send(self.want["addr"], body):
                return self._fail(f"could not announce chunk {self.chunks - 1} to the decode", tell_peer=True)
            first += len(part)
        self.last_sent = last
        self._progress()

    def _hold_spaces(self, state_indices: Optional[List]) -> List[Dict[str, Any]]:
        mgr, room, want = self.kv_mgr, self.bootstrap_room, self.want
        spaces = []
        if want["aux"] and self.aux_index is not None and mgr.aux is not None:
            rid = f"sgl{room}.{want['nonce']:x}.aux"
            mgr.aux.hold_blocks(rid, [self.aux_index], reader=want["readers"]["aux"])
            self._track(rid, "aux")
            self.bytes += sum(int(x) for x in mgr.kv_args.aux_item_lens)
            spaces.append({"space": "aux", "addr": mgr.aux.handshake_address, "id": rid, "indices": [self.aux_index]})
        for i, idx in enumerate(state_indices or []):
            if idx is None or i >= len(want["states"]) or want["states"][i] == 0:
                continue
            engine = mgr.states[i] if i < len(mgr.states) else None
            if engine is None:
                raise kvlink.InvalidArgument(f"state type {i} has no buffers on this prefill")
            indices = [int(x) for x in np.asarray(idx).reshape(-1)]
            rid = f"sgl{room}.{want['nonce']:x}.s{i}"
            engine.hold_blocks(rid, indices, reader=want["readers"]["states"][i])
            self._track(rid, f"s{i}")
            spaces.append({"space": i, "addr": engine.handshake_address, "id": rid, "indices": indices})
        return spaces

    def _progress(self) -> None:
        if self.outcome is None and self.last_sent and not self.out:
            self.outcome = KVPoll.Success
            self.finished_at = time.monotonic()

    def _drop_out(self) -> None:
        for rid, space in list(self.out.items()):
            e = self._engine(space)
            if e is not None:
                e.release(rid)
            self.kv_mgr.owners.pop(rid, None)
        self.out.clear()

    def _tell_peer_abort(self, reason: str) -> None:
        if self.want is not None:
            self.kv_mgr.send(self.want["addr"], wire.abort(self.bootstrap_room, self.want["nonce"], reason))
        else:
            _remember(self.kv_mgr.aborted, self.bootstrap_room, reason)

    def failure_exception(self):
        # SGLang's prefill scheduler does not clear() a failed sender: it clears itself.
        try:
            _Room.failure_exception(self)
        finally:
            self.clear()

    def clear(self) -> None:
        self._drop_out()
        if self.kv_mgr.senders.get(self.bootstrap_room) is self:
            del self.kv_mgr.senders[self.bootstrap_room]
        self.kv_mgr.req_to_decode_prefix_len.pop(self.bootstrap_room, None)

    def abort(self) -> None:
        self._fail("Aborted by AbortReq.", tell_peer=True)
        # The request may be dropped without another poll or clear().
        self.clear()


class KvlinkKVReceiver(_Room, BaseKVReceiver):
    """Decode side of one room: asks its prefill rank, then reads every announced chunk into its
    own pages, and the aux row and state indices into theirs."""

    def __init__(self, mgr: KvlinkKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
        _Room.__init__(self, mgr, int(bootstrap_room or 0))
        self.bootstrap_addr = bootstrap_addr
        self.require_staging = False
        self.abort_notified = False
        self.route: Optional[Dict[str, Any]] = None
        self.local_pages: Optional[List[int]] = None
        self.aux_index: Optional[int] = None
        self.state_indices: List[Optional[List[int]]] = []
        self.next_page = 0
        self.chunks = 0
        self.last_seen = False
        self.asked_at: Optional[float] = None
        self.chunk_at: Optional[float] = None
        # This attempt at the room: echoed by the prefill, part of every request id.
        self.nonce = random.getrandbits(63)
        self.cancelled: List[str] = []
        old = mgr.receivers.get(self.bootstrap_room)
        if old is not None and old is not self:
            old._fail("a new receiver took over the room")
        mgr.receivers[self.bootstrap_room] = self

    def init(self, prefill_dp_rank: int) -> None:
        try:
            self.route = self.kv_mgr.route(self.bootstrap_addr, int(prefill_dp_rank))
        except ValueError as e:
            self._fail(str(e))

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None,
                      state_indices: Optional[List] = None, decode_prefix_len: Optional[int] = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE, **_: Any) -> None:
        if self.outcome is not None or self.route is None:
            return
        if destination != KVTransferDestination.DEVICE:
            return self._fail("kvlink receives into the decode's KV pool only (no host destination)")
        mgr = self.kv_mgr
        self.local_pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        self.aux_index = None if aux_index is None else int(aux_index)
        self.state_indices = [None if s is None else [int(x) for x in np.asarray(s).reshape(-1)]
                              for s in (state_indices or [])]
        counts = [0 if s is None or i >= len(mgr.states) or mgr.states[i] is None else len(s)
                  for i, s in enumerate(self.state_indices)]
        readers = {"aux": mgr.aux.engine_id if mgr.aux is not None else None,
                   "states": [mgr.states[i].engine_id if c else mgr.kv.engine_id for i, c in enumerate(counts)]}
        self.asked_at = time.monotonic()
        mgr.send(self.route["addr"], wire.want(
            self.bootstrap_room, self.nonce, mgr.kv.handshake_address, len(self.local_pages), int(decode_prefix_len or 0),
            self.aux_index is not None and mgr.aux is not None, counts, readers))

    def _on_chunk(self, m: Dict[str, Any], sender_id: str) -> None:
        if self.outcome is not None or self.local_pages is None:
            return
        if sender_id != self.route["engine_id"]:
            self.kv_mgr._bad(sender_id, f"chunk for room {self.bootstrap_room} from an engine other than "
                                        f"its prefill {self.route['engine_id']}")
            return
        pages, first = m["pages"], m["first"]
        if first != self.next_page or first + len(pages) > len(self.local_pages):
            return self._fail(f"chunk {self.chunks} covers pages [{first}, {first + len(pages)}) after "
                              f"{self.next_page} of {len(self.local_pages)}", tell_peer=True)
        mgr, room = self.kv_mgr, self.bootstrap_room
        if self.started is None:
            self.started = time.monotonic()
        self.chunk_at = time.monotonic()
        peer = self.route["addr"]
        try:
            if pages:
                rid = f"sgl{room}.{self.nonce:x}.c{self.chunks}"
                mgr.kv.read_blocks(peer, rid, self.local_pages[first:first + len(pages)], pages,
                                   remote_request_id=m["id"])
                self._track(rid, "kv")
            self.chunks += 1
            self.next_page = first + len(pages)
            if m["last"]:
                if self.next_page != len(self.local_pages):
                    return self._fail(f"the prefill sent {self.next_page} pages, this decode expects "
                                      f"{len(self.local_pages)}", tell_peer=True)
                self._read_spaces(m["spaces"])
                self.last_seen = True
        except (kvlink.KvlinkError, ValueError) as e:
            return self._fail(f"reading chunk {self.chunks}: {e}", tell_peer=True)
        self._progress()

    def _read_spaces(self, spaces: List[Dict[str, Any]]) -> None:
        mgr, room = self.kv_mgr, self.bootstrap_room
        for s in spaces:
            if s["space"] == "aux":
                if self.aux_index is None or mgr.aux is None or len(s["indices"]) != 1:
                    raise ValueError("an aux row this decode did not ask for")
                rid = f"sgl{room}.{self.nonce:x}.aux"
                mgr.aux.read_blocks(s["addr"], rid, [self.aux_index], s["indices"], remote_request_id=s["id"])
                self._track(rid, "aux")
            else:
                i = s["space"]
                local = self.state_indices[i] if i < len(self.state_indices) else None
                engine = mgr.states[i] if i < len(mgr.states) else None
                if local is None or engine is None or len(local) != len(s["indices"]):
                    raise ValueError(f"state type {i}: the prefill sent {len(s['indices'])} indices, "
                                     f"this decode expects {0 if local is None else len(local)}")
                rid = f"sgl{room}.{self.nonce:x}.s{i}"
                engine.read_blocks(s["addr"], rid, local, s["indices"], remote_request_id=s["id"])
                self._track(rid, f"s{i}")
        if self.aux_index is not None and mgr.aux is not None and not any(s["space"] == "aux" for s in spaces):
            raise ValueError("the prefill sent no aux row")
        got = {s["space"] for s in spaces}
        for i, local in enumerate(self.state_indices):
            if local and i < len(mgr.states) and mgr.states[i] is not None and i not in got:
                raise ValueError(f"the prefill sent no indices of state type {i}")

    def _on_peer_abort(self, reason: str, sender_id: str) -> None:
        if self.route is not None and sender_id == self.route["engine_id"]:
            self._fail(f"prefill aborted: {reason}")

    def poll(self) -> int:
        self.kv_mgr.pump()
        if self.outcome is not None:
            return self.outcome
        if self.route is None:
            return KVPoll.Bootstrapping
        if self.asked_at is None:
            return KVPoll.WaitingForInput
        now = time.monotonic()
        since = self.chunk_at or self.asked_at
        if not self.last_seen and now - since > self.kv_mgr.waiting_timeout:
            self._fail(f"no KV chunk from the prefill for {self.kv_mgr.waiting_timeout:.0f} s "
                       "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT)", tell_peer=True)
            return KVPoll.Failed
        return KVPoll.WaitingForInput if self.chunks == 0 else KVPoll.Transferring

    def _done(self, rid: str) -> None:
        self.out.pop(rid, None)
        self._progress()

    def _progress(self) -> None:
        if self.outcome is None and self.last_seen and not self.out:
            self.outcome = KVPoll.Success
            self.finished_at = time.monotonic()

    def _drop_out(self) -> None:
        for rid, space in list(self.out.items()):
            e = self._engine(space)
            if e is not None and e.cancel(rid):
                # Its last writes may still land: clear() waits for its report.
                self.kv_mgr.draining[rid] = e
                self.cancelled.append(rid)
            self.kv_mgr.owners.pop(rid, None)
        self.out.clear()

    def _fail(self, reason: str, tell_peer: bool = False) -> None:
        if self.outcome is None and not reason.startswith("Aborted by AbortReq"):
            # The prefill may have restarted elsewhere behind the same bootstrap address.
            self.kv_mgr.forget_route(self.bootstrap_addr)
        _Room._fail(self, reason, tell_peer)

    def _tell_peer_abort(self, reason: str) -> None:
        if self.route is not None:
            self.kv_mgr.send(self.route["addr"], wire.abort(self.bootstrap_room, self.nonce, reason))

    def clear(self) -> None:
        """Ends the room; returns once no read of it can write into the decode's pages any more
        (SGLang reuses them right after)."""
        if self.outcome is None:
            self._fail("cleared before it finished", tell_peer=True)
        self._drop_out()
        if self.cancelled:
            self.kv_mgr.drain(self.cancelled)
            self.cancelled = []
        if self.kv_mgr.receivers.get(self.bootstrap_room) is self:
            del self.kv_mgr.receivers[self.bootstrap_room]

    def abort(self) -> None:
        self._fail("Aborted by AbortReq.", tell_peer=True)

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """The prefill is told at ``abort()``, and ``clear()`` returns only once every cancelled
        read of the room was reported, so no write lands in its pages afterwards."""
