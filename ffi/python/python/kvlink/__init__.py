"""kvlink: moves LLM KV-cache blocks between inference engines (RDMA READ, TCP fallback).

The engine, its finished sets and the TP aggregator come from the native core
(``kvlink._kvlink``). ``kvlink.metrics`` renders an engine's counters for Prometheus;
``kvlink.vllm`` is the vLLM KV connector (import it only where vLLM is installed).

Request ids are ``str`` end to end: the ids returned by ``get_finished`` and
``TpAggregator.take`` are the ones passed to ``read_blocks`` / ``hold_blocks``.
"""

from ._kvlink import (
    TRANSPORTS,
    Engine,
    Finished,
    IncompatiblePeer,
    InvalidArgument,
    KvlinkError,
    KvlinkTimeout,
    PeerError,
    RdmaUnavailable,
    TpAggregator,
    __version__,
    tp_sources,
)
from .core import transport_summary

__all__ = [
    "Engine",
    "Finished",
    "IncompatiblePeer",
    "InvalidArgument",
    "KvlinkError",
    "KvlinkTimeout",
    "PeerError",
    "RdmaUnavailable",
    "TpAggregator",
    "TRANSPORTS",
    "__version__",
    "tp_sources",
    "transport_summary",
]
