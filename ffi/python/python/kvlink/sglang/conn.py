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

import hashlib
import logging
import random
import time
from typing import Any, Dict, List, Optional

import numpy as np

import kvlink
from kvlink.sglang import wire
from kvlink.sglang.manager import KvlinkKVManager, KvlinkTransferError, _remember
from sglang.srt.disaggregation.base.conn import (
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)

logger = logging.getLogger(__name__)

__all__ = ["KvlinkKVManager", "KvlinkKVReceiver", "KvlinkKVSender", "KvlinkTransferError"]


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


def _hold_token(rid: str) -> int:
    """The hold token of request ``rid``: the same on every prefill rank a decode rank reads
    (its one read names one token), and ``rid`` names the room, the decode's attempt and the
    chunk, so no two holds of one engine share it."""
    return (int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)) or 1


class KvlinkKVSender(_Room, BaseKVSender):
    """Prefill side of one room: holds each chunk for every decode rank that reads this rank
    (one, or several when the decode's attention TP is larger), and announces it to each."""

    def __init__(self, mgr: KvlinkKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        _Room.__init__(self, mgr, int(bootstrap_room))
        self.bootstrap_addr = bootstrap_addr
        # decode KV engine id -> its want, and how many decode ranks read this rank
        self.wants: Dict[str, Dict[str, Any]] = {}
        self.expected: Optional[int] = None
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
        if mgr.dp_size > 1 and room % mgr.dp_size != mgr.dp_rank:
            # As SGLang's own backends: a decode looks for the room at DP rank room % DP size.
            self._fail(f"room {room} reached prefill DP rank {mgr.dp_rank}, but decodes look for it at DP rank "
                       f"{room % mgr.dp_size} (room % {mgr.dp_size}): route by bootstrap room")
        for m, sender_id in mgr.early_wants.pop(room, []):
            self._on_want(m, sender_id)

    @property
    def want(self) -> Optional[Dict[str, Any]]:
        """The first decode rank's want, once every decode rank reading this rank asked."""
        return next(iter(self.wants.values())) if self.ready else None

    @property
    def ready(self) -> bool:
        return self.expected is not None and len(self.wants) >= self.expected

    def _on_want(self, m: Dict[str, Any], sender_id: str) -> None:
        room, known = self.bootstrap_room, self.wants.get(sender_id)
        if known is not None and known["nonce"] == m["nonce"] and self.outcome != KVPoll.Failed:
            return  # the same want again
        if self.outcome is not None or known is not None or self.ready:
            why = self.reason if self.outcome == KVPoll.Failed else "another attempt holds the room"
            self.kv_mgr.send(m["addr"], wire.abort(room, m["nonce"], why or "failed"))
            return
        why = self._mismatch(m)
        if why is not None:
            self.wants[sender_id] = m
            return self._fail(why, tell_peer=True)
        self.wants[sender_id] = m
        rank, size = m["tp"]
        self.expected = size // self.kv_mgr.tp_size if size > self.kv_mgr.tp_size else 1
        self.kv_mgr.req_to_decode_prefix_len[room] = m["prefix"]

    def _mismatch(self, m: Dict[str, Any]) -> Optional[str]:
        """Why want ``m`` cannot join this room's (a decode rank that does not read this rank,
        or one that disagrees with the decode ranks that asked before it), or None."""
        mgr, (rank, size) = self.kv_mgr, m["tp"]
        try:
            reads = mgr.tp_rank in kvlink.tp_sources(rank, size, mgr.tp_size)
        except kvlink.InvalidArgument as e:
            return f"decode attention TP {size}, prefill {mgr.tp_size}: {e}"
        if not reads:
            return f"decode rank {rank} of {size} does not read prefill rank {mgr.tp_rank} of {mgr.tp_size}"
        if self.num_pages is not None and m["pages"] != self.num_pages:
            return f"the prefill sends {self.num_pages} pages, the decode expects {m['pages']}"
        for w in self.wants.values():
            if (w["tp"][1], w["pages"], w["prefix"]) != (size, m["pages"], m["prefix"]) or w["tp"][0] == rank:
                return (f"decode ranks disagree on room {self.bootstrap_room}: rank {w['tp'][0]} of {w['tp'][1]} "
                        f"wants {w['pages']} pages after {w['prefix']}, rank {rank} of {size} {m['pages']} after "
                        f"{m['prefix']}")
        return None

    def _on_peer_abort(self, reason: str, sender_id: str) -> None:
        if not self.wants or sender_id in self.wants:
            self._fail(f"decode aborted: {reason}")

    def poll(self) -> int:
        self.kv_mgr.pump()
        if self.outcome is not None:
            return self.outcome
        now = time.monotonic()
        if not self.ready:
            if now - self.created > self.kv_mgr.bootstrap_timeout:
                asked = f"{len(self.wants)} of {self.expected} decode ranks" if self.wants else "no decode"
                self._fail(f"{asked} asked for room {self.bootstrap_room} within "
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
        for w in self.wants.values():
            if w["pages"] != self.num_pages and self.outcome is None:
                self._fail(f"the prefill sends {self.num_pages} pages, the decode expects {w['pages']}",
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
        if self.outcome is not None or not self.ready or self.num_pages is None:
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
        # One hold and one message per part and decode rank: a message names at most
        # MAX_PAGES_PER_MESSAGE pages.
        step = wire.MAX_PAGES_PER_MESSAGE
        parts = [pages[i:i + step] for i in range(0, len(pages), step)] or [[]]
        for n, part in enumerate(parts):
            part_last = last and n == len(parts) - 1
            k = self.chunks
            self.chunks += 1
            self.bytes += len(part) * sum(int(x) for x in mgr.kv_args.kv_item_lens)
            for reader, want in self.wants.items():
                if not self._announce(reader, want, k, first, part, part_last, state_indices):
                    return
            first += len(part)
        self.last_sent = last
        self._progress()

    def _announce(self, reader: str, want: Dict[str, Any], k: int, first: int, part: List[int], last: bool,
                  state_indices: Optional[List]) -> bool:
        """Holds part ``k`` for one decode rank (and with the last part its aux row and state
        indices) and tells it; False once the room failed."""
        mgr, room = self.kv_mgr, self.bootstrap_room
        rid = f"sgl{room}.{want['nonce']:x}.c{k}"
        spaces, hold = [], None
        try:
            if part:
                hold = mgr.kv.hold_blocks(rid, part, reader=reader, token=_hold_token(rid))
                self._track(rid, "kv")
            if last:
                spaces = self._hold_spaces(want, state_indices)
        except kvlink.KvlinkError as e:
            self._fail(f"holding chunk {k}: {e}", tell_peer=True)
            return False
        body = wire.chunk(room, want["nonce"], rid, first, part, last, spaces, hold)
        if not mgr.send(want["addr"], body):
            self._fail(f"could not announce chunk {k} to decode rank {want['tp'][0]}", tell_peer=True)
            return False
        return True

    def _hold_spaces(self, want: Dict[str, Any], state_indices: Optional[List]) -> List[Dict[str, Any]]:
        mgr, room = self.kv_mgr, self.bootstrap_room
        spaces = []
        if want["aux"] and self.aux_index is not None and mgr.aux is not None:
            rid = f"sgl{room}.{want['nonce']:x}.aux"
            hold = mgr.aux.hold_blocks(rid, [self.aux_index], reader=want["readers"]["aux"])
            self._track(rid, "aux")
            self.bytes += sum(int(x) for x in mgr.kv_args.aux_item_lens)
            spaces.append({"space": "aux", "addr": mgr.aux.handshake_address, "id": rid, "hold": hold,
                           "indices": [self.aux_index]})
        for i, idx in enumerate(state_indices or []):
            if idx is None or i >= len(want["states"]) or want["states"][i] == 0:
                continue
            engine = mgr.states[i] if i < len(mgr.states) else None
            if engine is None:
                raise kvlink.InvalidArgument(f"state type {i} has no buffers on this prefill")
            indices = [int(x) for x in np.asarray(idx).reshape(-1)]
            rid = f"sgl{room}.{want['nonce']:x}.s{i}"
            hold = engine.hold_blocks(rid, indices, reader=want["readers"]["states"][i])
            self._track(rid, f"s{i}")
            spaces.append({"space": i, "addr": engine.handshake_address, "id": rid, "hold": hold, "indices": indices})
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
        for want in self.wants.values():
            self.kv_mgr.send(want["addr"], wire.abort(self.bootstrap_room, want["nonce"], reason))
        if not self.ready:
            # Decode ranks that have not asked yet are answered when they do.
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
    """Decode side of one room: asks the prefill ranks it reads (one, or several when the
    prefill's attention TP is larger), then reads every chunk they all announced into its own
    pages (its share of their heads), and the aux row and state indices of the first one into
    theirs."""

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
        # source prefill engine id -> its chunk messages not read yet
        self.inbox: Dict[str, List[Dict[str, Any]]] = {}
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
        aux = self.aux_index is not None and mgr.aux is not None
        self.inbox = {self.route["engine_ids"][s]: [] for s in self.route["sources"]}
        for j, s in enumerate(self.route["sources"]):
            # The first source also sends the aux row and the states (whole on every rank).
            body = wire.want(self.bootstrap_room, self.nonce, mgr.kv.handshake_address, len(self.local_pages),
                             int(decode_prefix_len or 0), aux and j == 0, counts if j == 0 else [0] * len(counts),
                             readers, (mgr.tp_rank, mgr.tp_size))
            if not mgr.send(self.route["addrs"][s], body):
                return self._fail(f"could not ask prefill rank {s} for the room", tell_peer=True)

    def _on_chunk(self, m: Dict[str, Any], sender_id: str) -> None:
        if self.outcome is not None or self.local_pages is None:
            return
        queue = self.inbox.get(sender_id)
        if queue is None:
            self.kv_mgr._bad(sender_id, f"chunk for room {self.bootstrap_room} from an engine other than "
                                        f"its prefill ranks {sorted(self.inbox)}")
            return
        queue.append(m)
        self.chunk_at = time.monotonic()
        while self.outcome is None and all(self.inbox.values()):
            heads = [q.pop(0) for q in self.inbox.values()]
            self._read_chunk(heads)

    def _read_chunk(self, heads: List[Dict[str, Any]]) -> None:
        """Reads one chunk every source announced (``heads``, in source order): the same pages
        under the same id and token on each."""
        m = heads[0]
        for other in heads[1:]:
            if (other["id"], other["hold"], other["first"], other["pages"], other["last"]) != (
                    m["id"], m["hold"], m["first"], m["pages"], m["last"]):
                return self._fail(f"the prefill ranks announced chunk {self.chunks} differently ({m['id']} "
                                  f"pages {m['first']}+{len(m['pages'])}, {other['id']} pages {other['first']}+"
                                  f"{len(other['pages'])})", tell_peer=True)
        pages, first = m["pages"], m["first"]
        if first != self.next_page or first + len(pages) > len(self.local_pages):
            return self._fail(f"chunk {self.chunks} covers pages [{first}, {first + len(pages)}) after "
                              f"{self.next_page} of {len(self.local_pages)}", tell_peer=True)
        mgr, room = self.kv_mgr, self.bootstrap_room
        if self.started is None:
            self.started = time.monotonic()
        peer = self.route["addrs"]
        try:
            if pages:
                rid = f"sgl{room}.{self.nonce:x}.c{self.chunks}"
                mgr.kv.read_blocks(peer, rid, self.local_pages[first:first + len(pages)], pages,
                                   remote_request_id=m["id"], hold=m["hold"])
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
                mgr.aux.read_blocks(s["addr"], rid, [self.aux_index], s["indices"], remote_request_id=s["id"],
                                    hold=s["hold"])
                self._track(rid, "aux")
            else:
                i = s["space"]
                local = self.state_indices[i] if i < len(self.state_indices) else None
                engine = mgr.states[i] if i < len(mgr.states) else None
                if local is None or engine is None or len(local) != len(s["indices"]):
                    raise ValueError(f"state type {i}: the prefill sent {len(s['indices'])} indices, "
                                     f"this decode expects {0 if local is None else len(local)}")
                rid = f"sgl{room}.{self.nonce:x}.s{i}"
                engine.read_blocks(s["addr"], rid, local, s["indices"], remote_request_id=s["id"], hold=s["hold"])
                self._track(rid, f"s{i}")
        if self.aux_index is not None and mgr.aux is not None and not any(s["space"] == "aux" for s in spaces):
            raise ValueError("the prefill sent no aux row")
        got = {s["space"] for s in spaces}
        for i, local in enumerate(self.state_indices):
            if local and i < len(mgr.states) and mgr.states[i] is not None and i not in got:
                raise ValueError(f"the prefill sent no indices of state type {i}")

    def _on_peer_abort(self, reason: str, sender_id: str) -> None:
        if sender_id in self.inbox:
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
            for s in self.route["sources"]:
                self.kv_mgr.send(self.route["addrs"][s], wire.abort(self.bootstrap_room, self.nonce, reason))

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
