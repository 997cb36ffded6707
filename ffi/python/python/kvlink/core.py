"""The connector core the vLLM, SGLang and ATOM connectors share: one settings schema read from
each engine's own configuration place, one way to build a rank's engine, one address and port
policy, and the checks of transfer parameters that come back from a router.

Each engine names the settings in its own place (vLLM's ``kv_connector_extra_config``, ATOM's
``kv_transfer_config`` with a ``kvlink_`` prefix, SGLang's environment); ``Settings.read``
takes that place and the engine's names for the fields. A setting absent there is read from
``KVLINK_<FIELD>`` in the environment, and one absent from both is left to ``kvlink.Engine``,
whose defaults are the only ones (``engine_options`` passes only what was set).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from http.server import ThreadingHTTPServer
from typing import Any

from ._kvlink import TRANSPORTS, Engine

__all__ = [
    "FIELDS",
    "Settings",
    "address",
    "advertised_host",
    "block_ids",
    "hold_token",
    "keyed",
    "listen_address",
    "make_engine",
    "rank_port",
    "serve_metrics",
    "transport_summary",
]

#: The schema: each setting and what it holds. ``listen`` is ``host:port`` (either part may be
#: left out: ``host``, ``:port``); ``auth_key_file`` names a file whose contents are the key.
FIELDS: dict[str, str] = {
    "listen": "host:port the rank's engine listens on (port: TP rank 0's; the others follow)",
    "transport": "auto, network, tcp, rdma or local",
    "request_timeout": "seconds a decode read may take",
    "abort_timeout": "seconds a prefill holds blocks no decode reads",
    "lease": "seconds a prefill keeps blocks once their reader lost every connection",
    "session_idle": "seconds an unused session stays open (0: always)",
    "auth_key": "the deployment key",
    "auth_key_file": "a file holding the deployment key",
    "rdma_device": "the RDMA device (default: the first usable one)",
    "kv_cache_layout": "the KV cache layout to ask the engine for (vLLM)",
    "metrics_port": "TP rank 0's Prometheus port (GET /metrics; the others follow; unset: none)",
}

_SECONDS = ("request_timeout", "abort_timeout", "lease", "session_idle")
# The variables ``kvlink.Engine`` reads itself when given no key (KVLINK_AUTH_KEY, then
# KVLINK_AUTH_KEY_FILE): left to it, so that every engine reads them the same way.
_ENGINE_READS = ("auth_key", "auth_key_file")


@dataclass(frozen=True)
class Settings:
    """What a connector was told; ``None`` leaves a setting to ``kvlink.Engine``."""

    host: str | None = None
    port: int = 0
    transport: str | None = None
    request_timeout: float | None = None
    abort_timeout: float | None = None
    lease: float | None = None
    session_idle: float | None = None
    auth_key: bytes | None = None
    rdma_device: str | None = None
    kv_cache_layout: str | None = None
    metrics_port: int = 0

    @staticmethod
    def read(
        place: Mapping[str, Any],
        names: Mapping[str, str | None] | None = None,
        where: str = "the configuration",
        env: Mapping[str, str] = os.environ,
    ) -> Settings:
        """The settings in ``place`` under the engine's ``names`` (field -> key; a field not
        named is read under its own name, one named None not from ``place``), else
        ``KVLINK_<FIELD>`` in ``env`` (but the key's variables, which ``kvlink.Engine`` reads
        itself). Raises ``ValueError`` naming the key and ``where`` it was read for a value
        that is not one."""
        names = dict(names or {})
        raw: dict[str, tuple[Any, str]] = {}
        for field in FIELDS:
            key = names.get(field, field)
            var = "KVLINK_" + field.upper()
            if key is not None and place.get(key) not in (None, ""):
                raw[field] = (place[key], f"{key} in {where}")
            elif env.get(var) and field not in _ENGINE_READS:
                raw[field] = (env[var], var)
        return _parse(raw)

    def engine_options(self) -> dict[str, Any]:
        """The ``kvlink.Engine`` keyword arguments these settings set (nothing else)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("host", "port", "kv_cache_layout", "metrics_port") or value is None:
                continue
            out[f.name] = value
        return out


def _parse(raw: Mapping[str, tuple[Any, str]]) -> Settings:
    values: dict[str, Any] = {}
    if "listen" in raw:
        values["host"], values["port"] = _listen(*raw["listen"])
    for name in _SECONDS:
        if name in raw:
            values[name] = _seconds(*raw[name])
    if "transport" in raw:
        value, source = raw["transport"]
        if str(value) not in TRANSPORTS:
            raise ValueError(f"kvlink: {source} must be one of {', '.join(TRANSPORTS)}, got {value!r}")
        values["transport"] = str(value)
    key = _key(raw)
    if key is not None:
        values["auth_key"] = key
    for name in ("rdma_device", "kv_cache_layout"):
        if name in raw:
            values[name] = str(raw[name][0])
    if "metrics_port" in raw:
        values["metrics_port"] = _port(*raw["metrics_port"])
    return Settings(**values)


