"""kvlink as a KV transfer backend of ATOM (ROCm/ATOM), in place of MoRIIO or Mooncake in
ATOM's P/D disaggregation: ``--kv-transfer-config '{"kv_connector": "kvlink", ...}'``.

ATOM has no entry-point discovery and starts its engine processes with ``spawn``, so the
backend must be registered with ATOM's ``KVConnectorFactory`` in every process. Importing
this package registers it; ``python -m kvlink.atom.serve`` runs ATOM's OpenAI server with it
(spawned children re-import that module, and so this package, before they build connectors).
Settings (``kv_transfer_config``): ATOM's ``kv_role``, ``handshake_port`` (TP rank 0's of DP
rank 0; the others follow ATOM's side-channel layout) and ``ib_device`` (the RDMA device), and
kvlink's settings (``kvlink.core``) with a ``kvlink_`` prefix: ``kvlink_host``,
``kvlink_transport``, ``kvlink_request_timeout``, ``kvlink_abort_timeout``, ``kvlink_lease``,
``kvlink_session_idle``, ``kvlink_auth_key`` / ``kvlink_auth_key_file`` (the deployment key;
else ``KVLINK_AUTH_KEY`` / ``KVLINK_AUTH_KEY_FILE``), ``kvlink_metrics_port``. One absent is
read from ``KVLINK_<NAME>``, else left to ``kvlink.Engine``'s default.

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
