"""The prefill side of a room in kvlink's SGLang backend (``KvlinkKVSender``); the flow is in
``kvlink.sglang.conn``."""

from __future__ import annotations

import hashlib
import time
from collections import deque
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVSender, KVPoll

import kvlink
from kvlink.sglang import states, wire
from kvlink.sglang.manager import KvlinkKVManager, _remember
from kvlink.sglang.room import Room


def _hold_token(rid: str) -> int:
    """The hold token of request ``rid``: the same on every prefill rank a decode rank reads
    (its one read names one token), and ``rid`` names the room, the decode's attempt and the
    chunk, so no two holds of one engine share it."""
    return (int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)) or 1


class KvlinkKVSender(Room, BaseKVSender):
    """Prefill side of one room: holds each chunk for every decode rank that reads this rank
    (one, or several when the decode's attention TP is larger), and announces it to each."""

    def __init__(
        self,
        mgr: KvlinkKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ):
        Room.__init__(self, mgr, int(bootstrap_room))
        self.bootstrap_addr = bootstrap_addr
        # decode KV engine id -> its want, and how many decode ranks read this rank
        self.wants: dict[str, dict[str, Any]] = {}
        self.expected: int | None = None
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.sent_pages = 0
        self.chunks = 0
        self.last_sent = False
        # chunks handed over before their GPU event completed: (event, pages, state indices)
        self.queued: deque[tuple] = deque()
        self.created = time.monotonic()
        self.waiting_since: float | None = None
        room = self.bootstrap_room
        old = mgr.senders.get(room)
        if old is not None and old is not self:
            old._fail("a new sender took over the room", tell_peer=True)
        mgr.senders[room] = self
        # A new attempt at the room: an earlier sender's give-up does not apply to it.
        mgr.aborted.pop(room, None)
        if mgr.dp_size > 1 and room % mgr.dp_size != mgr.dp_rank:
            # As SGLang's own backends: a decode looks for the room at DP rank room % DP size.
            self._fail(
                f"room {room} reached prefill DP rank {mgr.dp_rank}, but decodes look for it at DP rank "
                f"{room % mgr.dp_size} (room % {mgr.dp_size}): route by bootstrap room"
            )
        for m, sender_id in mgr.early_wants.pop(room, []):
            self._on_want(m, sender_id)

    @property
    def want(self) -> dict[str, Any] | None:
        """The first decode rank's want, once every decode rank reading this rank asked."""
        return next(iter(self.wants.values())) if self.ready else None

    @property
    def ready(self) -> bool:
        return self.expected is not None and len(self.wants) >= self.expected

    def _on_want(self, m: dict[str, Any], sender_id: str) -> None:
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
        size = m["tp"][1]
        self.expected = size // self.kv_mgr.tp_size if size > self.kv_mgr.tp_size else 1
        self.kv_mgr.req_to_decode_prefix_len[room] = m["prefix"]

    def _mismatch(self, m: dict[str, Any]) -> str | None:
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
            if w["tp"] == (rank, size):
                return f"two decode engines ask for room {self.bootstrap_room} as decode rank {rank} of {size}"
            if (w["tp"][1], w["pages"], w["prefix"]) != (size, m["pages"], m["prefix"]):
                return (
                    f"decode ranks disagree on room {self.bootstrap_room}: rank {w['tp'][0]} of {w['tp'][1]} "
                    f"wants {w['pages']} pages after {w['prefix']}, rank {rank} of {size} {m['pages']} after "
                    f"{m['prefix']}"
                )
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
                self._fail(
                    f"{asked} asked for room {self.bootstrap_room} within "
                    f"{self.kv_mgr.bootstrap_timeout:.0f} s (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)",
                    tell_peer=True,
                )
                return KVPoll.Failed
            return KVPoll.Bootstrapping
        if self.chunks == 0 and self.num_pages is not None:
            # As SGLang's own backends: the clock starts at the first poll after init().
            if self.waiting_since is None:
                self.waiting_since = now
            elif now - self.waiting_since > self.kv_mgr.waiting_timeout:
                self._fail(
                    f"no KV chunk was sent within {self.kv_mgr.waiting_timeout:.0f} s "
                    "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT)",
                    tell_peer=True,
                )
                return KVPoll.Failed
        if not self.last_sent:
            return KVPoll.WaitingForInput if self.chunks == 0 else KVPoll.Transferring
        return KVPoll.Transferring if self.out else KVPoll.Success

    def poll_pp_consensus(self) -> int:
        return self.poll()

    def pop_decode_prefix_len(self) -> int:
        return self.kv_mgr.req_to_decode_prefix_len.pop(self.bootstrap_room, 0)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_pages = int(num_kv_indices)
        self.aux_index = None if aux_index is None else int(aux_index)
        for w in self.wants.values():
            if w["pages"] != self.num_pages and self.outcome is None:
                self._fail(f"the prefill sends {self.num_pages} pages, the decode expects {w['pages']}", tell_peer=True)

    def get_max_transfer_tokens(self) -> int | None:
        return None

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # A last chunk without pages still concludes the room (aux row, states).
        return num_pages > 0 or last_chunk

    def mark_prefill_complete(self) -> None:
        pass

    def send(
        self, kv_indices: Any, state_indices: list | None = None, num_kv_tokens: int | None = None, **_: Any
    ) -> None:
        # With overlap scheduling SGLang may hand over pages whose KV the previous forward is
        # still writing, with an event to wait for first: the chunk is held and announced once
        # the event completed (looked at from every poll), never by blocking the scheduler.
        event = getattr(self, "_early_send_wait_event", None)
        self._early_send_wait_event = None
        pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        kept = (
            None
            if state_indices is None
            else [None if s is None else np.asarray(s).reshape(-1).copy() for s in state_indices]
        )
        self.queued.append((event, pages, kept))
        self.flush()

    def flush(self) -> None:
        """Sends the chunks queued behind GPU events that have completed, in order."""
        while self.queued:
            event, pages, state_indices = self.queued[0]
            if event is not None and not event.query():
                self.kv_mgr.waiting_senders[self.bootstrap_room] = self
                return
            self.queued.popleft()
            self._send_now(pages, state_indices)
        self.kv_mgr.waiting_senders.pop(self.bootstrap_room, None)

    def _send_now(self, pages: list[int], state_indices: list | None) -> None:
        if self.outcome is not None or not self.ready or self.num_pages is None:
            return
        mgr = self.kv_mgr
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
        parts = [pages[i : i + step] for i in range(0, len(pages), step)] or [[]]
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

    def _announce(
        self,
        reader: str,
        want: dict[str, Any],
        k: int,
        first: int,
        part: list[int],
        last: bool,
        state_indices: list | None,
    ) -> bool:
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
        except (kvlink.KvlinkError, ValueError) as e:
            self._fail(f"holding chunk {k}: {e}", tell_peer=True)
            return False
        body = wire.chunk(room, want["nonce"], rid, first, part, last, spaces, hold)
        if not mgr.send(want["addr"], body):
            self._fail(f"could not announce chunk {k} to decode rank {want['tp'][0]}", tell_peer=True)
            return False
        return True

    def _hold_spaces(self, want: dict[str, Any], state_indices: list | None) -> list[dict[str, Any]]:
        mgr, room = self.kv_mgr, self.bootstrap_room
        spaces = []
        if want["aux"] and self.aux_index is not None and mgr.aux is not None:
            rid = f"sgl{room}.{want['nonce']:x}.aux"
            hold = mgr.aux.hold_blocks(rid, [self.aux_index], reader=want["readers"]["aux"])
            self._track(rid, "aux")
            self.bytes += sum(int(x) for x in mgr.kv_args.aux_item_lens)
            spaces.append(
                {
                    "space": "aux",
                    "addr": mgr.aux.handshake_address,
                    "id": rid,
                    "hold": hold,
                    "indices": [self.aux_index],
                }
            )
        for i, idx in enumerate(state_indices or []):
            if idx is None or i >= len(want["states"]) or want["states"][i] == 0:
                continue
            engine = mgr.states[i] if i < len(mgr.states) else None
            if engine is None:
                raise kvlink.InvalidArgument(f"state type {i} has no buffers on this prefill")
            indices, ring = states.rows(mgr.state_types[i], np.asarray(idx).reshape(-1))
            if not indices:
                continue
            rid = f"sgl{room}.{want['nonce']:x}.s{i}"
            # One token on every prefill rank: a decode of another attention TP size reads its
            # heads of the rows from several ranks in one read.
            hold = engine.hold_blocks(rid, indices, reader=want["readers"]["states"][i], token=_hold_token(rid))
            self._track(rid, f"s{i}")
            spaces.append(
                {
                    "space": i,
                    "addr": engine.handshake_address,
                    "id": rid,
                    "hold": hold,
                    "indices": indices,
                    "ring": ring,
                }
            )
        return spaces

    def _progress(self) -> None:
        if self.outcome is None and self.last_sent and not self.out:
            self.outcome = KVPoll.Success
            self.finished_at = time.monotonic()

    def _drop_out(self) -> None:
        """Ends the room's holds at once. A decode may be reading one (it was told): its read
        then fails at its confirmation, which only a hold that lasted the whole read gives, so
        the decode never reports the room received; the abort message tells it why."""
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
            Room.failure_exception(self)
        finally:
            self.clear()

    def clear(self) -> None:
        self._drop_out()
        self.queued.clear()
        for table in (self.kv_mgr.senders, self.kv_mgr.waiting_senders):
            if table.get(self.bootstrap_room) is self:
                del table[self.bootstrap_room]
        self.kv_mgr.req_to_decode_prefix_len.pop(self.bootstrap_room, None)

    def abort(self) -> None:
        self._fail("Aborted by AbortReq.", tell_peer=True)
        # The request may be dropped without another poll or clear().
        self.clear()
