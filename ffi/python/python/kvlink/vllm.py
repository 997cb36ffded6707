"""A vLLM KV connector on kvlink: the decode pulls a request's KV blocks from the prefill's
memory (RDMA READ, or TCP), block by block, straight into its own blocks.

Turn it on with::

    --kv-transfer-config '{"kv_connector": "KvlinkConnector",
                           "kv_connector_module_path": "kvlink.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"listen": "10.0.0.5:17000"}}'

Settings (``kv_connector_extra_config``):

``listen``
    ``host:port`` of TP rank 0's kvlink engine; rank ``r`` of data-parallel engine ``d``
    listens on ``port + d * tp_size + r``. Default: the node's address (``127.0.0.1`` without
    an authentication key) and an ephemeral port.
``transport``
    ``auto`` (RDMA when a device is usable, else TCP), ``tcp`` or ``rdma``.
``abort_timeout``
    Seconds the prefill holds a request's blocks for a decode that never reads them (480).
``request_timeout``
    Seconds a decode read may take before it fails and vLLM recomputes (60).
``auth_key`` / ``auth_key_file``
    The deployment key every engine shares (also read from ``KVLINK_AUTH_KEY`` /
    ``KVLINK_AUTH_KEY_FILE``). Without one, engines listen on loopback only.
``rdma_device``
    The RDMA device to use (default: the first usable one).

Flow. The proxy sends the prompt to the prefill with ``kv_transfer_params =
{"do_remote_decode": true}`` and ``max_tokens = 1``. In the step that completes the prompt,
every prefill rank holds the prompt's blocks for the request (a read grant: only those blocks,
under that request id); ``request_finished`` then returns the ``kv_transfer_params`` the proxy
passes to the decode: ``remote_addresses`` (one per TP rank), ``remote_request_id``,
``remote_block_ids`` (one list per KV cache group when there are several) and
``remote_num_tokens``. The decode allocates blocks for the tokens it
does not hold locally (a local prefix hit is not read again), each decode rank reads the
prefill ranks it pairs with (``kvlink.tp_sources``: its peer rank when the TP sizes match),
and each prefill rank frees its blocks once every decode rank reading it confirmed, one
aborted, or after ``abort_timeout``. A failed read becomes ``failed_recving`` and invalid blocks, which vLLM
recomputes (``kv_load_failure_policy="recompute"``) or fails. A decode request aborted while
its read is in flight cancels it; one aborted or refused before its read starts tells the
prefill, which frees the blocks at once.

Supported: vLLM 0.32 (tested); vLLM's hybrid KV cache manager (``SupportsHMA``): each KV
cache group's blocks travel with their own block ids (full-attention groups whole,
sliding-window groups only the blocks their window still sees; SSM state groups are refused);
a prefill and a decode of different TP sizes when one is a multiple of the other (each decode
rank reads its share of a prefill rank's KV heads, or gathers the heads of several prefill
ranks; MLA latents are read whole); KV caches laid out with the block index outermost
(FlashAttention ``[2, num_blocks, ...]``, FlashInfer ``[num_blocks, 2, ...]``, MLA
``[num_blocks, block_size, dim]``) in GPU or host memory, head-major (HND) or token-major
(NHD) blocks, any dtype (both sides must agree).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger

import kvlink

try:  # vLLM 0.32 reports failed receives next to finished ones; older releases do not.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - depends on the installed vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

__all__ = [
    "KvlinkConnector",
    "KvlinkConnectorMetadata",
    "KvlinkConnectorStats",
    "KvlinkHandshakeMetadata",
    "ReadSpec",
    "kv_cache_tensors",
]


@dataclass
class KvlinkHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What one worker advertises to its scheduler: its engine's handshake address."""

    address: str
    engine_id: str
    tp_rank: int
    tp_size: int


@dataclass
class ReadSpec:
    """One decode read: the prefill's blocks ``remote_blocks`` of request ``remote_request_id``
    into this engine's ``local_blocks``, one list per KV cache group, paired by position; each
    TP rank reads the prefill ranks kvlink pairs it with (``kvlink.tp_sources``)."""

    remote_addresses: List[str]
    remote_request_id: str
    local_blocks: List[List[int]]
    remote_blocks: List[List[int]]
    refused: str = ""
    """Why the read cannot be made, when the scheduler found it unusable: it then ends as a
    failed read at once (its blocks reported as load errors)."""

    def all_local(self) -> List[int]:
        """Every local block of the read (for load errors)."""
        return [b for group in self.local_blocks for b in group]


