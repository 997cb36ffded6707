"""kvlink as a KV transfer backend of ATOM (ROCm/ATOM), in place of MoRIIO or Mooncake in
ATOM's P/D disaggregation: ``--kv-transfer-config '{"kv_connector": "kvlink", ...}'``.

ATOM has no entry-point discovery and starts its engine processes with ``spawn``, so the
backend must be registered with ATOM's ``KVConnectorFactory`` in every process. Importing
this package registers it; ``python -m kvlink.atom.serve`` runs ATOM's OpenAI server with it
(spawned children re-import that module, and so this package, before they build connectors).
Modules: ``settings`` (kv_transfer_config, ports), ``layout`` (KVTransferTensors as kvlink
regions), ``params`` (the transfer parameters), ``metadata``, ``scheduler``, ``worker``."""

from __future__ import annotations

#: The name ATOM's ``kv_transfer_config`` uses for this backend.
NAME = "kvlink"


def register() -> None:
    """Registers ``"kvlink"`` with ATOM's connector factory (idempotent)."""
    from atom.kv_transfer.disaggregation.factory import KVConnectorFactory

    KVConnectorFactory.register(
        NAME,
        worker_module="kvlink.atom.worker",
        worker_class="KvlinkWorker",
        scheduler_module="kvlink.atom.scheduler",
        scheduler_class="KvlinkScheduler",
        requires_pd_staging=False,
    )


register()
