"""The decode side of a room in kvlink's SGLang backend (``KvlinkKVReceiver``); the flow is in
``kvlink.sglang.conn``."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll, KVTransferDestination

import kvlink
from kvlink.sglang import states, wire
from kvlink.sglang.manager import KvlinkKVManager
from kvlink.sglang.room import Room

# Most chunk messages one prefill rank may have announced ahead of the others a rank reads.
_MAX_QUEUED_CHUNKS = 1024


class KvlinkKVReceiver(Room, BaseKVReceiver):
    """Decode side of one room: asks the prefill ranks it reads (one, or several when the
    prefill's attention TP is larger), then reads every chunk they all announced into its own
    pages (its share of their heads), and the aux row and state indices of the first one into
    theirs."""

    def __init__(self, mgr: KvlinkKVManager, bootstrap_addr: str, bootstrap_room: int | None = None):
        Room.__init__(self, mgr, int(bootstrap_room or 0))
        self.bootstrap_addr = bootstrap_addr
        self.require_staging = False
        self.abort_notified = False
        self.route: dict[str, Any] | None = None
        self.local_pages: list[int] | None = None
        self.aux_index: int | None = None
        self.state_indices: list[list[int] | None] = []
        self.state_rows: list[tuple] = []
        self.next_page = 0
        self.chunks = 0
        self.last_seen = False
        self.asked_at: float | None = None
        self.chunk_at: float | None = None
        # This attempt at the room: echoed by the prefill, part of every request id.
        self.nonce = random.getrandbits(63)
        self.cancelled: list[str] = []
        # source prefill engine id -> its chunk messages not read yet
        self.inbox: dict[str, list[dict[str, Any]]] = {}
        old = mgr.receivers.get(self.bootstrap_room)
        if old is not None and old is not self:
            old._fail("a new receiver took over the room")
        mgr.receivers[self.bootstrap_room] = self

    def init(self, prefill_dp_rank: int) -> None:
        try:
            self.route = self.kv_mgr.route(self.bootstrap_addr, int(prefill_dp_rank))
        except ValueError as e:
            # The prefill cannot pair with this decode (or is not known yet): what was learned
            # of it stays, so the next rooms fail with the same reason, not an unknown prefill.
            Room._fail(self, str(e))

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        **_: Any,
    ) -> None:
        route = self.route
        if self.outcome is not None or route is None:
            return
        if destination != KVTransferDestination.DEVICE:
            return self._fail("kvlink receives into the decode's KV pool only (no host destination)")
        mgr = self.kv_mgr
        self.local_pages = local = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        self.aux_index = None if aux_index is None else int(aux_index)
        self.state_indices = [
            None if s is None else [int(x) for x in np.asarray(s).reshape(-1)] for s in (state_indices or [])
        ]
        try:
            # Per state type, the rows its payload names (and a dsa_tail ring's size).
            self.state_rows = [
                states.rows(mgr.state_types[i], s)
                if s is not None and i < len(mgr.states) and mgr.states[i] is not None
                else ([], None)
                for i, s in enumerate(self.state_indices)
            ]
        except ValueError as e:
            return self._fail(f"this decode's state indices: {e}", tell_peer=False)
        counts = [len(r) for r, _ in self.state_rows]
        readers = {
            "aux": mgr.aux.engine_id if mgr.aux is not None else None,
            # A state type with rows has its engine (rows are read only for those).
            "states": [_engine_id(mgr.states[i]) if c else mgr.kv.engine_id for i, c in enumerate(counts)],
        }
        self.asked_at = time.monotonic()
        aux = self.aux_index is not None and mgr.aux is not None
        self.inbox = {route["engine_ids"][s]: [] for s in route["sources"]}
        for j, s in enumerate(route["sources"]):
            # The first source also sends the aux row, and the states when they are whole on
            # every rank; between attention TP sizes each source holds its heads of them.
            body = wire.want(
                self.bootstrap_room,
                self.nonce,
                mgr.kv.handshake_address,
                len(local),
                int(decode_prefix_len or 0),
                aux and j == 0,
                counts if j == 0 or _split(route, mgr) else [0] * len(counts),
                readers,
                (mgr.tp_rank, mgr.tp_size),
            )
            if not mgr.send(route["addrs"][s], body):
                return self._fail(f"could not ask prefill rank {s} for the room", tell_peer=True)

    def _on_chunk(self, m: dict[str, Any], sender_id: str) -> None:
        if self.outcome is not None or self.local_pages is None:
            return
        queue = self.inbox.get(sender_id)
        if queue is None:
            self.kv_mgr._bad(
                sender_id,
                f"chunk for room {self.bootstrap_room} from an engine other than "
                f"its prefill ranks {sorted(self.inbox)}",
            )
            return
        if len(queue) >= _MAX_QUEUED_CHUNKS:
            # A prefill rank far ahead of the others (or a hostile one): the queue stays bounded.
            return self._fail(
                f"prefill engine {sender_id} announced {len(queue)} chunks the other prefill ranks have not",
                tell_peer=True,
            )
        queue.append(m)
        self.chunk_at = time.monotonic()
        while self.outcome is None and all(self.inbox.values()):
            heads = [q.pop(0) for q in self.inbox.values()]
            self._read_chunk(heads)

    def _read_chunk(self, heads: list[dict[str, Any]]) -> None:
        """Reads one chunk every source announced (``heads``, in source order): the same pages
        under the same id and token on each."""
        # _on_chunk passes chunks on only after send_metadata set both.
        local, route = self.local_pages, self.route
        assert local is not None and route is not None
        m = heads[0]
        for other in heads[1:]:
            if (other["id"], other["hold"], other["first"], other["pages"], other["last"]) != (
                m["id"],
                m["hold"],
                m["first"],
                m["pages"],
                m["last"],
            ):
                return self._fail(
                    f"the prefill ranks announced chunk {self.chunks} differently ({m['id']} "
                    f"pages {m['first']}+{len(m['pages'])}, {other['id']} pages {other['first']}+"
                    f"{len(other['pages'])})",
                    tell_peer=True,
                )
        if m["last"] and _split(route, self.kv_mgr):
            theirs = [_state_spaces(h) for h in heads]
            if any(t != theirs[0] for t in theirs[1:]):
                return self._fail(
                    f"the prefill ranks announced their state rows differently ({theirs})", tell_peer=True
                )
        pages, first = m["pages"], m["first"]
        if first != self.next_page or first + len(pages) > len(local):
            return self._fail(
                f"chunk {self.chunks} covers pages [{first}, {first + len(pages)}) after "
                f"{self.next_page} of {len(local)}",
                tell_peer=True,
            )
        if self.started is None:
            self.started = time.monotonic()
        try:
            # Every read of the chunk is planned (and the message checked) before the first is
            # issued: a chunk refused halfway would leave reads running that the prefill then
            # reports sent, for a room this decode has failed.
            reads = self._plan_chunk(m)
            for engine, peer, rid, space, mine, theirs, s in reads:
                engine.read_blocks(peer, rid, mine, theirs, remote_request_id=s["id"], hold=s["hold"])
                self._track(rid, space)
        except (kvlink.KvlinkError, ValueError) as e:
            return self._fail(f"reading chunk {self.chunks}: {e}", tell_peer=True)
        self.chunks += 1
        self.next_page = first + len(pages)
        self.last_seen = bool(m["last"])
        self._progress()

    def _plan_chunk(self, m: dict[str, Any]) -> list[tuple]:
        """The reads of one chunk: ``(engine, peer, request id, index space, local, remote,
        announcement)`` each; raises ``ValueError`` for a chunk this decode cannot take."""
        pages, first = m["pages"], m["first"]
        local, route = self.local_pages, self.route
        assert local is not None and route is not None  # as in _read_chunk
        tag = f"sgl{self.bootstrap_room}.{self.nonce:x}"
        reads = []
        if pages:
            reads.append(
                (
                    self.kv_mgr.kv,
                    route["addrs"],
                    f"{tag}.c{self.chunks}",
                    "kv",
                    local[first : first + len(pages)],
                    pages,
                    m,
                )
            )
        if m["last"]:
            if first + len(pages) != len(local):
                raise ValueError(f"the prefill sent {first + len(pages)} pages, this decode expects {len(local)}")
            reads += self._plan_spaces(m["spaces"], tag)
        return reads

    def _plan_spaces(self, spaces: list[dict[str, Any]], tag: str) -> list[tuple]:
        mgr, reads = self.kv_mgr, []
        for s in spaces:
            if s["space"] == "aux":
                if self.aux_index is None or mgr.aux is None or len(s["indices"]) != 1:
                    raise ValueError("an aux row this decode did not ask for")
                reads.append((mgr.aux, s["addr"], f"{tag}.aux", "aux", [self.aux_index], s["indices"], s))
            else:
                i = s["space"]
                local, ring = self.state_rows[i] if i < len(self.state_rows) else ([], None)
                engine = mgr.states[i] if i < len(mgr.states) else None
                if not local or engine is None:
                    raise ValueError(
                        f"state type {i}: the prefill sent {len(s['indices'])} indices, this decode asked for none"
                    )
                mine, theirs = states.pair(mgr.state_types[i], s["indices"], local, s["ring"], ring)
                if not mine:
                    raise ValueError(f"{mgr.state_types[i]} state: the prefill sent no rows to read")
                # Between attention TP sizes, its heads from the ranks it pairs with.
                assert self.route is not None  # set before any chunk is read
                peer = self.route["state_addrs"][i] if _split(self.route, mgr) else s["addr"]
                reads.append((engine, peer, f"{tag}.s{i}", f"s{i}", mine, theirs, s))
        if self.aux_index is not None and mgr.aux is not None and not any(s["space"] == "aux" for s in spaces):
            raise ValueError("the prefill sent no aux row")
        got = {s["space"] for s in spaces}
        for i, (local, _) in enumerate(self.state_rows):
            if local and i not in got:
                raise ValueError(f"the prefill sent no indices of state type {i} ({mgr.state_types[i]})")
        return reads

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
            self._fail(
                f"no KV chunk from the prefill for {self.kv_mgr.waiting_timeout:.0f} s "
                "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT)",
                tell_peer=True,
            )
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
        Room._fail(self, reason, tell_peer)

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

    @property
    def bootstrap_infos(self) -> list[int] | None:
        """The prefill ranks this rank reads (SGLang counts them for its deferred release)."""
        return None if self.route is None else list(self.route["sources"])

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """The prefill ranks were told when the room failed (or are told now), and ``clear()``
        returns only once every cancelled read of the room was reported (with SGLang's
        deferred release, ``is_abort_release_safe`` says so first), so no write lands in its
        pages afterwards."""
        if self.outcome is None:
            self._fail("aborted by the decode", tell_peer=True)
        self.abort_notified = True


def _engine_id(engine: kvlink.Engine | None) -> str:
    """The id of a state type's engine: one with rows to read always has one (the manager
    makes an engine for each state type that has a buffer)."""
    if engine is None:
        raise RuntimeError("kvlink: a state type with rows to read has no engine")
    return engine.engine_id


def _split(route: dict[str, Any], mgr: Any) -> bool:
    """Whether the prefill's attention TP size differs from this decode's: its state types are
    then read by head from every prefill rank this rank pairs with (the manager refused the
    route for types it cannot split)."""
    return len(route["addrs"]) != mgr.tp_size


def _state_spaces(chunk: dict[str, Any]) -> list[tuple]:
    """What a last chunk says of its state rows, to compare between prefill ranks."""
    return [(s["space"], s["id"], s["hold"], s["indices"]) for s in chunk["spaces"] if s["space"] != "aux"]