@dataclass
class KvlinkConnectorMetadata(KVConnectorMetadata):
    """What the scheduler asks its workers to do in one step (pickled with the step)."""

    holds: Dict[str, List[List[int]]] = field(default_factory=dict)
    """Prefill: request id -> blocks to hold and grant to its readers, per KV cache group."""
    releases: List[str] = field(default_factory=list)
    """Prefill: holds to drop (request aborted or preempted); no send is reported for them."""
    reads: Dict[str, ReadSpec] = field(default_factory=dict)
    """Decode: request id -> read to start."""
    cancels: List[str] = field(default_factory=list)
    """Decode: reads to cancel (after the reads of this step are started)."""
    rejects: List[Tuple[List[str], str, str]] = field(default_factory=list)
    """Decode: ``(remote_addresses, remote_request_id, reason)`` of requests that will not be
    read: each prefill rank frees the blocks at once."""


@dataclass
class KvlinkConnectorStats(KVConnectorStats):
    """Transfers finished by the workers since the last report: reads done (bytes, seconds
    per transport) and failures by cause. Aggregated over workers and intervals by summing."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"reads": 0, "bytes": 0, "seconds": 0.0, "by_transport": {}, "failures": {}}

    def record_read(self, report: Dict[str, Any]) -> None:
        self.data["reads"] += 1
        self.data["bytes"] += int(report["bytes"])
        self.data["seconds"] += float(report["seconds"])
        t = self.data["by_transport"]
        t[report["transport"]] = t.get(report["transport"], 0) + 1

    def record_failure(self, cause: str) -> None:
        f = self.data["failures"]
        f[cause] = f.get(cause, 0) + 1

    def aggregate(self, other: KVConnectorStats) -> "KvlinkConnectorStats":
        o = other.data
        if not o:
            return self
        self.data["reads"] += o.get("reads", 0)
        self.data["bytes"] += o.get("bytes", 0)
        self.data["seconds"] += o.get("seconds", 0.0)
        for key in ("by_transport", "failures"):
            for k, v in o.get(key, {}).items():
                self.data[key][k] = self.data[key].get(k, 0) + v
        return self

    def reduce(self) -> Dict[str, Any]:
        d = self.data
        out: Dict[str, Any] = {
            "Num reads": d["reads"],
            "Read MiB": round(d["bytes"] / 2**20, 3),
            # Per read, from read_blocks to the last byte (includes queueing and handshakes).
            "Avg read s": round(d["seconds"] / d["reads"], 6) if d["reads"] else 0.0,
            "Avg read GB/s": round(d["bytes"] / d["seconds"] / 1e9, 3) if d["seconds"] else 0.0,
        }
        for k, v in sorted(d["by_transport"].items()):
            out[f"Reads over {k}"] = v
        for k, v in sorted(d["failures"].items()):
            out[f"Failures ({k})"] = v
        return out

    def is_empty(self) -> bool:
        return self.data["reads"] == 0 and not self.data["failures"]


def kv_cache_tensors(
    kv_caches: Dict[str, Any],
    num_blocks: int,
    groups: Optional[Dict[str, int]] = None,
    kv_heads: Optional[Tuple[int, int]] = None,
) -> Tuple[List[Tuple[int, int, torch.Tensor]], List[Tuple[int, int, int, int, int, int, Any]]]:
    """Maps vLLM's KV caches to kvlink memory and layout.

    Returns the memory to register, ``(address, bytes, owner)`` per distinct storage, and the
    layout, ``(storage index, offset, block stride, block bytes, blocks, group, heads)`` per
    tensor in layer order (K before V where a layer has both). A tensor's block index is its
    first dimension of size ``num_blocks`` among the first two (``[2, num_blocks, ...]`` is
    split into K and V); the rest of a block must be dense in memory (any order of its
    dimensions: HND and NHD both qualify). A layer with several state tensors (a list, as SSM
    layers have) gives one tensor each.

    ``groups`` maps a layer to its KV cache group (default 0). ``kv_heads`` is ``(total, this
    rank's)``: tensors whose blocks hold that many heads in their second-to-last dimension
    declare them, as ``(total, local, runs)`` (``runs``: how many times the heads repeat in a
    block, 1 when they are its outermost dimension), so that a decode of another TP size reads
    its own heads; ``None`` (MLA, or no TP split) declares none.
    """
    storages: Dict[int, int] = {}
    memory: List[Tuple[int, int, torch.Tensor]] = []
    layout: List[Tuple[int, int, int, int, int, int, Any]] = []
    for name, value in kv_caches.items():
        group = (groups or {}).get(name, 0)
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks and t.shape[0] != num_blocks:
                views = [t[0], t[1]]
            elif t.dim() >= 1 and t.shape[0] == num_blocks:
                views = [t]
            else:
                raise ValueError(
                    f"kvlink: KV cache {name!r} has shape {tuple(t.shape)}; expected the block "
                    f"index ({num_blocks} blocks) first, or second after a K/V dimension of 2"
                )
            storage = t.untyped_storage()
            base = storage.data_ptr()
            if base not in storages:
                storages[base] = len(memory)
                memory.append((base, storage.nbytes(), t))
            index = storages[base]
            esize = t.element_size()
            for v in views:
                inner = v[0]
                span = 1 + sum((s - 1) * st for s, st in zip(inner.shape, inner.stride()) if s > 0)
                if span != inner.numel():
                    raise ValueError(
                        f"kvlink: a block of KV cache {name!r} is not dense in memory "
                        f"(shape {tuple(inner.shape)}, strides {inner.stride()})"
                    )
                layout.append(
                    (
                        index,
                        v.data_ptr() - base,
                        v.stride(0) * esize,
                        inner.numel() * esize,
                        v.shape[0],
                        group,
                        _head_split(inner, kv_heads),
                    )
                )
    return memory, layout


def _head_split(block: torch.Tensor, kv_heads: Optional[Tuple[int, int]]) -> Optional[Tuple[int, int, int]]:
    """``(total, local, runs)`` for a dense block whose second-to-last dimension holds this
    rank's heads, or None: ``runs`` is the product of the sizes of the dimensions laid out
    outside the heads (token-major blocks repeat their heads once per token)."""
    if kv_heads is None or block.dim() < 2:
        return None
    total, local = kv_heads
    h = block.dim() - 2
    if block.shape[h] != local:
        return None
    # Dimensions laid out inside the heads, and outside them. A stride equal to the heads'
    # (a dimension of size 1 on either side) counts as laid out as in a contiguous block:
    # outside when it comes first.
    sh = block.stride(h)
    dims = [(i, n, st) for i, (n, st) in enumerate(zip(block.shape, block.stride())) if i != h]
    inner = [n for i, n, st in dims if st < sh or (st == sh and i > h)]
    outer = [n for i, n, st in dims if st > sh or (st == sh and i < h)]
    if math.prod(inner) != sh:
        return None  # the heads are not laid out as runs of whole heads
    return (total, local, math.prod(outer))


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class KvlinkConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector on kvlink (scheduler and worker roles); see the module docs. Supports
    vLLM's hybrid KV cache manager (``SupportsHMA``): each KV cache group's blocks are a block
    group of the kvlink layout, read with their own block ids."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: Optional["KVCacheConfig"] = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._block_size = vllm_config.cache_config.block_size
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._dp_rank = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
        # NHD and HND blocks have the same size and different byte orders: the layout joins
        # the dtype in what both sides must agree on.
        self._kv_layout = getattr(vllm_config.cache_config, "kv_cache_layout", None)
        self._settings = _Settings.parse(extra)
        self._num_groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler: Optional[_SchedulerSide] = _SchedulerSide(self, kv_cache_config)
            self._worker: Optional[_WorkerSide] = None
        else:
            self._scheduler = None
            self._worker = _WorkerSide(self, kv_cache_config)

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        self._need_worker().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Optional[KvlinkHandshakeMetadata]:
        return self._need_worker().handshake_metadata()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvlinkConnectorMetadata), type(meta)
        self._need_worker().apply(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # reads are asynchronous: requests wait for their KV outside the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # the decode pulls; nothing is pushed

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        sending, recving, _ = self._need_worker().poll(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: Set[str]):
        sending, recving, failed = self._need_worker().poll(finished_req_ids)
        if KVConnectorTransferResults is None:
            return sending, recving
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._need_worker().take_load_errors()

    def get_kv_connector_stats(self) -> Optional[KvlinkConnectorStats]:
        if self._worker is None:
            return None
        return self._worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> KvlinkConnectorStats:
        return KvlinkConnectorStats(data=data) if data else KvlinkConnectorStats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    @property
    def engine(self) -> Optional[kvlink.Engine]:
        """The worker's kvlink engine (None on the scheduler)."""
        return self._worker.engine if self._worker is not None else None

    # ---- scheduler side ----------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: Dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._need_scheduler().set_addresses(metadata)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        return self._need_scheduler().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._need_scheduler().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvlinkConnectorMetadata:
        return self._need_scheduler().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._need_scheduler().update_output(connector_output)

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._need_scheduler().request_finished(request)

    def request_finished_all_groups(
        self, request: "Request", block_ids: Tuple[List[int], ...]
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._need_scheduler().request_finished(request)

    # ---- helpers -----------------------------------------------------------------------

    def _need_worker(self) -> "_WorkerSide":
        if self._worker is None:
            raise RuntimeError("KvlinkConnector: a worker-side method was called on the scheduler")
        return self._worker

    def _need_scheduler(self) -> "_SchedulerSide":
        if self._scheduler is None:
            raise RuntimeError("KvlinkConnector: a scheduler-side method was called on a worker")
        return self._scheduler


@dataclass
class _Settings:
    host: Optional[str]
    port: int
    transport: str
    abort_timeout: float
    request_timeout: float
    auth_key: Optional[bytes]
    rdma_device: Optional[str]

    @staticmethod
    def parse(extra: Dict[str, Any]) -> "_Settings":
        known = {"listen", "transport", "abort_timeout", "request_timeout", "auth_key", "auth_key_file", "rdma_device"}
        unknown = sorted(set(extra) - known)
        if unknown:
            logger.warning("KvlinkConnector: ignoring unknown kv_connector_extra_config keys %s", unknown)
        host: Optional[str] = None
        port = 0
        listen = extra.get("listen")
        if listen:
            host, sep, p = str(listen).rpartition(":")
            if not sep or not p.isdigit():
                raise ValueError(f"KvlinkConnector: listen must be 'host:port', got {listen!r}")
            host, port = host.strip("[]") or None, int(p)
        transport = str(extra.get("transport", "auto"))
        if transport not in ("auto", "tcp", "rdma"):
            raise ValueError(f"KvlinkConnector: transport must be auto, tcp or rdma, got {transport!r}")
        key: Optional[bytes] = None
        if extra.get("auth_key"):
            key = str(extra["auth_key"]).encode()
        elif extra.get("auth_key_file"):
            with open(extra["auth_key_file"], "rb") as f:
                key = f.read().strip()
        return _Settings(
            host=host,
            port=port,
            transport=transport,
            abort_timeout=float(extra.get("abort_timeout", 480.0)),
            request_timeout=float(extra.get("request_timeout", 60.0)),
            auth_key=key,
            rdma_device=extra.get("rdma_device"),
        )


def _kv_heads(vllm_config: "VllmConfig", tp_size: int) -> Optional[Tuple[int, int]]:
    """``(total KV heads, this rank's)`` for per-head KV caches, None for MLA (every rank
    holds the latent whole) or when the model does not say."""
    model = getattr(vllm_config, "model_config", None)
    if model is None or getattr(model, "use_mla", False):
        return None
    try:
        total = int(model.get_total_num_kv_heads())
        local = int(model.get_num_kv_heads(vllm_config.parallel_config))
    except Exception:  # noqa: BLE001 - a model config without head counts: no head split
        return None
    if total <= 0 or local != (total // tp_size if tp_size <= total else 1):
        return None
    return total, local


def _tp_rank() -> int:
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return 0


class _WorkerSide:
    """One TP rank: its kvlink engine, the holds it keeps and the reads it runs."""

    def __init__(self, owner: KvlinkConnector, kv_cache_config: Optional["KVCacheConfig"]):
        s = owner._settings
        self.tp_rank = _tp_rank()
        self.tp_size = owner._tp_size
        self.block_size = owner._block_size
        self.kv_layout = owner._kv_layout
        self.num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else None
        # Each layer's KV cache group: a block group of the kvlink layout.
        self.groups: Dict[str, int] = {}
        if kv_cache_config is not None:
            for g, spec in enumerate(kv_cache_config.kv_cache_groups):
                for name in spec.layer_names:
                    self.groups[name] = g
        self.kv_heads = _kv_heads(owner._vllm_config, self.tp_size)
        keyed = s.auth_key is not None or bool(os.environ.get("KVLINK_AUTH_KEY") or os.environ.get("KVLINK_AUTH_KEY_FILE"))
        host = s.host
        if host is None:
            host = _node_address() if keyed else "127.0.0.1"
        # Each data-parallel engine's ranks take the next tp_size ports.
        port = s.port + owner._dp_rank * self.tp_size + self.tp_rank if s.port else 0
        self.engine = kvlink.Engine(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
            transport=s.transport,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            request_timeout=s.request_timeout,
            abort_timeout=s.abort_timeout,
            rdma_device=s.rdma_device,
            auth_key=s.auth_key,
        )
        logger.info(
            "KvlinkConnector worker rank %d/%d: engine %s at %s (%s)",
            self.tp_rank,
            self.tp_size,
            self.engine.engine_id,
            self.engine.handshake_address,
            "RDMA on " + self.engine.rdma_device if self.engine.rdma_device else f"TCP; RDMA: {self.engine.rdma_unavailable_reason}",
        )
        self.registered = False
        # Prefill: requests held (granted), and sends that ended before the scheduler listed
        # the request as finished (vLLM wants finished sends only for requests it finished).
        self.held: Set[str] = set()
        self.scheduler_finished: Set[str] = set()
        self.sends_ended: Set[str] = set()
        # Decode: reads in flight, request id -> local blocks (for load errors).
        self.reading: Dict[str, List[int]] = {}
        # Reads refused before they started, reported failed at the next poll.
        self.failed_now: Set[str] = set()
        # Reads cancelled at the scheduler's request (their request was aborted).
        self.cancelled: Set[str] = set()
        self.load_errors: Set[int] = set()
        self.stats = KvlinkConnectorStats()

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        if self.registered:
            raise RuntimeError("KvlinkConnector: register_kv_caches called twice")
        first = next(iter(kv_caches.values()))
        if isinstance(first, (list, tuple)):
            first = first[0]
        num_blocks = self.num_blocks
        if num_blocks is None:
            num_blocks = first.shape[1] if first.shape[0] == 2 else first.shape[0]
        if self.groups:
            unknown = sorted(set(kv_caches) - set(self.groups))
            if unknown:
                raise ValueError(f"KvlinkConnector: KV caches {unknown} are in no KV cache group")
        memory, layout = kv_cache_tensors(kv_caches, num_blocks, self.groups, self.kv_heads)
        regions = [
            self.engine.register_memory(addr, size, device=owner.device.type != "cpu", owner=owner)
            for addr, size, owner in memory
        ]
        tensors = [(regions[i], off, stride, nbytes, blocks, group, heads) for i, off, stride, nbytes, blocks, group, heads in layout]
        dtype = _dtype_name(first) + (f"/{self.kv_layout}" if self.kv_layout else "")
        self.engine.set_layout(tensors, self.block_size, dtype)
        self.registered = True
        total = sum(size for _, size, _ in memory)
        with_heads = sum(1 for t in tensors if t[6] is not None)
        logger.info(
            "KvlinkConnector rank %d: registered %d KV tensors (%d blocks, %.1f MiB, %s, %s; "
            "%d KV cache groups; %d tensors declare their KV heads%s)",
            self.tp_rank, len(tensors), num_blocks, total / 2**20, _dtype_name(first),
            "GPU" if first.device.type != "cpu" else "host", len({t[5] for t in tensors}),
            with_heads, f" ({self.kv_heads[1]} of {self.kv_heads[0]} per rank)" if self.kv_heads else "",
        )

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
                self._guard("release", rid, self.engine.release, rid)
            self.sends_ended.discard(rid)
        for rid, blocks in meta.holds.items():
            if rid in self.held:  # held again after a preemption: the blocks may differ
                self.engine.release(rid)
                self.held.discard(rid)
            if self._guard("hold", rid, self.engine.hold_blocks, rid, blocks):
                self.held.add(rid)
        for rid, spec in meta.reads.items():
            try:
                if spec.refused:
                    raise kvlink.InvalidArgument(spec.refused)
                # The prefill's whole TP group: kvlink reads the ranks this rank pairs with
                # (its share of one rank's heads, or several ranks' heads side by side).
                self.engine.read_blocks(
                    list(spec.remote_addresses),
                    rid,
                    spec.local_blocks,
                    spec.remote_blocks,
                    remote_request_id=spec.remote_request_id,
                )
            except Exception as e:  # noqa: BLE001 - every refusal ends as a failed read
                # Refused at once: it ends like a failed read (vLLM recomputes or fails it),
                # and the prefill frees its blocks now rather than at its abort timeout.
                logger.error("KvlinkConnector: read of %s refused: %s", rid, e)
                self.load_errors.update(spec.all_local())
                self.failed_now.add(rid)
                self.stats.record_failure("refused")
                # This rank's own sources: a prefill rank read by several decode ranks waits
                # for each of them.
                self._reject(spec.remote_addresses, spec.remote_request_id, f"read refused by the decode: {e}", own=True)
                continue
            self.reading[rid] = spec.all_local()
        for rid in meta.cancels:
            if rid in self.reading and self._guard("cancel", rid, self.engine.cancel, rid):
                self.cancelled.add(rid)
        for addresses, remote_id, reason in meta.rejects:
            self._reject(addresses, remote_id, reason)

    def _reject(self, addresses: List[str], remote_id: str, reason: str, own: bool = False) -> None:
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
            self._guard("reject", remote_id, self.engine.reject, str(peer), remote_id, reason)

    def _guard(self, what: str, rid: str, fn, *args) -> bool:
        try:
            return fn(*args) is not False
        except Exception as e:  # noqa: BLE001 - a worker step must not die of one request
            logger.error("KvlinkConnector: %s of %s failed: %s", what, rid, e)
            return False

    def poll(self, finished_req_ids: Set[str]) -> Tuple[Set[str], Set[str], Set[str]]:
        """Finished sends, finished receives (failed ones included), failed receives."""
        self.scheduler_finished |= set(finished_req_ids or ())
        f = self.engine.get_finished()
        recving: Set[str] = set()
        failed: Set[str] = set()
        for rid in f.sending:
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
                if rid in self.held:
                    logger.warning("KvlinkConnector: send of %s ended without a read: %s", rid, failure["reason"])
                    self.held.discard(rid)
                    self.sends_ended.add(rid)
                continue
            blocks = self.reading.pop(rid, None)
            if blocks is None:
                continue
            recving.add(rid)
            if rid in self.cancelled:
                self.cancelled.discard(rid)
            else:
                # Any other failure (a cancel this connector did not ask for included) leaves
                # blocks vLLM must not trust.
                logger.warning("KvlinkConnector: read of %s failed (%s): %s", rid, failure["cause"], failure["reason"])
                failed.add(rid)
                self.load_errors.update(blocks)
        recving |= self.failed_now
        failed |= self.failed_now
        self.failed_now = set()
        sending = self.sends_ended & self.scheduler_finished
        self.sends_ended -= sending
        self.scheduler_finished -= sending
        # Finished requests with no send pending need no memory of their id.
        self.scheduler_finished &= self.held | self.sends_ended
        return sending, recving, failed

    def take_load_errors(self) -> Set[int]:
        out, self.load_errors = self.load_errors, set()
        return out

    def take_stats(self) -> Optional[KvlinkConnectorStats]:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KvlinkConnectorStats()
        return out

    def close(self) -> None:
        self.engine.close()


def _node_address() -> str:
    try:
        from vllm.utils.network_utils import get_ip
    except ImportError:  # pragma: no cover - older vLLM
        from vllm.utils import get_ip  # type: ignore[no-redef]
    return get_ip()


@dataclass
class _Producing:
    request: "Request"
    held: Optional[List[List[int]]] = None
    """Per KV cache group, the block at each position of the prompt (0 where none is sent)."""


def _group_windows(kv_cache_config: Optional["KVCacheConfig"]) -> List[int]:
    """Per KV cache group, its sliding window in tokens (0: full attention). An SSM state
    group is refused."""
    if kv_cache_config is None:
        return [0]
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    windows = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            raise ValueError(
                f"KvlinkConnector: KV cache group {g} holds SSM state ({type(spec).__name__}), "
                "which kvlink does not transfer yet; attention groups (full, sliding window) are "
                "supported"
            )
        windows.append(spec.sliding_window if isinstance(spec, SlidingWindowSpec) else 0)
    return windows


def _clip(ids: List[int], tail: int) -> List[int]:
    """A group's blocks with the positions before its last ``tail`` set to 0 (not sent)."""
    if not tail or len(ids) <= tail:
        return list(ids)
    return [0] * (len(ids) - tail) + list(ids[-tail:])


class _SchedulerSide:
    """The scheduler's view: what each worker must hold, read, cancel or reject per step."""

    def __init__(self, owner: KvlinkConnector, kv_cache_config: Optional["KVCacheConfig"]):
        self.owner = owner
        self.block_size = owner._block_size
        self.windows = _group_windows(kv_cache_config)
        # The prefill holds a sliding-window group's last blocks, one more than the window
        # spans (it may not be aligned with the blocks).
        self.tails = [math.ceil(w / self.block_size) + 1 if w else 0 for w in self.windows]
        self.addresses: Optional[List[str]] = None
        self.producing: Dict[str, _Producing] = {}
        self.local_hits: Dict[str, int] = {}
        self.meta = KvlinkConnectorMetadata()
        # Decode: reads handed to the workers and not reported finished yet.
        self.reading: Set[str] = set()
        # Requests whose unusable parameters were already logged.
        self.warned: Set[str] = set()

    def set_addresses(self, metadata: Dict[int, KVConnectorHandshakeMetadata]) -> None:
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

    def _usable(self, remote: "_Remote") -> Optional[str]:
        """Why this engine cannot read from the prefill the parameters name, if it cannot."""
        tp = self.owner._tp_size
        try:
            kvlink.tp_sources(0, tp, len(remote.addresses))
        except kvlink.InvalidArgument:
            return (
                f"the prefill has {len(remote.addresses)} TP ranks and this engine {tp}; one "
                "must be a multiple of the other"
            )
        if len(remote.blocks) != len(self.tails):
            return (
                f"the prefill sent blocks of {len(remote.blocks)} KV cache groups; this engine "
                f"has {len(self.tails)}"
            )
        return None

    def matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        params = request.kv_transfer_params
        if not params:
            return 0, False
        if params.get("do_remote_decode"):
            self.producing.setdefault(request.request_id, _Producing(request))
            return 0, False
        if not params.get("do_remote_prefill"):
            return 0, False
        remote = _remote(params, self.block_size)
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
        # Only what the prefill can deliver counts: its tokens, within the blocks it offered.
        offered = min(len(g) for g in remote.blocks) * self.block_size
        available = min(remote.num_tokens, offered, request.num_prompt_tokens)
        count = available - num_computed_tokens
        self.local_hits[request.request_id] = num_computed_tokens
        if count > 0:
            return count, True
        return 0, False

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False
        rid = request.request_id
        local_hit = self.local_hits.pop(rid, 0)
        self.warned.discard(rid)
        remote = _remote(params, self.block_size)
        if num_external_tokens <= 0:
            # Nothing to read (a local hit, or parameters this engine cannot use): the
            # prefill may free its blocks now.
            if not isinstance(remote, str):
                self.meta.rejects.append((remote.addresses, remote.request_id, "nothing to read from this prefill"))
            return
        assert not isinstance(remote, str), remote  # checked by matched_tokens
        first = local_hit // self.block_size
        total = local_hit + num_external_tokens
        end = math.ceil(total / self.block_size)
        local_groups, remote_groups = [], []
        refused = ""
        for g, (local_all, theirs) in enumerate(zip(blocks.get_block_ids(), remote.blocks)):
            # A sliding window's group needs only the blocks of its last tokens: vLLM skips
            # the tokens before ``total - window + 1`` (and the prefill may have freed them).
            w = self.windows[g]
            need = max(first, max(0, total - w + 1) // self.block_size) if w else first
            if end > len(theirs) or end > len(local_all):
                # matched_tokens bounds the count by the remote blocks; this cannot happen
                # unless vLLM allocated fewer blocks than the tokens need. Fail the read,
                # never read less.
                refused = (
                    f"blocks up to {end} are needed in KV cache group {g}; the prefill offered "
                    f"{len(theirs)}, {len(local_all)} are allocated"
                )
                break
            pairs = [(local_all[i], theirs[i]) for i in range(need, end) if local_all[i]]
            if any(r == 0 for _, r in pairs):
                refused = f"the prefill sent no block for a position this engine needs in KV cache group {g}"
                break
            local_groups.append([l for l, _ in pairs])
            remote_groups.append([r for _, r in pairs])
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
        )
        self.reading.add(rid)

    def update_output(self, output: "KVConnectorOutput") -> None:
        for rid in output.finished_recving or ():
            self.reading.discard(rid)

    # -- both --

    def build_meta(self, so: "SchedulerOutput") -> KvlinkConnectorMetadata:
        for rid in getattr(so, "preempted_req_ids", None) or ():
            p = self.producing.get(rid)
            if p is not None and p.held is not None:
                self.meta.releases.append(rid)
                self.meta.holds.pop(rid, None)
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
            needed = math.ceil(req.num_prompt_tokens / self.block_size)
            held = [
                _clip(list(ids[:needed]), tail)
                for ids, tail in zip(manager.get_block_ids(rid), self.tails)
            ]
            # Held in this step, before its output (and the request's transfer parameters)
            # can reach the decode; vLLM's null block (0) is never held.
            self.meta.holds[rid] = [[b for b in ids if b] for ids in held]
            p.held = held
        meta, self.meta = self.meta, KvlinkConnectorMetadata()
        return meta

    def request_finished(self, request: "Request") -> Tuple[bool, Optional[Dict[str, Any]]]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        params = request.kv_transfer_params
        self.local_hits.pop(rid, None)
        p = self.producing.pop(rid, None)
        if p is not None:
            normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            if p.held is None:
                self.meta.holds.pop(rid, None)
                return False, None
            if not normal or self.addresses is None:
                if self.addresses is None:
                    logger.error("KvlinkConnector: no handshake metadata from the workers; %s is not offered to a decode", rid)
                self.meta.holds.pop(rid, None)
                self.meta.releases.append(rid)
                return False, None
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_addresses": list(self.addresses),
                "remote_request_id": rid,
                # One list per KV cache group (a flat list when there is one group).
                "remote_block_ids": [list(g) for g in p.held] if len(p.held) > 1 else list(p.held[0]),
                "remote_num_tokens": request.num_prompt_tokens,
                "remote_engine_id": self.owner._kv_transfer_config.engine_id,
                "tp_size": len(self.addresses),
            }
        self.warned.discard(rid)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Finished (aborted, refused) before its blocks were allocated: never read.
            params["do_remote_prefill"] = False
            remote = _remote(params, self.block_size)
            if not isinstance(remote, str):
                self.meta.rejects.append((remote.addresses, remote.request_id, "request finished before its read started"))
        elif rid in self.reading:
            # Aborted while its read is in flight: vLLM keeps the blocks until the worker
            # reports the read finished, which the cancel brings about at once.
            self.meta.cancels.append(rid)
        return False, None


@dataclass
class _Remote:
    addresses: List[str]
    request_id: str
    blocks: List[List[int]]
    """Per KV cache group, the prefill's block at each position (0: none sent)."""
    num_tokens: int


def _block_list(blocks: Any) -> bool:
    return isinstance(blocks, (list, tuple)) and all(
        isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2**32 for b in blocks
    )


def _remote(params: Dict[str, Any], block_size: int):
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
            "remote_block_ids must be a list of block ids (integers 0 to 2^32-1), or one such "
            "list per KV cache group"
        )
    tokens = params.get("remote_num_tokens")
    if tokens is None:
        tokens = min(len(g) for g in groups) * block_size
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        return "remote_num_tokens must be a non-negative integer"
    return _Remote(list(addresses), rid, groups, tokens)
