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
    (vLLM's ``data_parallel_index``) listens on ``port + d * tp_size + r``. Default: the
    node's address (``127.0.0.1`` without an authentication key) and an ephemeral port.
``transport``
    ``auto`` (the same-host path when prefill and decode share a machine and the cache can be
    shared, GPU memory through CUDA IPC; else RDMA when a device is usable; else TCP),
    ``network`` (RDMA or TCP only), ``tcp``, ``rdma`` or ``local``.
``abort_timeout``
    Seconds the prefill holds a request's blocks for a decode that never reads them (480).
``lease``
    Seconds the prefill keeps a request's blocks once the decode reading them lost every control
    connection to it (closed, or silent for three keep-alives), unless it connects again (30).
``request_timeout``
    Seconds a decode read may take before it fails and vLLM recomputes (60).
``session_idle``
    Seconds a session to a peer stays open with no read or message using it; then it closes in
    order (the peer keeps this engine's holds) and the next read opens a new one (120; 0 keeps
    sessions open).
``auth_key`` / ``auth_key_file``
    The deployment key every engine shares (also read from ``KVLINK_AUTH_KEY`` /
    ``KVLINK_AUTH_KEY_FILE``). Without one, engines listen on loopback only.
``rdma_device``
    The RDMA device to use (default: the first usable one).
``kv_cache_layout``
    The KV cache layout the connector asks vLLM for (``get_required_kvcache_layout``):
    ``LBHNC`` by default (head-major blocks: a decode of another TP size reads one piece per
    block and layer), any of ``LBHNC``, ``LBNHC``, ``BLHNC``, ``BLNHC``, or ``auto`` (the
    attention backend's choice). ``VLLM_KV_CACHE_LAYOUT`` overrides it; ``LHBNC`` and
    ``BHLNC`` (blocks split into one piece per head) are refused at start.

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
ranks; MLA latents are read whole); the KV caches vLLM allocates (one backing allocation, a
``[blocks, heads, tokens, K|V]`` view per layer) in the block-dense layouts ``LBHNC``,
``LBNHC``, ``BLHNC``, ``BLNHC`` (a prefill and a decode may differ in where the layer sits,
not in the order inside a block), kernel block splitting, per-group block sizes, layers that
reuse another layer's cache (skipped: vLLM aliases them), GPU or host memory, any dtype (both
sides must agree).
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    SupportsHMA,
)

import kvlink

from .layout import PREFERRED_LAYOUT, is_head_major, kv_cache_tensors, layout_name
from .metadata import KvlinkConnectorMetadata, KvlinkConnectorStats, KvlinkHandshakeMetadata, ReadSpec
from .scheduler import _SchedulerSide
from .worker import _WorkerSide

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

from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = [
    "KvlinkConnector",
    "KvlinkConnectorMetadata",
    "KvlinkConnectorStats",
    "KvlinkHandshakeMetadata",
    "ReadSpec",
    "kv_cache_tensors",
]


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
        # The engine's index among data-parallel engines: vLLM resets data_parallel_rank to 0
        # in each engine of a dense model and keeps the index in data_parallel_index.
        pc = vllm_config.parallel_config
        self._dp_index = int(getattr(pc, "data_parallel_index", None) or getattr(pc, "data_parallel_rank", 0) or 0)
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

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False (vLLM 0.33 asks, and refuses to start with ``enable_sleep_mode``): kvlink
        registers the KV cache once, and sleep mode frees and remaps that memory, after which
        reads would move stale pages."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        """The KV cache layout the connector asks vLLM for: ``LBHNC`` (head-major blocks) for
        per-head caches unless ``kv_cache_layout`` in ``kv_connector_extra_config`` says
        otherwise (``auto``: vLLM's choice); none for MLA. ``VLLM_KV_CACHE_LAYOUT`` overrides
        it (vLLM's rule); the two layouts whose blocks are split per head are refused at
        registration."""
        model = getattr(vllm_config, "model_config", None)
        if model is None or getattr(model, "use_mla", False):
            return None
        ktc = vllm_config.kv_transfer_config
        extra = (ktc.kv_connector_extra_config or {}) if ktc is not None else {}
        wanted = str(extra.get("kv_cache_layout", PREFERRED_LAYOUT))
        if wanted.lower() == "auto":
            return None
        is_head_major(wanted)  # refuses unknown and per-head-split layouts
        return layout_name(wanted)

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
    lease: float
    request_timeout: float
    session_idle: float
    auth_key: Optional[bytes]
    rdma_device: Optional[str]

    @staticmethod
    def parse(extra: Dict[str, Any]) -> "_Settings":
        known = {
            "listen", "transport", "abort_timeout", "lease", "request_timeout", "session_idle", "auth_key",
            "auth_key_file", "rdma_device",
            "kv_cache_layout",
        }
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
        if transport not in kvlink.TRANSPORTS:
            raise ValueError(
                f"KvlinkConnector: transport must be one of {', '.join(kvlink.TRANSPORTS)}, "
                f"got {transport!r}"
            )
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
            lease=float(extra.get("lease", 30.0)),
            request_timeout=float(extra.get("request_timeout", 60.0)),
            session_idle=float(extra.get("session_idle", 120.0)),
            auth_key=key,
            rdma_device=extra.get("rdma_device"),
        )

