"""The connector's worker side, one per ATOM TP rank: its kvlink engine, the holds it keeps and
the reads it runs, as the scheduler's metadata asks each step."""

from __future__ import annotations

import logging
from typing import Any

from atom.kv_transfer.disaggregation.base import KVConnectorBase
from atom.kv_transfer.disaggregation.types import KVConnectorOutput

import kvlink

from .. import core
from .layout import Region, describe, dtype_name, slot_block, state_regions
from .metadata import KvlinkMetadata
from .params import Read
from .settings import Settings, node_address, port_offset

logger = logging.getLogger("atom")


def _tp_rank_size() -> tuple[int, int]:
    from aiter.dist.parallel_state import get_tp_group

    tp = get_tp_group()
    return tp.rank_in_group, tp.world_size


class KvlinkWorker(KVConnectorBase):
    """kvlink's worker-side connector for ATOM: one engine per TP rank, listening at ATOM's
    side-channel port for its (DP, TP) place."""

    def __init__(self, config: Any) -> None:
        s = Settings.from_config(config)
        self.settings, self.config = s, config
        self.is_producer = s.producer
        self.tp_rank, self.tp_size = _tp_rank_size()
        # The DP rank from ATOM's config, as the scheduler side publishes it.
        offset = port_offset(s.dp_rank, self.tp_rank, self.tp_size, s.dp_size)
        listen = core.listen_address(s.link, offset, node_address)
        self.engine = core.make_engine(s.link, listen, tp_rank=self.tp_rank, tp_size=self.tp_size)
        self.metrics = core.serve_metrics(s.link, [self.engine], offset)
        logger.info(
            "kvlink worker TP %d/%d DP %d: engine %s at %s (%s)",
            self.tp_rank,
            self.tp_size,
            s.dp_rank,
            self.engine.engine_id,
            self.engine.handshake_address,
            core.transport_summary(self.engine),
        )
        self.regions: list[int] = []
        #: A SLOT region (DeepSeek-V4's per-request state), when the layout has block group 1.
        self.slot_region: Region | None = None
        self.held: set[int] = set()
        self.reading: dict[int, Read] = {}
        self.sent: set[int] = set()
        self.received: set[int] = set()
        self.failed: set[int] = set()

    def register_kv_caches(
        self, kv_caches: dict[str, Any], transfer_tensors: Any = None, num_blocks: Any = None
    ) -> None:
        """Registers every region of ATOM's ``KVTransferTensors`` and declares the layout."""
        n = int(num_blocks if num_blocks is not None else transfer_tensors.num_blocks)
        regions = describe(self.config, transfer_tensors, n, self.tp_size) + state_regions(self.config, kv_caches)
        tensors = []
        for r in regions:
            rid = self.engine.register_memory(r.base_addr, r.total_bytes, owner=kv_caches)
            self.regions.append(rid)
            tensors.append((rid, 0, r.block_bytes, r.block_bytes, r.num_blocks, r.group, r.heads))
            if r.group == 1:
                self.slot_region = r
        self.engine.set_layout(tensors, self.settings.block_size, dtype_name(self.config))
        logger.info(
            "kvlink worker TP %d: %d regions of %d blocks registered (%d bytes a block, heads %s)",
            self.tp_rank,
            len(regions),
            n,
            sum(r.block_bytes for r in regions),
            regions[0].heads,
        )

    def start_load_kv(self, metadata: Any) -> None:
        """Does what the scheduler asked this step; nothing here raises: a hold that fails ends
        as sent (its reader is refused), a read that cannot start ends failed."""
        if not isinstance(metadata, KvlinkMetadata):
            return
        for sid, hold in metadata.holds.items():
            if sid in self.held:  # held again after a preemption: the blocks may differ
                self.engine.release(str(sid))
            try:
                self.engine.hold_blocks(str(sid), self._blocks(hold.blocks, hold.slot), token=hold.token)
                self.held.add(sid)
            except (kvlink.KvlinkError, ValueError) as e:
                logger.error("kvlink: hold of request %s refused: %s", sid, e)
                self.held.discard(sid)
                self.sent.add(sid)
        for sid in metadata.releases:  # the scheduler already let ATOM free these
            if sid in self.held:
                self.held.discard(sid)
                self.engine.release(str(sid))
        for sid, read in metadata.reads.items():
            self._read(sid, read)
        for sid in metadata.cancels:
            if sid in self.reading:
                self.engine.cancel(str(sid))
        for addresses, remote_id, token, reason in metadata.rejects:
            self._reject(addresses, remote_id, token, reason)

    def _read(self, sid: int, read: Read) -> None:
        try:
            self.engine.read_blocks(
                list(read.addresses),
                str(sid),
                self._blocks(read.local_blocks, read.local_slot),
                self._blocks(read.remote_blocks, read.remote_slot),
                remote_request_id=read.remote_id,
                hold=read.hold,
            )
            self.reading[sid] = read
        except (kvlink.KvlinkError, ValueError) as e:
            logger.error("kvlink: read of request %s refused: %s", sid, e)
            self.failed.add(sid)
            self._reject(read.addresses, read.remote_id, read.hold, f"read refused by the decode: {e}")

    def _blocks(self, blocks: list[int], slot: int | None) -> list[int] | list[list[int]]:
        """A request's block lists as the layout has them: its blocks, and with SLOT state the
        block of its slot as group 1. Raises ``ValueError`` when the request has no slot."""
        if self.slot_region is None:
            return blocks
        if slot is None:
            raise ValueError("the model keeps per-request state and the request names no state slot")
        return [blocks, [slot_block(self.slot_region, slot)]]

    def _reject(self, addresses: list[str], remote_id: str, hold: int, reason: str) -> None:
        """Tells the prefill ranks this rank reads that the request will not be read."""
        try:
            for r in kvlink.tp_sources(self.tp_rank, self.tp_size, len(addresses)):
                self.engine.reject(addresses[r], remote_id, reason, hold or None)
        except kvlink.KvlinkError as e:
            logger.warning("kvlink: could not tell %s that request %s will not be read: %s", addresses, remote_id, e)

    def get_finished(self) -> KVConnectorOutput:
        """What ended on this rank since the last call, each request once."""
        f = self.engine.get_finished()
        for rid in f.sending:
            self._sent(int(rid))
        for rid in f.receiving:
            self.reading.pop(int(rid), None)
            self.received.add(int(rid))
        for rid, side, _expired, reason in f.failed:
            if side == "send":
                logger.warning("kvlink: send of request %s ended unread: %s", rid, reason)
                self._sent(int(rid))
            else:
                logger.warning("kvlink: read of request %s failed: %s", rid, reason)
                self.reading.pop(int(rid), None)
                self.failed.add(int(rid))
        out = KVConnectorOutput(finished_sending=self.sent, finished_recving=self.received, failed_recving=self.failed)
        self.sent, self.received, self.failed = set(), set(), set()
        return out

    def _sent(self, sid: int) -> None:
        if sid in self.held:
            self.held.discard(sid)
            self.sent.add(sid)

    def close(self) -> None:
        """Closes the engine (reads in flight fail, holds end) and its metrics endpoint."""
        if self.metrics is not None:
            self.metrics.shutdown()
        self.engine.close()
