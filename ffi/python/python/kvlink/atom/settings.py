"""What the ATOM connector reads from ATOM's ``--kv-transfer-config`` and its parallel
configuration, checked once at start (every process reads the same values)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .. import core

#: ATOM's own default for ``handshake_port`` (its Mooncake and MoRIIO connectors use it too).
DEFAULT_HANDSHAKE_PORT = 6301

#: kvlink's settings (``kvlink.core``'s schema) under their ``kv_transfer_config`` names: the
#: field's name with a ``kvlink_`` prefix, ``kvlink_host`` (a host: the port is
#: ``handshake_port``) and ATOM's own ``ib_device``.
NAMES = {field: "kvlink_" + field for field in core.FIELDS}
NAMES.update(listen="kvlink_host", rdma_device="ib_device")

_KNOWN = {"kv_connector", "kv_role", "handshake_port", "http_port", "proxy_ip", "proxy_ping_port", *NAMES.values()}


@dataclass(frozen=True)
class Settings:
    """The connector's settings; ``from_config`` reads them. ``link`` is what kvlink's engine
    takes (with ``handshake_port`` as its port), the rest ATOM's layout."""

    producer: bool
    handshake_port: int
    link: core.Settings
    block_size: int
    tp_size: int
    dp_size: int
    dp_rank: int

    @staticmethod
    def from_config(config: Any) -> Settings:
        """Reads ATOM's ``Config``; raises ``ValueError`` naming the setting at fault."""
        kv: dict[str, Any] = dict(config.kv_transfer_config or {})
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
        _refuse_recurrent_state(config)
        par = config.parallel_config
        link = core.Settings.read(kv, NAMES, "kv_transfer_config")
        return Settings(
            producer=role == "kv_producer",
            handshake_port=port,
            link=replace(link, port=port),
            block_size=int(config.kv_cache_block_size),
            tp_size=int(config.tensor_parallel_size),
            dp_size=int(getattr(par, "data_parallel_size", 1) or 1),
            dp_rank=int(getattr(par, "data_parallel_rank", 0) or 0),
        )


# ATOM's models with per-request recurrent state, should its own list not import (facts of the
# pinned snapshot: InputOutputProcessor._per_req_cache_model_types).
_STATE_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear", "deepseek_v4"})


# Of those, the models whose state kvlink moves, whole per request: DeepSeek-V4's (ATOM's
# backend exports it as full SLOT regions) and the gated delta net and KDA hybrids' (the
# layers' own state views ATOM hands the connector).
_EXPORTED_STATE = frozenset({"deepseek_v4", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear"})


def _state_model_types() -> frozenset[str]:
    """The model types ATOM gives per-request state (its own single source of truth)."""
    try:
        from atom.model_engine.llm_engine import InputOutputProcessor

        return frozenset(InputOutputProcessor._per_req_cache_model_types())
    except (ImportError, AttributeError):
        return _STATE_MODEL_TYPES


def _refuse_recurrent_state(config: Any) -> None:
    """A model ATOM lists with per-request state that kvlink does not move (none of the
    snapshot's today: a later ATOM may list more): sending its paged KV alone would have the
    decode continue from a state that is not the prompt's, with fluent wrong output. Refused
    at start, naming the model type."""
    hf = getattr(config, "hf_config", None)
    types = {getattr(hf, "model_type", None), getattr(getattr(hf, "text_config", None), "model_type", None)}
    stateful = sorted(t for t in types if isinstance(t, str) and t in _state_model_types() - _EXPORTED_STATE)
    if stateful:
        raise ValueError(
            f"kvlink: model type {stateful[0]} keeps per-request recurrent state (conv and SSM "
            "state of its linear-attention layers) beside its paged KV; kvlink does not move it yet, "
            "and the paged KV alone would leave the decode computing from the wrong state"
        )


def port_offset(dp_rank: int, tp_rank: int, tp_size: int, dp_size: int) -> int:
    """ATOM's side-channel port layout (``port_offset.side_channel_port_offset``, PP 1)."""
    from atom.kv_transfer.disaggregation.port_offset import side_channel_port_offset

    return side_channel_port_offset(dp_rank, tp_rank, tp_size, 0, 1, dp_size)


def advertised_host(settings: Settings) -> str:
    """The host workers listen on and the prefill names to its readers (``kvlink.core``'s
    policy, with ATOM's way to find this node's address)."""
    return core.advertised_host(settings.link, node_address)


def node_address() -> str:
    """This node's address as ATOM finds it."""
    from atom.utils.network import get_ip

    return str(get_ip())
