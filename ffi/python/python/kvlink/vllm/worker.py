"""The connector's worker side: one TP rank's kvlink engine, the holds it keeps and the reads
it runs, as the scheduler's metadata asks each step."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

import kvlink

from .. import core
from .layout import (
    _dtype_name,
    _kv_heads,
    compressed_layers,
    connector_layers,
    conv_layout,
    is_head_major,
    kv_cache_tensors,
    latent_layers,
    layout_name,
    layout_tag,
    state_groups,
    state_layout,
)
from .metadata import KvlinkConnectorMetadata, KvlinkConnectorStats, KvlinkHandshakeMetadata, ReadSpec
from .progressive import AfterKernels, Growth, LayerParts

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from .connector import KvlinkConnector

logger = init_logger(__name__)


def _tp_rank() -> int:
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return 0


class _WorkerSide:
    """One TP rank: its kvlink engine, the holds it keeps and the reads it runs."""

    def __init__(self, owner: KvlinkConnector, kv_cache_config: KVCacheConfig | None):
        s = owner._settings
        self.tp_rank = _tp_rank()
        self.tp_size = owner._tp_size
        self.block_size = owner._block_size
        self.cache_config = owner._vllm_config.cache_config
        self.hf_config = getattr(getattr(owner._vllm_config, "model_config", None), "hf_text_config", None)
        self.kv_cache_config = kv_cache_config
        self.num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else None
        # vLLM's block ids are unique only within a KV cache group: with several groups a
        # failed read is reported by request (failed_recving), never by block.
        self.num_groups = owner._num_groups
        self.block_errors = self.num_groups <= 1
        self.kv_heads = _kv_heads(owner._vllm_config, self.tp_size)
        # Each data-parallel engine's ranks take the next tp_size ports.
        offset = owner._dp_index * self.tp_size + self.tp_rank
        listen = core.listen_address(s, offset, _node_address)
        self.engine = core.make_engine(s, listen, tp_rank=self.tp_rank, tp_size=self.tp_size)
        self.metrics = core.serve_metrics(s, [self.engine], offset)
        logger.info(
            "KvlinkConnector worker rank %d/%d: engine %s at %s (%s)",
            self.tp_rank,
            self.tp_size,
            self.engine.engine_id,
            self.engine.handshake_address,
            core.transport_summary(self.engine),
        )
        self.registered = False
        # Prefill: requests held (granted), and sends that ended before the scheduler listed
        # the request as finished (vLLM wants finished sends only for requests it finished).
        self.held: set[str] = set()
        # Progressive holds: request id -> its hold's id (the transfer id), and back.
        self.hold_ids: dict[str, str] = {}
        self.hold_owner: dict[str, str] = {}
        # Progressive holds: what this step makes final, applied as its forward writes it.
        self.growth: dict[str, Growth] = {}
        self.layer_parts: LayerParts | None = None
        self.layers_per_part = owner._layers_per_part
        self.after_kernels: AfterKernels | None = None
        # Progressive holds that stopped growing (ended early, or a part refused), and why.
        self.stunted: set[str] = set()
        self.grow_errors: deque[tuple[str, str]] = deque()
        self.scheduler_finished: set[str] = set()
        self.sends_ended: set[str] = set()
        # Decode: reads in flight, request id -> the read (its local blocks for load errors,
        # its prefill to tell when it fails).
        self.reading: dict[str, ReadSpec] = {}
        # Reads refused before they started, reported failed at the next poll.
        self.failed_now: set[str] = set()
        # Reads cancelled at the scheduler's request (their request was aborted).
        self.cancelled: set[str] = set()
        self.load_errors: set[int] = set()
        self.stats = KvlinkConnectorStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.registered:
            raise RuntimeError("KvlinkConnector: register_kv_caches called twice")
        layers, shared = connector_layers(kv_caches, self.kv_cache_config)
        state, why_whole = state_layout(self.kv_cache_config, self.tp_size, self.hf_config)
        # The element type the layout names: an attention layer's (a state layer's view is int8).
        first = kv_caches[next((n for n, g in layers if g not in state), layers[0][0])]
        if isinstance(first, (list, tuple)):
            first = first[0]
        num_blocks = self.num_blocks if self.num_blocks is not None else first.shape[0]
        name = self._resolved_layout()
        head_major = is_head_major(name)
        compressed = compressed_layers(self.kv_cache_config)
        latent = latent_layers(self.kv_cache_config)
        memory, layout = kv_cache_tensors(
            kv_caches, layers, num_blocks, head_major, self.kv_heads, state, compressed, latent
        )
        regions = [
            self.engine.register_memory(addr, size, device=owner.device.type != "cpu", owner=owner)
            for addr, size, owner in memory
        ]
        tensors = [(regions[t[0]], *t[1:]) for t in layout]
        conv = conv_layout() if state_groups(self.kv_cache_config) else None
        tokens = _tokens_per_block(self.kv_cache_config, state, self.block_size)
        self.engine.set_layout(tensors, tokens, layout_tag(first.dtype, head_major, self.kv_heads is None, conv))
        self.registered = True
        self.after_kernels = AfterKernels(first.device, self._hold_error)
        if len(tensors) == len(layers) and len({g for _, g in layers}) == 1:
            # One tensor per layer, in the order vLLM runs them: a progressive hold can grow
            # by a group of layers as the forward writes them.
            tensor_of = {name: i for i, (name, _) in enumerate(layers)}
            self.layer_parts = LayerParts(tensor_of, len(tensors), self.layers_per_part)
        total = sum(size for _, size, _ in memory)
        logger.info(
            "KvlinkConnector rank %d: registered %d layers (%d blocks, %.1f MiB in %d allocation(s), "
            "%s, %s, layout %s; %d KV cache groups; %s%s%s)",
            self.tp_rank,
            len(tensors),
            num_blocks,
            total / 2**20,
            len(memory),
            _dtype_name(first.dtype),
            "GPU" if first.device.type != "cpu" else "host",
            name,
            len({t[5] for t in tensors}),
            f"{self.kv_heads[1]} of {self.kv_heads[0]} KV heads per rank" if self.kv_heads else "no head split (MLA)",
            f"; {len(shared)} layers reuse another layer's cache and are not sent" if shared else "",
            _state_note(state, conv, why_whole),
        )

    def _resolved_layout(self) -> str:
        """The KV cache layout vLLM resolved (the engine core records it in the KV cache
        config and on every worker before the caches are allocated)."""
        name = getattr(self.kv_cache_config, "kv_cache_layout", None) or self.cache_config.kv_cache_layout
        if name is None:
            raise RuntimeError("KvlinkConnector: vLLM has not resolved the KV cache layout before register_kv_caches")
        return layout_name(name)

    def handshake_metadata(self) -> KvlinkHandshakeMetadata:
        return KvlinkHandshakeMetadata(
            address=self.engine.handshake_address,
            engine_id=self.engine.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )

    def apply(self, meta: KvlinkConnectorMetadata) -> None:
        """Does what the scheduler asked for this step. Nothing here raises: a failure to hold
        leaves the request unread (the decode's read is refused and recomputed), a read that
        cannot start is reported failed at the next poll and its prefill told."""
        for rid in meta.releases:
            if rid in self.held:
                self.held.discard(rid)
                self.growth.pop(rid, None)
                hid = self.hold_ids.pop(rid, rid)
                self.hold_owner.pop(hid, None)
                self.stunted.discard(rid)
                self._guard("release", rid, self.engine.release, hid)
            self.sends_ended.discard(rid)
        self._grow(meta)
        for rid, blocks in meta.holds.items():
            if rid in self.held:  # held again after a preemption: the blocks may differ
                self.engine.release(rid)
                self.held.discard(rid)
            token = meta.hold_tokens.get(rid)
            if self._guard("hold", rid, self.engine.hold_blocks, rid, blocks, None, None, token):
                self.held.add(rid)
            else:
                # vLLM keeps the blocks until every rank reports the send finished: this rank
                # has nothing to send (its reader is refused and recomputes), so it reports the
                # send ended as soon as the scheduler finishes the request.
                self.sends_ended.add(rid)
        for rid, spec in meta.reads.items():
            try:
                if spec.refused:
                    raise kvlink.InvalidArgument(spec.refused)
                # The prefill's whole TP group: kvlink reads the ranks this rank pairs with
                # (its share of one rank's heads, or several ranks' heads side by side).
                if spec.follow:
                    # Equal TP sizes: this rank follows the prefill rank of its own rank.
                    self.engine.follow_blocks(
                        spec.remote_addresses[self.tp_rank],
                        rid,
                        spec.local_blocks,
                        remote_request_id=spec.remote_request_id,
                        hold=spec.hold,
                        skip=spec.skip,
                    )
                else:
                    self.engine.read_blocks(
                        list(spec.remote_addresses),
                        rid,
                        spec.local_blocks,
                        spec.remote_blocks,
                        remote_request_id=spec.remote_request_id,
                        remote_tokens_per_block=spec.remote_block_size or None,
                        first_tokens=spec.first_tokens or None,
                        hold=spec.hold,
                    )
            except Exception as e:  # noqa: BLE001 - every refusal ends as a failed read
                # Refused at once: it ends like a failed read (vLLM recomputes or fails it),
                # and the prefill frees its blocks now rather than at its abort timeout.
                logger.error("KvlinkConnector: read of %s refused: %s", rid, e)
                self._load_failed(spec)
                self.failed_now.add(rid)
                self.stats.record_failure("refused")
                # This rank's own sources: a prefill rank read by several decode ranks waits
                # for each of them.
                why = f"read refused by the decode: {e}"
                self._reject(spec.remote_addresses, spec.remote_request_id, why, spec.hold, own=True)
                continue
            self.reading[rid] = spec
        for rid in meta.cancels:
            if rid in self.reading and self._guard("cancel", rid, self.engine.cancel, rid):
                self.cancelled.add(rid)
        for addresses, remote_id, reason, hold in meta.rejects:
            self._reject(addresses, remote_id, reason, hold)

    def _grow(self, meta: KvlinkConnectorMetadata) -> None:
        """Progressive holds: opens those asked for, extends them by the blocks final before
        this step's forward, and keeps what the forward completes for ``layer_saved`` and
        ``forward_done``."""
        for rid, (tid, token) in meta.grows.items():
            no_blocks: list[list[int]] = [[] for _ in range(self.num_groups)]
            if self._guard("hold", rid, self.engine.hold_growing, tid, no_blocks, None, None, token):
                self.held.add(rid)
                self.hold_ids[rid], self.hold_owner[tid] = tid, rid
            else:
                self.sends_ended.add(rid)
        if self.layer_parts is not None:
            self.layer_parts.reset()
        for rid, growth in meta.growth.items():
            if rid not in self.hold_ids:
                continue
            if any(growth.now):
                self._after(rid, self.engine.extend_hold, self.hold_ids[rid], growth.now)
            self.growth[rid] = growth

    def layer_saved(self, layer_name: str) -> None:
        """vLLM's save hook: layer ``layer_name`` of this step's forward is written. Once a
        part's worth of layers is, the progressive holds grow by those layers of the step's
        blocks."""
        if not self.growth or self.layer_parts is None:
            return
        part = self.layer_parts.layer(layer_name)
        if part is None:
            return
        for rid, growth in self.growth.items():
            if any(growth.after):
                blocks = growth.after if part[0] == 0 else [[]]
                self._after(rid, self.engine.extend_hold, self.hold_ids[rid], blocks, part)

    def forward_done(self) -> None:
        """The step's forward is done: the progressive holds grow by the rest of what it
        completed, and those whose prompt it completed are sealed."""
        if not self.growth:
            return
        rest = self.layer_parts.rest() if self.layer_parts is not None else None
        for rid, growth in self.growth.items():
            tid = self.hold_ids[rid]
            if any(growth.after):
                if rest is None:
                    self._after(rid, self.engine.extend_hold, tid, growth.after)
                else:
                    self._after(rid, self.engine.extend_hold, tid, [[]], rest)
            if growth.seal:
                self._after(rid, self.engine.seal_hold, tid)
        self.growth = {}

    def _after(self, rid: str, fn, *args) -> None:
        """Calls ``fn(*args)`` on a hold of ``rid`` once the device wrote what the forward
        queued so far (at once on the CPU)."""
        assert self.after_kernels is not None
        if fn == self.engine.extend_hold:
            self.stats.record_part()
        self.after_kernels.run(rid, lambda: None if rid in self.stunted else fn(*args))

    def _hold_error(self, rid: str, e: BaseException) -> None:
        """A progressive hold that could not grow (it ended: its reader gave up or failed, or
        the engine refused the part): it grows no more; ``_stunted`` ends it at the next poll.
        (On a GPU this runs on the holds' thread: it only records.)"""
        self.stunted.add(rid)
        self.grow_errors.append((rid, str(e)))

    def _stunted(self) -> None:
        """Ends the holds that could not grow: the reader fails if it has not (the decode
        recomputes), and the send ends once the scheduler finishes the request."""
        while self.grow_errors:
            rid, why = self.grow_errors.popleft()
            hid = self.hold_ids.get(rid)
            if hid is not None and rid in self.held and self.engine.release(hid):
                logger.error("KvlinkConnector: the hold of %s could not grow, released: %s", rid, why)
                self.held.discard(rid)
                self.sends_ended.add(rid)
            else:
                logger.info("KvlinkConnector: the hold of %s ended before its prompt: %s", rid, why)

    def _reject(self, addresses: list[str], remote_id: str, reason: str, hold: int | None, own: bool = False) -> None:
        """Tells the prefill ranks this rank reads that a request will not be read. For the
        scheduler's rejects (every rank gets them) the first of several decode ranks reading
        one prefill rank tells it; ``own`` (this rank alone gave up) tells this rank's sources
        whatever its place. With TP sizes that cannot pair, rank 0 tells every prefill rank."""
        p, d = len(addresses), self.tp_size
        try:
            targets = [addresses[r] for r in kvlink.tp_sources(self.tp_rank, d, p)]
            if d > p and self.tp_rank % (d // p) != 0 and not own:
                targets = []
        except kvlink.InvalidArgument:
            targets = list(addresses) if self.tp_rank == 0 else []
        for peer in targets:
            self._guard("reject", remote_id, self.engine.reject, str(peer), remote_id, reason, hold)

    def _guard(self, what: str, rid: str, fn, *args) -> bool:
        try:
            return fn(*args) is not False
        except Exception as e:  # noqa: BLE001 - a worker step must not die of one request
            logger.error("KvlinkConnector: %s of %s failed: %s", what, rid, e)
            return False

    def poll(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """Finished sends, finished receives (failed ones included), failed receives."""
        self.scheduler_finished |= set(finished_req_ids or ())
        self._stunted()
        f = self.engine.get_finished()
        recving: set[str] = set()
        failed: set[str] = set()
        for hid in f.sending:
            rid = self._owner(hid)
            if rid in self.held:
                self.held.discard(rid)
                self.sends_ended.add(rid)
        for report in f.reports:
            self.reading.pop(report["id"], None)
            self.cancelled.discard(report["id"])
            recving.add(report["id"])
            self.stats.record_read(report)
        for failure in f.failures:
            rid = failure["id"]
            self.stats.record_failure(failure["cause"])
            if failure["side"] == "send":
                rid = self._owner(rid)
                if rid in self.held:
                    logger.warning("KvlinkConnector: send of %s ended without a read: %s", rid, failure["reason"])
                    self.held.discard(rid)
                    self.sends_ended.add(rid)
                continue
            spec = self.reading.pop(rid, None)
            if spec is None:
                continue
            recving.add(rid)
            if rid in self.cancelled:
                self.cancelled.discard(rid)
            else:
                # Any other failure (a cancel this connector did not ask for included) leaves
                # blocks vLLM must not trust; the prefill may still hold them (a read refused
                # at its handshake never reached it): tell it, so it frees them now.
                logger.warning("KvlinkConnector: read of %s failed (%s): %s", rid, failure["cause"], failure["reason"])
                failed.add(rid)
                self._load_failed(spec)
                reason = f"read failed on the decode ({failure['cause']}): {failure['reason']}"
                self._reject(spec.remote_addresses, spec.remote_request_id, reason[:512], spec.hold, own=True)
        recving |= self.failed_now
        failed |= self.failed_now
        self.failed_now = set()
        sending = self.sends_ended & self.scheduler_finished
        self.sends_ended -= sending
        self.scheduler_finished -= sending
        # Finished requests with no send pending need no memory of their id.
        self.scheduler_finished &= self.held | self.sends_ended
        return sending, recving, failed

    def _owner(self, hold_id: str) -> str:
        """The request a hold ended for was held for (its own id, or a progressive transfer's
        request); its progressive record is dropped."""
        rid = self.hold_owner.pop(hold_id, hold_id)
        if self.hold_ids.get(rid) == hold_id:
            del self.hold_ids[rid]
            self.stunted.discard(rid)
        return rid

    def _load_failed(self, spec: ReadSpec) -> None:
        """Records the blocks of a failed read as load errors, where vLLM can take them: with
        one KV cache group (its block ids are unique only within a group; with several, vLLM
        raises on block errors and recomputes from ``failed_recving`` alone)."""
        if self.block_errors:
            self.load_errors.update(spec.all_local())

    def take_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out

    def take_stats(self) -> KvlinkConnectorStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KvlinkConnectorStats()
        return out

    def close(self) -> None:
        if self.after_kernels is not None:
            self.after_kernels.close()
        if self.metrics is not None:
            self.metrics.shutdown()
        self.engine.close()


def _tokens_per_block(kv_cache_config: KVCacheConfig | None, state: dict, default: int) -> int:
    """The tokens a block of the layout holds: the attention groups' block size, which vLLM
    may raise above the configured one to give every group pages of one size (a
    sliding-window group whose kernel wants larger blocks raises the full-attention group's
    with it); the configured one when the groups' sizes differ or there are none."""
    if kv_cache_config is None:
        return default
    sizes = {int(g.kv_cache_spec.block_size) for i, g in enumerate(kv_cache_config.kv_cache_groups) if i not in state}
    return sizes.pop() if len(sizes) == 1 else default


def _state_note(state: dict, conv: str | None, why_whole: str | None) -> str:
    """The registration log's words on per-request state (Mamba-kind, compressor rings): its
    groups, the conv layout, and whether a decode of another TP size can read its slice."""
    if not state:
        return ""
    tp = "read between TP sizes by slice" if why_whole is None else f"whole only ({why_whole})"
    return f"; {len(state)} state group(s), " + (f"conv {conv}, " if conv else "") + tp


def _node_address() -> str:
    from vllm.utils.network_utils import get_ip

    return get_ip()
