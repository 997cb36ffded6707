"""The connector's scheduler side, in ATOM's EngineCore process: which blocks a prefill holds,
which reads a decode starts, and when ATOM may free or schedule a request.

Two ATOM behaviours are handled here rather than patched (``docs/integration.md`` has the
patches ATOM could take):

* A failed receive leaves the parked request's blocks allocated, and ATOM's next admission
  asserts on them (``block_manager.allocate``). The next ``get_num_new_matched_tokens`` for
  that request frees them, so the decode falls back to a local prefill.
* ATOM frees a finished prefill request's blocks on ``finished_sending`` and asserts when the
  id is not parked yet (``_update_from_kv_xfer_finished``). Sends that end before ATOM parked
  the request (a refused or aborted read) are held back until it did."""

from __future__ import annotations

import logging
import secrets
import sys
import types
from typing import Any

from atom.kv_transfer.disaggregation.base import KVConnectorSchedulerBase
from atom.kv_transfer.disaggregation.types import KVConnectorOutput
from atom.model_engine.sequence import SequenceStatus

from .metadata import Hold, KvlinkMetadata
from .params import Refused, prefill_output, read_for, state_slot
from .settings import Settings, advertised_host

logger = logging.getLogger("atom")


def _calling_scheduler() -> Any:
    """ATOM's ``Scheduler`` that is building this connector (it gives a connector no handle
    to its block manager; the decode needs one to free a failed read's blocks)."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return None
        me = frame.f_locals.get("self")
        if me is not None and hasattr(me, "block_manager") and hasattr(me, "deferred_free_blocks"):
            return me
        frame = frame.f_back
    return None


class KvlinkScheduler(KVConnectorSchedulerBase):
    """kvlink's scheduler-side connector for ATOM (``kv_connector: "kvlink"``)."""

    def __init__(self, config: Any) -> None:
        self.settings = Settings.from_config(config)
        self.is_producer = self.settings.producer
        self.host = advertised_host(self.settings)
        self._meta = KvlinkMetadata()
        # Prefill: every hold issued and not yet freed by ATOM; requests ATOM finished (and so
        # parked until finished_sending); sends that ended before that; finished requests
        # that were never held.
        self._held: dict[int, Hold] = {}
        self._finished: set[int] = set()
        self._early: set[int] = set()
        self._unheld: set[int] = set()
        # Decode: requests parked for their read; reads refused before parking; reads that
        # failed (their blocks are freed at the next admission); parked requests ATOM aborted.
        self._parked: dict[int, Any] = {}
        self._refused: set[int] = set()
        self._fallback: dict[int, Any] = {}
        self._aborted: dict[int, Any] = {}
        self._counts = {
            "reads": 0,
            "received": 0,
            "blocks_read": 0,
            "blocks_cached": 0,
            "refused": 0,
            "fallbacks": 0,
            "aborted_reads": 0,
        }
        # ATOM's Scheduler (the decode's only; found on the stack, typed as ATOM leaves it).
        self._scheduler: Any = None if self.is_producer else _calling_scheduler()
        if not self.is_producer and self._scheduler is None:
            raise RuntimeError(
                "kvlink: the decode connector must be built by ATOM's Scheduler (it frees the blocks "
                "of a failed read through the scheduler's block manager)"
            )
        logger.info(
            "kvlink scheduler: %s, workers at %s from port %d (TP %d, DP rank %d of %d)",
            "prefill" if self.is_producer else "decode",
            self.host,
            self.settings.handshake_port,
            self.settings.tp_size,
            self.settings.dp_rank,
            self.settings.dp_size,
        )

    # -- admission ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Any) -> tuple[int, bool]:
        """Decode: the whole prompt comes from the prefill, loaded asynchronously, once."""
        if seq.id in self._fallback:
            self._fall_back(seq)
            return 0, False
        params = seq.kv_transfer_params or {}
        if not self.is_producer and params.get("do_remote_prefill"):
            return len(seq.prompt_token_ids), True
        return 0, False

    def _fall_back(self, seq: Any) -> None:
        """A failed read: free its blocks so ATOM admits the request for a local prefill."""
        self._fallback.pop(seq.id, None)
        self._counts["fallbacks"] += 1
        self._scheduler.block_manager.deallocate(seq)
        logger.warning("kvlink: request %s falls back to a local prefill after its KV read failed", seq.id)

    def update_state_after_alloc(self, seq: Any) -> None:
        """Prefill: hold the request's blocks; decode: start its read."""
        params = seq.kv_transfer_params or {}
        if self.is_producer and params.get("do_remote_decode"):
            hold = Hold(list(seq.block_table), secrets.randbits(52) | 1, state_slot(seq))
            self._held[seq.id] = hold
            self._meta.holds[seq.id] = hold
        elif not self.is_producer and params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False
            try:
                read = read_for(seq, params, self.settings)
            except Refused as e:
                logger.error("kvlink: request %s computes its prompt here: %s", seq.id, e)
                self._refused.add(seq.id)
                self._counts["refused"] += 1
                if e.addresses:
                    self._meta.rejects.append((e.addresses, e.remote_id, e.hold, f"refused by the decode: {e}"))
                return
            self._meta.reads[seq.id] = read
            self._parked[seq.id] = seq
            self._counts["reads"] += 1
            self._counts["blocks_read"] += len(read.local_blocks)
            self._counts["blocks_cached"] += read.cached

    def should_park_for_load_after_alloc(self, seq: Any) -> bool:
        """A read refused before it started is not waited for: ATOM prefills locally."""
        if seq.id in self._refused:
            self._refused.discard(seq.id)
            return False
        return True

    # -- each step --------------------------------------------------------------------------
    def build_connector_meta(self) -> KvlinkMetadata:
        """This step's holds, reads, cancels and rejects, for every TP rank."""
        for sid, seq in self._parked.items():
            if sid not in self._aborted and seq.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED):
                # ATOM dropped a parked request (its client left): stop the read; its blocks
                # are freed once the read has ended (ATOM itself never frees them).
                self._aborted[sid] = seq
                self._meta.cancels.append(sid)
                self._counts["aborted_reads"] += 1
        for sid, seq in list(self._fallback.items()):
            if seq.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED):
                # Aborted before ATOM admitted it again: nothing else frees its blocks.
                del self._fallback[sid]
                self._scheduler.block_manager.deallocate(seq)
        meta, self._meta = self._meta, KvlinkMetadata()
        return meta

    def request_finished(self, seq: Any) -> None:
        """Prefill: publish the transfer parameters; once ATOM parked the request, its send is
        awaited (or released at once, for an aborted or unheld request)."""
        if not self.is_producer:
            return
        hold = self._held.get(seq.id)
        aborted = seq.status == SequenceStatus.ABORTED or getattr(seq, "leave_reason", None) == "aborted"
        if hold is not None and not aborted:
            seq.kv_transfer_params_output = prefill_output(
                seq, self.settings, self.host, hold.blocks, hold.token, hold.slot
            )
        if seq.status != SequenceStatus.FINISHED or seq.id in self._finished:
            return  # the streaming call, before ATOM parks the request
        self._finished.add(seq.id)
        if hold is None or aborted:
            # Nothing to wait for: never held, or aborted (its parameters, and so the hold's
            # token, were never published: no reader can match the hold). ATOM frees the blocks
            # at the next poll; the workers drop the hold at the next step.
            self._unheld.add(seq.id)
            if self._held.pop(seq.id, None) is not None:
                self._meta.releases.append(seq.id)

    def process_completions(self, out: KVConnectorOutput) -> KVConnectorOutput:
        """What ATOM may act on: sends of parked requests; receives of live requests."""
        if self.is_producer:
            ended = set(out.finished_sending) | self._early | self._unheld
            ready = {i for i in ended if i in self._finished}
            # A send that ended before ATOM parked its request waits for that; one of a hold
            # already given up (aborted) is dropped: ATOM freed the request's blocks.
            self._early, self._unheld = {i for i in ended - ready if i in self._held}, set()
            for i in ready:
                self._held.pop(i, None)
                self._finished.discard(i)
            out.finished_sending = ready
            return out
        for ids, failed in ((out.finished_recving, False), (out.failed_recving, True)):
            for i in list(ids):
                seq = self._parked.pop(i, None)
                if i in self._aborted:
                    ids.discard(i)
                    self._scheduler.block_manager.deallocate(self._aborted.pop(i))
                elif failed and seq is not None:
                    self._fallback[i] = seq
                elif seq is not None:
                    self._counts["received"] += 1
        return out

    def has_pending_work(self) -> bool:
        """Whether ATOM must keep polling the workers while its queues are empty."""
        if self.is_producer:
            return bool(self._early or self._unheld or self._held)
        return bool(self._parked or self._aborted)

    def get_statistics(self) -> dict[str, Any]:
        """ATOM publishes this in its engine metrics (under ``offload``): the requests this side
        waits for, by kind, and counters (reads started and completed, blocks read and found in
        the prefix cache, reads refused, local prefills after a failed read, reads of aborted
        requests)."""
        pending = {
            "held": sorted(self._held),
            "early": sorted(self._early),
            "parked": sorted(self._parked),
            "aborted": sorted(self._aborted),
            "fallback": sorted(self._fallback),
        }
        return {"kvlink_pending": pending, **{f"kvlink_{k}": v for k, v in self._counts.items()}}


__all__ = ["KvlinkScheduler"]
