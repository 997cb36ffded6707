"""vLLM's KV caches as kvlink memory and layout.

What vLLM (0.32 and later) hands ``register_kv_caches``: one backing int8 allocation for every
layer, and per layer a 4-D view ``[B, H, N, C]`` of it (blocks, KV heads, tokens per kernel
block, K and V packed in C), whose physical order is the resolved ``KVCacheLayout``
(``LBHNC``, ``LBNHC``, ``LHBNC``, ``BLHNC``, ``BLNHC``, ``BHLNC``). Kernel block splitting
makes ``B`` a multiple of the scheduler's blocks: a scheduler block is then ``B / blocks``
kernel blocks side by side.

kvlink maps that as one registered region (the backing allocation) and one tensor per layer,
whose block is the scheduler block: in the four block-dense layouts a block of a layer is one
contiguous piece of ``H * N * C`` elements, head-major (``..HNC``) or token-major (``..NHC``).
In ``LHBNC`` and ``BHLNC`` a block is split into one piece per head; the connector asks vLLM
for ``LBHNC`` (``get_required_kvcache_layout``) and refuses those two at registration with
what to set instead (see docs/integration.md for why).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# The legacy names vLLM still accepts for VLLM_KV_CACHE_LAYOUT.
_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
# Block-dense layouts: whether a block is head-major (``HNC``) or token-major (``NHC``).
_DENSE = {"LBHNC": True, "BLHNC": True, "LBNHC": False, "BLNHC": False}
# Layouts whose blocks are one piece per head, strided apart.
_SPLIT = ("LHBNC", "BHLNC")

# The layout the connector asks vLLM for when the user does not choose: head-major blocks, so
# that a decode of another TP size reads one piece per block and layer for its heads.
PREFERRED_LAYOUT = "LBHNC"

# One tensor of the layout, as ``Engine.set_layout`` takes it: (storage index, offset, block
# stride, block bytes, blocks, KV cache group, heads (total, local, token runs) or None, token
# runs of a per-head piece or None).
Tensor = tuple[int, int, int, int, int, int, tuple[int, int, int] | None, int | None]

# One piece of a Mamba-kind layer's page: its byte offset in the page, its bytes, and its
# heads (total over the TP group, this rank's) or None when every rank holds it whole.
StatePart = tuple[int, int, tuple[int, int] | None]

# Where vLLM's Mamba-2 configs keep their number of B/C groups.
_GROUP_FIELDS = ("n_groups", "mamba_n_groups", "mamba_ngroups")


def layout_name(name: Any) -> str:
    """The ``KVCacheLayout`` name of ``name`` (an enum member, a name, or a legacy alias)."""
    text = str(getattr(name, "name", name)).upper()
    return _ALIASES.get(text, text)


def is_head_major(name: Any) -> bool:
    """Whether a block of layout ``name`` is head-major; refuses the layouts kvlink cannot
    read as one piece per block, saying what to set instead."""
    n = layout_name(name)
    if n in _DENSE:
        return _DENSE[n]
    if n in _SPLIT:
        raise ValueError(
            f"KvlinkConnector: the KV cache layout {n} stores each block as one piece per KV "
            "head, which kvlink does not transfer; the connector asks vLLM for "
            f"{PREFERRED_LAYOUT}, so unset VLLM_KV_CACHE_LAYOUT (or set it to LBHNC, LBNHC, "
            "BLHNC or BLNHC)"
        )
    raise ValueError(f"KvlinkConnector: unknown KV cache layout {name!r}")


def layout_tag(dtype: torch.dtype, head_major: bool, mla: bool, conv: str | None = None) -> str:
    """What both sides must agree on beyond block sizes: the element type, how a block
    orders heads and tokens (the layer's place outside the block does not matter; MLA's
    latent has one head, so its order does not either), and with Mamba-kind state the conv
    state's layout (``SD`` or ``DS``: the same bytes in another order)."""
    arrangement = "latent" if mla else ("HNC" if head_major else "NHC")
    return f"{_dtype_name(dtype)}/{arrangement}" + (f"/conv-{conv}" if conv else "")


