"""vLLM's KV caches as kvlink memory and layout: each layer's tensors, their KV cache groups
(block groups) and, for per-head caches, the heads tensor parallelism splits."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def kv_cache_tensors(
    kv_caches: Dict[str, Any],
    num_blocks: int,
    groups: Optional[Dict[str, int]] = None,
    kv_heads: Optional[Tuple[int, int]] = None,
) -> Tuple[List[Tuple[int, int, torch.Tensor]], List[Tuple[int, int, int, int, int, int, Any]]]:
    """Maps vLLM's KV caches to kvlink memory and layout.

    Returns the memory to register, ``(address, bytes, owner)`` per distinct storage, and the
    layout, ``(storage index, offset, block stride, block bytes, blocks, group, heads)`` per
    tensor in layer order (K before V where a layer has both). A tensor's block index is its
    first dimension of size ``num_blocks`` among the first two (``[2, num_blocks, ...]`` is
    split into K and V); the rest of a block must be dense in memory (any order of its
    dimensions: HND and NHD both qualify). A layer with several state tensors (a list, as SSM
    layers have) gives one tensor each.

    ``groups`` maps a layer to its KV cache group (default 0). ``kv_heads`` is ``(total, this
    rank's)``: tensors whose blocks hold that many heads in their second-to-last dimension
    declare them, as ``(total, local, runs)`` (``runs``: how many times the heads repeat in a
    block, 1 when they are its outermost dimension), so that a decode of another TP size reads
    its own heads; ``None`` (MLA, or no TP split) declares none.
    """
    storages: Dict[int, int] = {}
    memory: List[Tuple[int, int, torch.Tensor]] = []
    layout: List[Tuple[int, int, int, int, int, int, Any]] = []
    for name, value in kv_caches.items():
        group = (groups or {}).get(name, 0)
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks and t.shape[0] != num_blocks:
                views = [t[0], t[1]]
            elif t.dim() >= 1 and t.shape[0] == num_blocks:
                views = [t]
            else:
                raise ValueError(
                    f"kvlink: KV cache {name!r} has shape {tuple(t.shape)}; expected the block "
                    f"index ({num_blocks} blocks) first, or second after a K/V dimension of 2"
                )
            storage = t.untyped_storage()
            base = storage.data_ptr()
            if base not in storages:
                storages[base] = len(memory)
                memory.append((base, storage.nbytes(), t))
            index = storages[base]
            esize = t.element_size()
            for v in views:
                inner = v[0]
                span = 1 + sum((s - 1) * st for s, st in zip(inner.shape, inner.stride()) if s > 0)
                if span != inner.numel():
                    raise ValueError(
                        f"kvlink: a block of KV cache {name!r} is not dense in memory "
                        f"(shape {tuple(inner.shape)}, strides {inner.stride()})"
                    )
                layout.append(
                    (
                        index,
                        v.data_ptr() - base,
                        v.stride(0) * esize,
                        inner.numel() * esize,
                        v.shape[0],
                        group,
                        _head_split(inner, kv_heads),
                    )
                )
    return memory, layout


def _head_split(block: torch.Tensor, kv_heads: Optional[Tuple[int, int]]) -> Optional[Tuple[int, int, int]]:
    """``(total, local, runs)`` for a dense block whose second-to-last dimension holds this
    rank's heads, or None: ``runs`` is the product of the sizes of the dimensions laid out
    outside the heads (token-major blocks repeat their heads once per token)."""
    if kv_heads is None or block.dim() < 2:
        return None
    total, local = kv_heads
    h = block.dim() - 2
    if block.shape[h] != local:
        return None
    # Dimensions laid out inside the heads, and outside them. A stride equal to the heads'
    # (a dimension of size 1 on either side) counts as laid out as in a contiguous block:
    # outside when it comes first.
    sh = block.stride(h)
    dims = [(i, n, st) for i, (n, st) in enumerate(zip(block.shape, block.stride())) if i != h]
    inner = [n for i, n, st in dims if st < sh or (st == sh and i > h)]
    outer = [n for i, n, st in dims if st > sh or (st == sh and i < h)]
    if math.prod(inner) != sh:
        return None  # the heads are not laid out as runs of whole heads
    return (total, local, math.prod(outer))


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")



def _kv_heads(vllm_config: "VllmConfig", tp_size: int) -> Optional[Tuple[int, int]]:
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