def _port(value: Any, source: str) -> int:
    if not str(value).isdigit() or not 0 <= int(value) < 65536:  # 0: none
        raise ValueError(f"kvlink: {source} must be a port, got {value!r}")
    return int(value)


def _listen(value: Any, source: str) -> tuple[str | None, int]:
    text = str(value)
    host, sep, port = text.rpartition(":")
    if not sep:  # a host alone
        host, port = text, "0"
    if host.count(":") and not host.startswith("["):  # a bare IPv6 address, no port
        host, port = text, "0"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"kvlink: {source} must be 'host:port', got {value!r}")
    return host.strip("[]") or None, int(port)


def _seconds(value: Any, source: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"kvlink: {source} must be a number of seconds, got {value!r}") from None
    if not seconds >= 0:
        raise ValueError(f"kvlink: {source} must be 0 or more seconds, got {value!r}")
    return seconds


def _key(raw: Mapping[str, tuple[Any, str]]) -> bytes | None:
    if "auth_key" in raw:
        value = raw["auth_key"][0]
        return value if isinstance(value, bytes) else str(value).encode()
    if "auth_key_file" in raw:
        path, source = raw["auth_key_file"]
        try:
            with open(path, "rb") as f:
                return f.read().rstrip(b"\r\n")  # as the engine reads KVLINK_AUTH_KEY_FILE
        except OSError as e:
            raise ValueError(f"kvlink: {source}: cannot read {path!r}: {e}") from None
    return None


def keyed(settings: Settings, env: Mapping[str, str] = os.environ) -> bool:
    """Whether engines hold a deployment key (from the settings or the environment)."""
    return settings.auth_key is not None or bool(env.get("KVLINK_AUTH_KEY") or env.get("KVLINK_AUTH_KEY_FILE"))


def address(host: str, port: int) -> str:
    """``host:port``, bracketing an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def rank_port(base: int, offset: int) -> int:
    """The port of the rank ``offset`` places after the first: ``base + offset``, or 0 (an
    ephemeral port) when no base port is set."""
    return base + offset if base else 0


def advertised_host(settings: Settings, node_address: Callable[[], str]) -> str:
    """The host engines listen on and a prefill names to its readers: the host set, else this
    node's address (``node_address``, the engine's own way to find it) when engines are keyed
    (they may listen beyond loopback), else 127.0.0.1 (an unkeyed engine serves loopback
    only)."""
    return settings.host or (node_address() if keyed(settings) else "127.0.0.1")


def listen_address(settings: Settings, offset: int, node_address: Callable[[], str]) -> str:
    """Where the rank ``offset`` places after the first listens: ``advertised_host`` and
    ``rank_port(settings.port, offset)``."""
    return address(advertised_host(settings, node_address), rank_port(settings.port, offset))


def make_engine(settings: Settings, listen: str, **options: Any) -> Engine:
    """A rank's ``kvlink.Engine`` at ``listen`` with the settings' options and the glue's own
    (``tp_rank``, ``tp_size``; they win over the settings)."""
    return Engine(listen, **{**settings.engine_options(), **options})


def serve_metrics(settings: Settings, engines: list[Engine], offset: int) -> ThreadingHTTPServer | None:
    """When ``metrics_port`` is set, serves the engines' counters (``kvlink.metrics``) on
    ``rank_port(metrics_port, offset)`` of the host the engines listen on; the caller shuts it
    down with its engines. None otherwise."""
    if not settings.metrics_port:
        return None
    from .metrics import serve

    host = engines[0].handshake_address.rpartition(":")[0].strip("[]")
    return serve(list(engines), rank_port(settings.metrics_port, offset), host)


def transport_summary(engine: Engine) -> str:
    """How ``engine`` moves bytes, for a start-up log line: ``RDMA on <device>``, or ``TCP``
    with why RDMA is not used."""
    if engine.rdma_device:
        return "RDMA on " + engine.rdma_device
    return f"TCP; RDMA: {engine.rdma_unavailable_reason}"


def block_ids(value: Any) -> list[int] | None:
    """``value`` (a list or tuple) as a list of block ids (integers 0 to 2^32-1), or None when
    it is not one."""
    if not isinstance(value, (list, tuple)):
        return None
    if not all(type(b) is int and 0 <= b < 1 << 32 for b in value):
        return None
    return list(value)


def hold_token(value: Any) -> int | None:
    """``value`` as a hold's token (an integer from 1 to 2^64-1), or None when it is not one."""
    return value if type(value) is int and 0 < value < 1 << 64 else None