def kv_cache_tensors(
    kv_caches: dict[str, Any],
    layers: Sequence[tuple[str, int]],
    num_blocks: int,
    head_major: bool,
    kv_heads: tuple[int, int] | None = None,
    state: dict[int, list[StatePart] | None] | None = None,
    compressed: frozenset[str] = frozenset(),
    latent: frozenset[str] = frozenset(),
) -> tuple[list[tuple[int, int, torch.Tensor]], list[Tensor]]:
    """Maps vLLM's per-layer ``[B, H, N, C]`` views to kvlink memory and layout.

    ``layers`` are ``(layer name, KV cache group)`` in the order both sides agree on (group by
    group, each group's layers in vLLM's order). Returns the memory to register, ``(address,
    bytes, owner)`` per distinct storage (one for vLLM's shared backing allocation), and the
    layout, ``(storage index, offset, block stride, block bytes, blocks, group, heads,
    token runs)`` per layer. ``kv_heads`` is ``(total, this rank's)``; with it each tensor
    declares ``(total, local, runs)``: a scheduler block is ``runs`` repetitions of the rank's
    heads (the kernel blocks it is made of, times the tokens of each when blocks are
    token-major). ``None`` (MLA) declares none. Token runs (how many stretches of all the
    block's tokens a block holds, which reads between engines of different block sizes need):
    1 for token-major blocks and MLA's latent, the heads for head-major ones; ``None`` for
    head-major blocks split into kernel blocks, whose tokens are not in one stretch per head.

    A layer of a group in ``state`` (Mamba-kind state) is vLLM's ``[B, 1, 1, C]`` int8 view of
    its pages, each block the layer's states (conv, SSM, ...) packed in ``C`` bytes (the page
    may be longer: padded to the attention pages' size), with no token runs (a state is not
    read by token ranges). With the group's parts (``state_parts``) it is one tensor per part,
    each with its heads where TP shards it, so that a decode of another TP size reads its
    slice of each; without (``None``) it is one tensor of ``C`` bytes, each rank's state
    whole (a decode of another TP size, whose shards differ in size, is refused by the
    layouts' comparison).

    A layer in ``compressed`` (``compressed_layers``) declares no token runs: its block holds
    one state per several tokens, read whole, so engines of different block sizes are refused
    by the layouts' comparison rather than cut such a block by tokens. A layer in ``latent``
    (``latent_layers``: one vector per token that every rank holds whole, as an indexer's keys
    beside a model's attention heads) declares no heads, as MLA's.
    """
    storages: dict[int, int] = {}
    memory: list[tuple[int, int, torch.Tensor]] = []
    layout: list[Tensor] = []
    for name, group in layers:
        v = kv_caches[name]
        blocks, inner, ratio = _block_view(name, v, num_blocks)
        storage = v.untyped_storage()
        base = storage.data_ptr()
        if base not in storages:
            storages[base] = len(memory)
            memory.append((base, storage.nbytes(), v))
        esize = v.element_size()
        offset, stride = v.data_ptr() - base, blocks.stride(0) * esize
        if state is not None and group in state:
            parts = state[group] or [(0, inner.numel() * esize, None)]
            for at, size, shard in parts:
                split = None if shard is None else (shard[0], shard[1], 1)
                layout.append((storages[base], offset + at, stride, size, num_blocks, group, split, None))
            continue
        heads, token_runs = _split(name, v, ratio, head_major, None if name in latent else kv_heads)
        if name in compressed:
            token_runs = None
        layout.append((storages[base], offset, stride, inner.numel() * esize, num_blocks, group, heads, token_runs))
    return memory, layout


