"""kvlink as an SGLang PD-disaggregation transfer backend.

SGLang (0.5.23 checked) picks its backend from a closed list (``TransferBackend``: mooncake,
mori, nixl, ascend, fake) and has no plugin point for another. ``install()`` is the smallest
registration that works: it makes ``--disaggregation-transfer-backend kvlink`` a valid choice,
resolves ``TransferBackend("kvlink")`` to a backend value of its own, and routes SGLang's class
lookups (``get_kv_class``, which the prefill and decode schedulers and the bootstrap service
import by name) to kvlink's classes for it, leaving every other backend as it was.

It must run in every SGLang process (the launcher, the tokenizer manager that starts the
bootstrap server, each scheduler). ``python -m kvlink.sglang <sglang.launch_server arguments>``
does that: it installs, then runs SGLang's own launcher; scheduler processes, which
multiprocessing starts by re-importing the main module, install again on import.

Settings (environment): ``KVLINK_HOST`` (the address the engines listen on; defaults to
loopback, or to the node's address when a key is set), ``KVLINK_AUTH_KEY`` /
``KVLINK_AUTH_KEY_FILE`` (the deployment key; without one kvlink serves loopback only),
``KVLINK_TRANSPORT`` (``auto``, ``network``, ``tcp``, ``rdma``, ``local``), ``KVLINK_RDMA_DEVICE`` (before
SGLang's ``--disaggregation-ib-device``; see ``kvlink.sglang.nic``), ``KVLINK_REQUEST_TIMEOUT``,
``KVLINK_ABORT_TIMEOUT``, ``KVLINK_LEASE``, ``KVLINK_SESSION_IDLE``, ``KVLINK_METRICS_PORT``
(``kvlink.core``'s schema: one unset is left to ``kvlink.Engine``'s default), and
``KVLINK_PEER_TIMEOUT``.

Modules: ``manager`` (a rank's engines and the rooms' traffic), ``sender`` and ``receiver`` (the
rooms, on ``room``; ``conn`` re-exports them), ``wire`` (the messages), ``bootstrap`` (the
registry), ``settings`` (what is read at start), ``states`` (SGLang's state types), ``nic``.
"""

from __future__ import annotations

from typing import Any

from kvlink.sglang.bootstrap import KvlinkBootstrapServer
from kvlink.sglang.conn import KvlinkKVManager, KvlinkKVReceiver, KvlinkKVSender, KvlinkTransferError

__all__ = [
    "KvlinkBootstrapServer",
    "KvlinkKVManager",
    "KvlinkKVReceiver",
    "KvlinkKVSender",
    "KvlinkTransferError",
    "BACKEND",
    "install",
]

BACKEND = "kvlink"
_installed = False


def _backend_value(enum_cls: Any) -> Any:
    """``TransferBackend("kvlink")``: a value of SGLang's enum that compares unequal to its own
    backends (Enum's ``_missing_`` hook, so the enum's members are unchanged)."""
    existing = enum_cls._value2member_map_.get(BACKEND)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_ = "KVLINK"
    member._value_ = BACKEND
    enum_cls._value2member_map_[BACKEND] = member
    previous = enum_cls.__dict__.get("_missing_")

    def _missing_(cls: Any, value: Any) -> Any:
        if value == BACKEND:
            return member
        return previous.__func__(cls, value) if previous is not None else None

    enum_cls._missing_ = classmethod(_missing_)
    return member


def install() -> None:
    """Registers kvlink with the SGLang imported in this process (idempotent)."""
    global _installed
    if _installed:
        return
    import importlib

    from sglang.srt.disaggregation import utils

    try:
        from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES

        if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
            DISAGG_TRANSFER_BACKEND_CHOICES.append(BACKEND)
    except ImportError:  # pragma: no cover - other SGLang layouts keep choices elsewhere
        pass
    ours = _backend_value(utils.TransferBackend)
    original = utils.get_kv_class
    if getattr(original, "_kvlink", False):
        _installed = True
        return
    classes = {
        utils.KVClassType.MANAGER: KvlinkKVManager,
        utils.KVClassType.SENDER: KvlinkKVSender,
        utils.KVClassType.RECEIVER: KvlinkKVReceiver,
        utils.KVClassType.BOOTSTRAP_SERVER: KvlinkBootstrapServer,
    }

    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        if transfer_backend is ours and class_type in classes:
            return classes[class_type]
        return original(transfer_backend, class_type)

    get_kv_class._kvlink = True  # type: ignore[attr-defined]
    for name in (
        "sglang.srt.disaggregation.utils",
        "sglang.srt.disaggregation.prefill",
        "sglang.srt.disaggregation.decode",
        "sglang.srt.managers.disagg_service",
    ):
        try:
            module = importlib.import_module(name)
        except ImportError:  # pragma: no cover - a module this SGLang does not have
            continue
        if getattr(module, "get_kv_class", None) is original:
            setattr(module, "get_kv_class", get_kv_class)  # noqa: B010 - a module SGLang reads
    _installed = True
