"""What a prefill sender and a decode receiver of kvlink's SGLang backend share: a room's
outcome and reason, the requests it has out on kvlink's engines, its metric and SGLang's
failure exception."""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferMetric

import kvlink
from kvlink.sglang.manager import KvlinkKVManager, KvlinkTransferError

logger = logging.getLogger(__name__)


class Room:
    """What both sides share: the outcome, its reason, and the requests still out."""

    def __init__(self, mgr: KvlinkKVManager, room: int):
        self.kv_mgr = mgr
        self.bootstrap_room = room
        self.outcome: int | None = None  # KVPoll.Success or KVPoll.Failed once concluded
        self.reason: str | None = None
        self.out: dict[str, str] = {}  # request id -> index space ("kv", "aux", "s<i>")
        self.started: float | None = None
        self.finished_at: float | None = None
        self.bytes = 0

    def _engine(self, space: str) -> kvlink.Engine | None:
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
        raise KvlinkTransferError(
            self.bootstrap_room,
            self.reason if self.reason is not None else "failed on another TP rank",
            is_from_another_rank=not local,
        )
