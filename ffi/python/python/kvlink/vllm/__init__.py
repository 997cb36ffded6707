"""A vLLM KV connector on kvlink: the decode pulls a request's KV blocks from the prefill's
memory (RDMA READ, or TCP), block by block, straight into its own blocks.

Turn it on with::

    --kv-transfer-config '{"kv_connector": "KvlinkConnector",
                           "kv_connector_module_path": "kvlink.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"listen": "10.0.0.5:17000"}}'

Settings (``kv_connector_extra_config``, ``kvlink.core``'s schema; one absent there is read
from ``KVLINK_<NAME>``, e.g. ``KVLINK_LEASE``, else left to ``kvlink.Engine``'s default, the
figure in brackets):

``listen``
    ``host:port`` (or ``host``, or ``:port``) of TP rank 0's kvlink engine; rank ``r`` of data-parallel engine ``d``
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
``metrics_port``
    When set, each rank serves its engine's counters (``kvlink.metrics``, ``GET /metrics``)
    on this port plus its place, as ``listen``'s port (default: none).
``kv_cache_layout``
    The KV cache layout the connector asks vLLM for (``get_required_kvcache_layout``):
    ``LBHNC`` by default (head-major blocks: a decode of another TP size reads one piece per
    block and layer), any of ``LBHNC``, ``LBNHC``, ``BLHNC``, ``BLNHC``, or ``auto`` (the
    attention backend's choice). ``VLLM_KV_CACHE_LAYOUT`` overrides it; ``LHBNC`` and
    ``BHLNC`` (blocks split into one piece per head) are refused at start.
``progressive_layers_per_part``
    In a progressive transfer, how many layers a prefill's hold grows by within a step, as
    vLLM's save hooks report them written (2; 0: once per step).

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

Progressive flow (``python -m kvlink.vllm.proxy``, ``kvlink.vllm.progressive``): the proxy sends
both legs at once, the prefill's with ``transfer_id`` and ``transfer_hold``, the decode's with
``progressive: true``, the prefill's ``remote_addresses``, ``remote_request_id`` (the transfer
id), ``remote_hold`` and ``remote_block_sizes``. The prefill holds the request under the
transfer id from its first step and grows the hold as its forward completes blocks (per step,
and per ``progressive_layers_per_part`` layers within a step); the decode admits the request at
once and reads each part as it is held, skipping the blocks of a prefix it cached. Both
engines need KV cache groups of full attention or MLA only, and equal TP and block sizes; the
proxy asks each engine first (``kvlink_probe``) and runs the sequential flow otherwise.

Supported: vLLM 0.32 and 0.33 (tested); vLLM's hybrid KV cache manager (``SupportsHMA``): each KV
cache group's blocks travel with their own block ids (full-attention groups whole,
sliding-window groups only the blocks their window still sees, chunked local attention groups
those of the next token's chunk, Mamba-kind state groups the running-state block; see
docs/integration.md for the kinds refused at start);
a prefill and a decode of different TP sizes when one is a multiple of the other (each decode
rank reads its share of a prefill rank's KV heads, or gathers the heads of several prefill
ranks; MLA latents are read whole); the KV caches vLLM allocates (one backing allocation, a
``[blocks, heads, tokens, K|V]`` view per layer) in the block-dense layouts ``LBHNC``,
``LBNHC``, ``BLHNC``, ``BLNHC`` (a prefill and a decode may differ in where the layer sits,
not in the order inside a block), kernel block splitting, per-group block sizes, layers that
reuse another layer's cache (skipped: vLLM aliases them), GPU or host memory, any dtype (both
sides must agree).
"""

from .connector import KvlinkConnector
from .layout import kv_cache_tensors
from .metadata import KvlinkConnectorMetadata, KvlinkConnectorStats, KvlinkHandshakeMetadata, ReadSpec

__all__ = [
    "KvlinkConnector",
    "KvlinkConnectorMetadata",
    "KvlinkConnectorStats",
    "KvlinkHandshakeMetadata",
    "ReadSpec",
    "kv_cache_tensors",
]
