"""ATOM's KV memory as kvlink regions: the ``KVTransferTensors`` its attention backend hands the
connector, read the way ATOM's Mooncake connector reads them, one kvlink tensor per region.

A region's scheduler block is ``total_bytes // num_blocks`` bytes (``num_blocks`` the scheduler's
count): MHA regions count physical 16-token blocks (``unit_bytes`` is one of them, a scheduler
block spans ``block_ratio`` of them), MLA regions already count scheduler blocks."""

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
    if tensors.slot_regions or tensors.swa_block_regions or tensors.staging_region is not None:
        raise ValueError(
            "kvlink: this model keeps per-request slot state (slot or SWA regions, PD staging: "
            "DeepSeek-V4); kvlink moves paged KV blocks only"
        )
    if num_blocks <= 0:
        raise ValueError(f"kvlink: ATOM registered {num_blocks} KV blocks")
    mla = is_mla(config.hf_config)
    heads = None if mla else kv_heads(config.hf_config, tp_size)
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
    return out


def dtype_name(config: Any) -> str:
    """The KV dtype both sides must agree on (ATOM's ``kv_cache_dtype``)."""
    return str(getattr(config, "kv_cache_dtype", "bf16"))
