"""vLLM's KV connector class on kvlink (its module docs are ``kvlink.vllm``'s): the scheduler
and worker roles, each delegating to its side (``scheduler``, ``worker``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    SupportsHMA,
)

import kvlink

from .. import core
from .layout import PREFERRED_LAYOUT, is_head_major, layout_name
from .metadata import KvlinkConnectorMetadata, KvlinkConnectorStats, KvlinkHandshakeMetadata
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


class KvlinkConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector on kvlink (scheduler and worker roles); see the module docs. Supports
    vLLM's hybrid KV cache manager (``SupportsHMA``): each KV cache group's blocks are a block
    group of the kvlink layout, read with their own block ids."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        # vLLM always passes a KV cache config; None is kept for callers of earlier releases.
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._block_size = vllm_config.cache_config.block_size
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        # The engine's index among data-parallel engines: vLLM resets data_parallel_rank to 0
        # in each engine of a dense model and keeps the index in data_parallel_index.
        pc = vllm_config.parallel_config
        self._dp_index = int(getattr(pc, "data_parallel_index", None) or getattr(pc, "data_parallel_rank", 0) or 0)
        self._settings = read_settings(extra)
        self._layers_per_part = _layers_per_part(extra)
        self._num_groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler: _SchedulerSide | None = _SchedulerSide(self, kv_cache_config)
            self._worker: _WorkerSide | None = None
        else:
            self._scheduler = None
            self._worker = _WorkerSide(self, kv_cache_config)

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._need_worker().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KvlinkHandshakeMetadata | None:
        return self._need_worker().handshake_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvlinkConnectorMetadata), type(meta)
        self._need_worker().apply(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # reads are asynchronous: requests wait for their KV outside the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # The decode pulls; nothing is pushed. A progressive hold grows by the layers written.
        self._need_worker().layer_saved(layer_name)

    def wait_for_save(self) -> None:
        # The forward is done: progressive holds grow by what it completed (sealed at the
        # prompt's end).
        self._need_worker().forward_done()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._need_worker().poll(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]):
        sending, recving, failed = self._need_worker().poll(finished_req_ids)
        if KVConnectorTransferResults is None:
            return sending, recving
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._need_worker().take_load_errors()

    def get_kv_connector_stats(self) -> KvlinkConnectorStats | None:
        if self._worker is None:
            return None
        return self._worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvlinkConnectorStats:
        return KvlinkConnectorStats(data=data) if data else KvlinkConnectorStats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    @property
    def engine(self) -> kvlink.Engine | None:
        """The worker's kvlink engine (None on the scheduler)."""
        return self._worker.engine if self._worker is not None else None

    # ---- scheduler side ----------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._need_scheduler().set_addresses(metadata)

    def on_new_request(self, request: Request) -> None:
        self._need_scheduler().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._need_scheduler().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._need_scheduler().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvlinkConnectorMetadata:
        return self._need_scheduler().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._need_scheduler().update_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._need_scheduler().request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._need_scheduler().request_finished(request)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False (vLLM 0.33 asks, and refuses to start with ``enable_sleep_mode``): kvlink
        registers the KV cache once, and sleep mode frees and remaps that memory, after which
        reads would move stale pages."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
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
        wanted = read_settings(extra, warn=False).kv_cache_layout or PREFERRED_LAYOUT
        if wanted.lower() == "auto":
            return None
        is_head_major(wanted)  # refuses unknown and per-head-split layouts
        return layout_name(wanted)

    # ---- helpers -----------------------------------------------------------------------

    def _need_worker(self) -> _WorkerSide:
        if self._worker is None:
            raise RuntimeError("KvlinkConnector: a worker-side method was called on the scheduler")
        return self._worker

    def _need_scheduler(self) -> _SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("KvlinkConnector: a scheduler-side method was called on a worker")
        return self._scheduler


#: The key of ``kv_connector_extra_config`` that sets how many layers a progressive hold grows
#: by within a step (0: a part per step only).
LAYERS_PER_PART = "progressive_layers_per_part"


def _layers_per_part(extra: dict[str, Any]) -> int:
    value = extra.get(LAYERS_PER_PART, 2)
    if type(value) is not int or value < 0:
        raise ValueError(
            f"KvlinkConnector: {LAYERS_PER_PART} in kv_connector_extra_config must be 0 or more, got {value!r}"
        )
    return value


def read_settings(extra: dict[str, Any], warn: bool = True) -> core.Settings:
    """The connector's settings from ``kv_connector_extra_config`` (``kvlink.core``'s schema,
    under its own names), warning about keys it does not know unless ``warn`` is false (the
    layout query reads them before the connector does: one warning, not two)."""
    unknown = sorted(set(extra) - set(core.FIELDS) - {LAYERS_PER_PART})
    if unknown and warn:
        logger.warning("KvlinkConnector: ignoring unknown kv_connector_extra_config keys %s", unknown)
    return core.Settings.read(extra, where="kv_connector_extra_config")