def _split(
    name: str, v: Any, ratio: int, head_major: bool, kv_heads: tuple[int, int] | None
) -> tuple[tuple[int, int, int] | None, int | None]:
    """An attention layer's heads ``(total, local, runs)`` (None for MLA) and token runs, as
    ``kv_cache_tensors`` declares them."""
    heads = None
    if kv_heads is not None:
        total, local = kv_heads
        if v.shape[1] != local:
            raise ValueError(
                f"KvlinkConnector: KV cache {name!r} holds {v.shape[1]} KV heads; this rank "
                f"should hold {local} of {total}"
            )
        heads = (total, local, ratio * (1 if head_major else v.shape[2]))
    per_head = head_major and kv_heads is not None
    return heads, None if per_head and ratio > 1 else (v.shape[1] if per_head else 1)


def _block_view(name: str, v: Any, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A layer's cache as ``[blocks, kernel blocks, H, N, C]``, its first block, and the kernel
    blocks per block; refuses what is not vLLM's 4-D view or whose blocks are not dense."""
    if isinstance(v, (list, tuple)) or v.dim() != 4:
        shape = [tuple(t.shape) for t in v] if isinstance(v, (list, tuple)) else tuple(v.shape)
        raise ValueError(
            f"KvlinkConnector: KV cache {name!r} has shape {shape}; expected vLLM's 4-D "
            "[blocks, heads, tokens, K|V] view (vLLM 0.32 or later)"
        )
    if v.shape[0] % num_blocks:
        raise ValueError(
            f"KvlinkConnector: KV cache {name!r} has {v.shape[0]} kernel blocks, not a "
            f"multiple of the {num_blocks} blocks of the KV cache config"
        )
    ratio = v.shape[0] // num_blocks
    blocks = v.unflatten(0, (num_blocks, ratio))  # [blocks, kernel blocks, H, N, C]
    inner = blocks[0]
    span = 1 + sum((s - 1) * st for s, st in zip(inner.shape, inner.stride()) if s > 0)
    if span != inner.numel():
        raise ValueError(
            f"KvlinkConnector: a block of KV cache {name!r} is not dense in memory "
            f"(shape {tuple(inner.shape)}, strides {inner.stride()})"
        )
    return blocks, inner, ratio


def connector_layers(kv_caches: dict[str, Any], kv_cache_config: Any) -> tuple[list[tuple[str, int]], list[str]]:
    """The layers to transfer, ``(name, group)`` group by group in vLLM's order, and the
    layers skipped because they reuse another layer's cache (cross-layer KV sharing: vLLM
    adds them to ``kv_caches`` as aliases after building the KV cache config). A layer that is
    in no group and aliases nothing is refused."""
    if kv_cache_config is None:
        return [(name, 0) for name in kv_caches], []
    layers = [(n, g) for g, spec in enumerate(kv_cache_config.kv_cache_groups) for n in spec.layer_names]
    missing = [n for n, _ in layers if n not in kv_caches]
    if missing:
        raise ValueError(f"KvlinkConnector: no KV cache for layers {missing} of the KV cache config")
    owned = {_address(kv_caches[n]) for n, _ in layers}
    known = {n for n, _ in layers}
    shared: list[str] = []
    unknown: list[str] = []
    for name, value in kv_caches.items():
        if name not in known:
            (shared if _address(value) in owned else unknown).append(name)
    if unknown:
        raise ValueError(
            f"KvlinkConnector: KV caches {sorted(unknown)} are in no KV cache group and share no other layer's cache"
        )
    return layers, shared


def _packed(spec: Any) -> dict[str, Any] | None:
    """Layer name -> spec of a group vLLM packs of one kind's layers with pages of different
    sizes (``UniformTypeKVCacheSpecs``), None for a spec that describes its whole group."""
    inner = getattr(spec, "kv_cache_specs", None)
    return inner if isinstance(inner, dict) and inner else None


def layer_specs(spec: Any) -> list[Any]:
    """The per-layer specs of a KV cache group's spec: those of a packed group (``_packed``),
    else the spec itself."""
    inner = _packed(spec)
    return list(inner.values()) if inner else [spec]


def tokens_per_state(spec: Any) -> int:
    """The tokens one stored state of an attention spec covers (above 1: compressed attention,
    DeepSeek-V4's compressed MLA and indexer keys), 1 otherwise (state kinds too: Mamba's
    counts -1); refuses several states per token (a fraction), which no read here pairs."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    if not isinstance(spec, AttentionSpec):
        return 1
    n = spec.tokens_per_state
    if n != int(n) or n < 1:
        raise ValueError(
            f"KvlinkConnector: a layer of kind {type(spec).__name__} stores {n} states per token, "
            "which kvlink does not transfer"
        )
    return int(n)


def compressed_layers(kv_cache_config: Any) -> frozenset[str]:
    """The layers whose stored state covers several tokens (compressed attention): their
    blocks hold ``block_size / N`` states, so no token range of a block is a byte range of it."""
    if kv_cache_config is None:
        return frozenset()
    out: set[str] = set()
    for group in kv_cache_config.kv_cache_groups:
        per_layer = _packed(group.kv_cache_spec) or dict.fromkeys(group.layer_names, group.kv_cache_spec)
        out.update(name for name, spec in per_layer.items() if tokens_per_state(spec) > 1)
    return frozenset(out)


def latent_layers(kv_cache_config: Any) -> frozenset[str]:
    """The layers of MLA's kind (``MLAAttentionSpec``: one vector per token, whole on every TP
    rank), which a model of attention heads may hold too (MiniMax-M3's indexer keys)."""
    if kv_cache_config is None:
        return frozenset()
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    out: set[str] = set()
    for group in kv_cache_config.kv_cache_groups:
        per_layer = _packed(group.kv_cache_spec) or dict.fromkeys(group.layer_names, group.kv_cache_spec)
        out.update(name for name, spec in per_layer.items() if isinstance(spec, MLAAttentionSpec))
    return frozenset(out)


def state_groups(kv_cache_config: Any) -> frozenset[int]:
    """The KV cache groups that hold Mamba-kind state (``MambaSpec``)."""
    if kv_cache_config is None:
        return frozenset()
    from vllm.v1.kv_cache_interface import MambaSpec

    return frozenset(
        g
        for g, group in enumerate(kv_cache_config.kv_cache_groups)
        if isinstance(layer_specs(group.kv_cache_spec)[0], MambaSpec)
    )


def ring_groups(kv_cache_config: Any) -> frozenset[int]:
    """The KV cache groups of compressor rings (``CircularBufferSpec``: one block per request
    holding the rows of the group still being compressed, which every TP rank holds whole)."""
    if kv_cache_config is None:
        return frozenset()
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    return frozenset(
        g
        for g, group in enumerate(kv_cache_config.kv_cache_groups)
        if isinstance(layer_specs(group.kv_cache_spec)[0], CircularBufferSpec)
    )


def state_layout(
    kv_cache_config: Any, tp_size: int, hf_config: Any
) -> tuple[dict[int, list[StatePart] | None], str | None]:
    """Per state group, its layers' parts (``state_parts``; None: whole, as a compressor ring
    always is), and why the Mamba-kind state cannot be read between TP sizes (None when it
    can, or when there is no sharded state)."""
    out: dict[int, list[StatePart] | None] = dict.fromkeys(ring_groups(kv_cache_config))
    why = None
    for g in sorted(state_groups(kv_cache_config)):
        parts, reason = state_parts(
            layer_specs(kv_cache_config.kv_cache_groups[g].kv_cache_spec)[0], tp_size, hf_config
        )
        out[g] = parts
        why = why or reason
    return out, why


def conv_layout() -> str:
    """vLLM's layout of the conv state: ``SD`` (positions outer) or ``DS`` (channels outer)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return "DS" if is_conv_state_dim_first() else "SD"


def state_parts(spec: Any, tp_size: int, hf_config: Any) -> tuple[list[StatePart] | None, str | None]:
    """How the page of a Mamba-kind layer (``spec``, vLLM's ``MambaSpec`` on a rank of TP
    ``tp_size``) splits into the pieces TP shards, and why it cannot when it cannot.

    With the conv state in vLLM's ``DS`` layout (``VLLM_SSM_CONV_STATE_LAYOUT=DS``) each of its
    sub-projections is a contiguous run of channels per rank, which vLLM's own
    ``derive_mamba_conv_split`` sizes: Mamba-1's x; Mamba-2's x, B and C; a gated delta net's
    Q, K and V. Each part's heads are the units TP splits it by: a channel (Mamba-1), a head
    of ``head_dim`` channels (Mamba-2's x), a group of ``state_size`` channels (its B and C,
    one group on every rank when the model has one group and vLLM replicates it), a key or
    value head (gated delta net). The temporal (SSM) state follows, split by its first
    dimension (channels or heads). State every rank holds whole (``tp_replicated``) is one
    part without heads. Anything else (``SD`` conv, another kind of state, extra states) is
    one whole piece (None) and the reason a decode of another TP size computes it itself."""
    if getattr(spec, "tp_replicated", False):
        return [(0, spec.state_content_size_bytes, None)], None
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as Kind

    kind = spec.mamba_type
    if kind not in (Kind.MAMBA1, Kind.MAMBA2, Kind.GDN_ATTN) or len(spec.shapes) != 2:
        return None, (
            "kvlink splits the state of Mamba-1, Mamba-2 and gated delta net layers (a conv and "
            f"a temporal state) between TP sizes; this model's is {kind.name} with {len(spec.shapes)} states"
        )
    if conv_layout() != "DS":
        return None, (
            "the conv state is in vLLM's SD layout, where a rank's channels are not contiguous; "
            "set VLLM_SSM_CONV_STATE_LAYOUT=DS on the prefill and the decode"
        )
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split

    split = derive_mamba_conv_split(spec, tp_size)
    temporal = spec.shapes[1]
    # Channels per unit TP shards each conv sub-projection by (Mamba-1's temporal state is
    # [channels, state]: no heads).
    if kind is Kind.MAMBA1:
        units: tuple[int, ...] = (1,)
    elif kind is Kind.MAMBA2:
        units = (temporal[1],) + (temporal[2],) * 2
    else:
        units = (temporal[2],) * 2 + (temporal[1],)
    parts: list[StatePart] = []
    for i, ((at, size), dims, unit) in enumerate(zip(split.local_conv_offsets, split.local_proj_dims, units)):
        local = dims // unit
        total = local * tp_size
        if kind is Kind.MAMBA2 and i > 0:
            groups = next((int(getattr(hf_config, f)) for f in _GROUP_FIELDS if getattr(hf_config, f, None)), None)
            if groups is None or not (groups % tp_size == 0 or groups == 1) or local != max(1, groups // tp_size):
                return None, (
                    f"the Mamba-2 B and C groups ({groups} in the model config, {local} on a rank of TP "
                    f"{tp_size}) are not split evenly or replicated whole"
                )
            total = groups
        parts.append((at, size, (total, local)))
    conv_bytes, ssm_bytes = split.ssm_sizes
    parts.append((conv_bytes, ssm_bytes, (temporal[0] * tp_size, temporal[0])))
    return parts, None


def _address(value: Any) -> tuple[int, tuple[int, ...]]:
    t = value[0] if isinstance(value, (list, tuple)) else value
    return t.data_ptr(), tuple(t.stride())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kv_heads(vllm_config: VllmConfig, tp_size: int) -> tuple[int, int] | None:
    """``(total KV heads, this rank's)`` for per-head KV caches, None for MLA (every rank
    holds the latent whole) or when the model does not say."""
    model = getattr(vllm_config, "model_config", None)
    if model is None or getattr(model, "use_mla", False):
        return None
    try:
        total = int(model.get_total_num_kv_heads())
        local = int(model.get_num_kv_heads(vllm_config.parallel_config))
    except Exception:  # noqa: BLE001 - a model config without head counts: no head split
        return None
    if total <= 0 or local != (total // tp_size if tp_size <= total else 1):
        return None
    return total, local
