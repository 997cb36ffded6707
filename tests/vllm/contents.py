"""What the vLLM tests' stand-in forward writes into vLLM's KV caches, and where: each token's
bytes per KV head (``token_bytes``), a Mamba-kind layer's running state whole (``state_bytes``)
or channel by channel (``channel_bytes``), and where vLLM's TP split puts each piece of a state
page (``state_pieces``). Functions of what was computed only, so that a decode checks every byte
it received without knowing the prefill's block ids or TP size."""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

def token_bytes(token: int, pos: int, layer: int, heads: np.ndarray, size: int) -> np.ndarray:
    """What the stand-in forward writes for one token: ``size`` bytes per KV head in
    ``heads`` (global head numbers), one row per head."""
    base = (token * 7 + pos * 13 + layer * 29 + heads.astype(np.int64) * 97) % 251
    return ((np.arange(size, dtype=np.int64)[None, :] * 131 + base[:, None]) % 251 + 1).astype(np.uint8)


def state_bytes(tokens: List[int], layer: int, rank: int, size: int) -> np.ndarray:
    """The stand-in running state of a Mamba-kind layer after ``tokens``: ``size`` bytes that
    differ with every token, the layer and the rank (a state read from the wrong request,
    position, layer or rank does not match)."""
    import hashlib

    seed = hashlib.sha256(np.asarray(list(tokens) + [layer, rank], dtype=np.int64).tobytes()).digest()
    return np.resize(np.frombuffer(seed, dtype=np.uint8), size)


def channel_bytes(tokens: List[int], layer: int, part: int, channels: np.ndarray, size: int) -> np.ndarray:
    """The stand-in running state of one part of a Mamba-kind layer (its conv
    sub-projections, then its temporal state) after ``tokens``: ``size`` bytes per channel in
    ``channels`` (global numbers over the TP group), one row each. A state read from the wrong
    request, length, layer, part or TP slice does not match."""
    import hashlib

    digest = hashlib.sha256(np.asarray(list(tokens) + [layer], dtype=np.int64).tobytes()).digest()
    seed = int.from_bytes(digest[:4], "little")
    base = (seed + part * 37 + channels.astype(np.int64) * 97) % 251
    return ((np.arange(size, dtype=np.int64)[None, :] * 131 + base[:, None]) % 251 + 1).astype(np.uint8)


def state_pieces(spec, tp: int, rank: int, hf) -> Optional[List[tuple]]:
    """Where a Mamba-kind layer's page holds each TP-sharded piece on ``rank``, from vLLM's own
    facts (its ``derive_mamba_conv_split`` of the conv state in the DS layout, its group
    replication ``extra_groups_for_head_shards``, the temporal state's first dimension):
    ``(byte offset, bytes per channel, global numbers of the channels)`` per part; None
    when vLLM does not split this state (SD conv layout, other kinds, replicated state)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator, is_conv_state_dim_first
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as Kind

    if spec.tp_replicated or not is_conv_state_dim_first() or len(spec.shapes) != 2:
        return None
    if spec.mamba_type not in (Kind.MAMBA1, Kind.MAMBA2, Kind.GDN_ATTN):
        return None
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split

    split = derive_mamba_conv_split(spec, tp)
    row = split.conv_rows * split.conv_dtype_size
    out = []
    for i, ((at, _), dims) in enumerate(zip(split.local_conv_offsets, split.local_proj_dims)):
        groups = getattr(hf, "mamba_n_groups", None) or getattr(hf, "n_groups", None) or 0
        replicated = spec.mamba_type == Kind.MAMBA2 and i > 0 and MambaStateShapeCalculator.extra_groups_for_head_shards(groups, tp) > 0
        first = 0 if replicated else rank * dims
        out.append((at, row, np.arange(first, first + dims)))
    temporal = spec.shapes[1]
    per = int(np.prod(temporal[1:])) * torch.tensor([], dtype=spec.dtypes[1]).element_size()
    out.append((split.ssm_sizes[0], per, np.arange(rank * temporal[0], (rank + 1) * temporal[0])))
    return out
