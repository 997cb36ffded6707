"""What the ATOM connector reads from ATOM's ``--kv-transfer-config`` and its parallel
configuration, checked once at start (every process reads the same values)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

#: ATOM's own default for ``handshake_port`` (its Mooncake and MoRIIO connectors use it too).
DEFAULT_HANDSHAKE_PORT = 6301

_KNOWN = {
    "kv_connector",
    "kv_role",
    "handshake_port",
    "http_port",
    "proxy_ip",
    "proxy_ping_port",
    "kvlink_host",
    "kvlink_transport",
    "kvlink_request_timeout",
    "kvlink_abort_timeout",
    "kvlink_lease",
    "kvlink_session_idle",
    "ib_device",
}


@dataclass(frozen=True)
class Settings:
    """The connector's settings; ``from_config`` reads them."""

    producer: bool
    handshake_port: int
    host: Optional[str]
    transport: str
    request_timeout: float
    abort_timeout: float
    lease: float
    session_idle: float
    rdma_device: Optional[str]
    block_size: int
    tp_size: int
    dp_size: int
    dp_rank: int

    @staticmethod
    def from_config(config: Any) -> "Settings":
        """Reads ATOM's ``Config``; raises ``ValueError`` naming the setting at fault."""
        kv: Dict[str, Any] = dict(config.kv_transfer_config or {})
        role = kv.get("kv_role", "kv_producer")
        if role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"kvlink: kv_role must be kv_producer or kv_consumer, got {role!r}")
        unknown = sorted(k for k in kv if k not in _KNOWN and k.startswith("kvlink"))
        if unknown:
            raise ValueError(f"kvlink: unknown kv_transfer_config keys {unknown}; known: {sorted(_KNOWN)}")
        port = int(kv.get("handshake_port", DEFAULT_HANDSHAKE_PORT))
        if not 0 < port < 65536:
            raise ValueError(f"kvlink: handshake_port {port} is not a port")
        pp = int(getattr(config, "pipeline_parallel_size", 1) or 1)
        if pp != 1:
            raise ValueError(f"kvlink: pipeline parallelism (pipeline_parallel_size={pp}) is not supported")
        _refuse_slot_staging(config)
        par = config.parallel_config
        return Settings(
            producer=role == "kv_producer",
            handshake_port=port,
            host=kv.get("kvlink_host"),
            transport=str(kv.get("kvlink_transport", os.environ.get("KVLINK_TRANSPORT", "auto"))),
            request_timeout=float(kv.get("kvlink_request_timeout", 60.0)),
            abort_timeout=float(kv.get("kvlink_abort_timeout", 480.0)),
            lease=float(kv.get("kvlink_lease", 30.0)),
            session_idle=float(kv.get("kvlink_session_idle", 120.0)),
            rdma_device=kv.get("ib_device") or os.environ.get("KVLINK_RDMA_DEVICE") or None,
            block_size=int(config.kv_cache_block_size),
            tp_size=int(config.tensor_parallel_size),
            dp_size=int(getattr(par, "data_parallel_size", 1) or 1),
            dp_rank=int(getattr(par, "data_parallel_rank", 0) or 0),
        )


def _refuse_slot_staging(config: Any) -> None:
    """DeepSeek-V4 moves per-request compressor and SWA state through slot regions and GPU
    gather/scatter kernels (ATOM's PD staging); kvlink moves paged blocks only."""
    arches = getattr(getattr(config, "hf_config", None), "architectures", None) or []
    v4 = [a for a in arches if "DeepseekV4" in str(a)]
    if v4:
        raise ValueError(
            f"kvlink: {v4[0]} keeps per-request state in slot regions that ATOM stages with GPU "
            "gather kernels (PD staging); kvlink moves paged KV blocks only. Use ATOM's mooncake "
            "or moriio connector for DeepSeek-V4."
        )


def port_offset(dp_rank: int, tp_rank: int, tp_size: int, dp_size: int) -> int:
    """ATOM's side-channel port layout (``port_offset.side_channel_port_offset``, PP 1)."""
    from atom.kv_transfer.disaggregation.port_offset import side_channel_port_offset

    return side_channel_port_offset(dp_rank, tp_rank, tp_size, 0, 1, dp_size)


def address(host: str, port: int) -> str:
    """``host:port``, bracketing IPv6 hosts."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_host(settings: Settings) -> str:
    """The host workers listen on and the prefill names to its readers: ``kvlink_host``, else
    this node's address when engines are keyed (they may listen beyond loopback), else
    127.0.0.1 (unkeyed engines listen on loopback only)."""
    if settings.host:
        return settings.host
    if os.environ.get("KVLINK_AUTH_KEY") or os.environ.get("KVLINK_AUTH_KEY_FILE"):
        from atom.utils.network import get_ip

        return get_ip()
    return "127.0.0.1"
