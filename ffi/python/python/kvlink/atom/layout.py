"""ATOM's KV memory as kvlink regions: the ``KVTransferTensors`` its attention backend hands the
connector, read the way ATOM's Mooncake connector reads them, one kvlink tensor per region.

A region's scheduler block is ``total_bytes // num_blocks`` bytes (``num_blocks`` the scheduler's
count): MHA regions count physical 16-token blocks (``unit_bytes`` is one of them, a scheduler
block spans ``block_ratio`` of them), MLA regions already count scheduler blocks.

DeepSeek-V4 keeps each request's state (its compressors' state and its sliding window) in a
SLOT: one unit per request of each full SLOT region (``swa_block_regions``), numbered from the
region's end (``reverse_indexed``), the request's unit its ``per_req_cache_group``. Those
regions are block group 1, one block a slot; the PAGE regions are group 0.

The gated delta net hybrids (Qwen3-Next, Qwen3.5, Kimi's KDA) keep each linear-attention layer's conv and
temporal state in ATOM's per-request pool, which their backend exports to connectors only as
the layers' own ``KVCacheTensor`` views (``k_cache``: conv state, ``v_cache``: temporal state,
first axis the slots): those views are block group 1 too, one block a slot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MLA_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_mtp", "glm_moe_dsa", "kimi_k2", "kimi_linear")


@dataclass(frozen=True)
class Region:
    """One registerable region and how its blocks split over TP ranks."""

    base_addr: int
    total_bytes: int
    block_bytes: int
    num_blocks: int
    #: ``(total, local, runs)`` KV heads when TP splits them; ``None`` when whole on every rank.
    heads: tuple[int, int, int] | None
    #: The block group: 0 for PAGE regions (scheduler blocks), 1 for SLOT regions (requests).
    group: int = 0
    #: Whether the region numbers its units from its end (a SLOT region).
    reverse: bool = False


def slot_block(region: Region, slot: int) -> int:
    """The block of a SLOT region that holds the state of slot ``slot`` (ATOM's
    ``per_req_cache_group``); raises ``ValueError`` outside the region."""
    if not 0 <= slot < region.num_blocks:
        raise ValueError(f"slot {slot} is outside the {region.num_blocks} slots of the state region")
    return region.num_blocks - 1 - slot if region.reverse else slot


def is_mla(hf_config: Any) -> bool:
    """ATOM's own test (``ModelRunner.is_deepseek_mla``): a DeepSeek-style model with a latent."""
    text = getattr(hf_config, "text_config", None) or hf_config
    mtype = getattr(text, "model_type", None)
    if mtype == "eagle":
        inner = getattr(text, "model", None)
        return (
            getattr(inner, "model_type", None) in ("deepseek_v2", "deepseek_v3")
            and getattr(text, "kv_lora_rank", None) is not None
        )
    return mtype in _MLA_TYPES and getattr(text, "kv_lora_rank", None) is not None


def kv_heads(hf_config: Any, tp_size: int) -> tuple[int, int] | None:
    """``(total, local)`` KV heads when TP splits them evenly; ``None`` when each rank keeps a
    replica (fewer heads than ranks), which kvlink can only pair between equal TP sizes."""
    text = getattr(hf_config, "text_config", None) or hf_config
    total = int(getattr(text, "num_key_value_heads", 0) or getattr(text, "num_attention_heads", 0))
    if total < tp_size or total % tp_size:
        return None
    return total, total // tp_size


def describe(config: Any, tensors: Any, num_blocks: int, tp_size: int) -> list[Region]:
    """The regions of ``tensors`` (ATOM's ``KVTransferTensors``) with ``num_blocks`` scheduler
    blocks. Raises ``ValueError`` for what kvlink cannot move, saying what and why."""
    if tensors is None or not tensors.block_regions:
        raise ValueError("kvlink: ATOM's attention backend exported no KV transfer regions")
    if tensors.slot_regions or tensors.staging_region is not None:
        raise ValueError(
            "kvlink: this model's backend exports per-request state as partial slot regions or "
            "through a PD staging pool; kvlink moves full SLOT regions (swa_block_regions) only"
        )
    if num_blocks <= 0:
        raise ValueError(f"kvlink: ATOM registered {num_blocks} KV blocks")
    slots = _slot_regions(tensors)
    # A model with SLOT state (DeepSeek-V4) keeps one latent per token, whole on every rank.
    mla = is_mla(config.hf_config) or bool(slots)
    # A gated delta net hybrid's KV blocks are token-major ([tokens, heads, dim]) and its state
    # is not cut by head here: declared whole, it pairs equal TP sizes only (a decode of
    # another size has blocks of other sizes, which the layout comparison refuses).
    hybrid = linear_layers(config.hf_config) is not None
    heads = None if mla or hybrid else kv_heads(config.hf_config, tp_size)
    text = getattr(config.hf_config, "text_config", None) or config.hf_config
    # K and V per layer, then their scales: head-major physical blocks, ``runs`` of them per
    # scheduler block. Other regions (MLA latents, indexer caches) are whole on every rank.
    head_major = 4 * int(getattr(text, "num_hidden_layers", 0))
    out = []
    for i, r in enumerate(tensors.block_regions):
        if r.reverse_indexed:
            raise ValueError(f"kvlink: region {i} numbers its units from its end; kvlink reads paged regions only")
        if r.total_bytes % num_blocks or r.unit_bytes <= 0:
            raise ValueError(
                f"kvlink: region {i} ({r.total_bytes} bytes, {r.unit_bytes}-byte units) does not split into "
                f"{num_blocks} scheduler blocks"
            )
        block = r.total_bytes // num_blocks
        runs = block // r.unit_bytes if block % r.unit_bytes == 0 else 0
        split = None
        if heads is not None and i < head_major and runs > 0 and block % (heads[1] * runs) == 0:
            split = (heads[0], heads[1], runs)
        out.append(Region(r.base_addr, r.total_bytes, block, num_blocks, split))
    return out + slots


def _slot_regions(tensors: Any) -> list[Region]:
    """The full SLOT regions of ``tensors`` as block group 1 (one block a request's slot)."""
    regions = list(getattr(tensors, "swa_block_regions", None) or [])
    expected = getattr(tensors, "expected_full_slot_region_count", None)
    if expected is not None and expected != len(regions):
        raise ValueError(f"kvlink: ATOM's backend expects {expected} full SLOT regions and exported {len(regions)}")
    n = int(getattr(tensors, "num_slots", 0) or 0)
    if regions and n <= 0:
        raise ValueError("kvlink: ATOM's backend exported SLOT regions for no slots")
    out = []
    for i, r in enumerate(regions):
        if r.unit_bytes <= 0 or r.total_bytes != n * r.unit_bytes:
            raise ValueError(
                f"kvlink: SLOT region {i} ({r.total_bytes} bytes, {r.unit_bytes}-byte units) does not hold {n} slots"
            )
        out.append(Region(r.base_addr, r.total_bytes, r.unit_bytes, n, None, 1, bool(r.reverse_indexed)))
    return out


def linear_layers(hf_config: Any) -> list[int] | None:
    """The linear-attention layers of a gated delta net hybrid, by ATOM's own rule
    (``GDNStateMixin._init_gdn_state``: Kimi's KDA layers as its ``linear_attn_config`` lists
    them, from 1; otherwise every ``full_attention_interval``-th layer is full attention);
    None for a model without them."""
    text = getattr(hf_config, "text_config", None) or hf_config
    if getattr(text, "model_type", None) == "kimi_linear":
        linear = getattr(text, "linear_attn_config", None) or {}
        return sorted(int(i) - 1 for i in linear.get("kda_layers", []))
    interval = getattr(text, "full_attention_interval", None)
    if not isinstance(interval, int) or interval <= 1:
        return None
    n = int(getattr(text, "num_hidden_layers", 0))
    return [i for i in range(n) if i % interval != interval - 1]


def state_regions(config: Any, kv_caches: dict[str, Any]) -> list[Region]:
    """A gated delta net hybrid's per-request state as block group 1: each linear-attention
    layer's conv and temporal state views (first axis ATOM's state slots). Raises
    ``ValueError`` when ATOM's views are not what kvlink reads."""
    layers = linear_layers(config.hf_config)
    if layers is None:
        return []
    if getattr(config, "speculative_config", None) is not None:
        raise ValueError("kvlink: a gated delta net hybrid with speculative slots per request is not supported")
    by_layer = {int(getattr(t, "layer_num", -1)): t for t in kv_caches.values()}
    out = []
    for layer in layers:
        t = by_layer.get(layer)
        if t is None:
            raise ValueError(f"kvlink: ATOM handed no state for linear-attention layer {layer}")
        for part in (t.k_cache, t.v_cache):
            if part.dim() < 2 or not part.is_contiguous() or part.shape[0] <= 0:
                raise ValueError(f"kvlink: the state of layer {layer} is not a contiguous [slots, ...] tensor")
            n = int(part.shape[0])
            out.append(
                Region(
                    part.data_ptr(),
                    part.numel() * part.element_size(),
                    part[0].numel() * part.element_size(),
                    n,
                    None,
                    1,
                )
            )
    return out


def dtype_name(config: Any) -> str:
    """The KV dtype both sides must agree on (ATOM's ``kv_cache_dtype``)."""
    return str(getattr(config, "kv_cache_dtype", "bf16"))
