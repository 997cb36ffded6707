"""The decode side's reading of the transfer parameters a client relays from a prefill
(``kv_transfer_params``): validated, as they come from outside."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import core


@dataclass
class _Remote:
    addresses: list[str]
    request_id: str
    blocks: list[list[int]]
    """Per KV cache group, the prefill's block at each position (0: none sent)."""
    num_tokens: int
    block_sizes: list[int]
    """Per KV cache group, the prefill's tokens per block."""
    hold: int | None = None
    """The token of the prefill's hold (None from a prefill of an earlier kvlink)."""
    follow: bool = False
    """A progressive transfer: the prefill's hold grows while it runs; no block is known."""


def _block_list(blocks: Any) -> bool:
    return core.block_ids(blocks) is not None


def _remote(params: dict[str, Any], block_sizes: list[int]):
    """The prefill side of ``kv_transfer_params``, validated (they come from a client through
    the proxy), or why they are unusable."""
    follow = params.get("progressive") is True and "remote_block_ids" not in params
    try:
        addresses = params["remote_addresses"]
        rid = params["remote_request_id"]
        blocks = params["remote_block_sizes" if follow else "remote_block_ids"]
    except KeyError as e:
        return f"kv_transfer_params lack {e.args[0]!r}"
    if follow:
        # A progressive transfer's blocks are told as they are held: none per group for now.
        if not _block_list(blocks) or not 0 < len(blocks) <= 64:
            return "remote_block_sizes must be a positive integer per KV cache group (at most 64)"
        blocks = [[] for _ in blocks]
    if not isinstance(addresses, (list, tuple)) or not addresses or not all(isinstance(a, str) for a in addresses):
        return "remote_addresses must be a non-empty list of 'host:port' strings"
    if not isinstance(rid, str) or not rid:
        return "remote_request_id must be a non-empty string"
    if _block_list(blocks):
        groups = [list(blocks)]
    elif isinstance(blocks, (list, tuple)) and blocks and len(blocks) <= 64 and all(_block_list(g) for g in blocks):
        groups = [list(g) for g in blocks]
    else:
        return (
            "remote_block_ids must be a list of block ids (integers 0 to 2^32-1), or one such list per KV cache group"
        )
    sizes = params.get("remote_block_sizes")
    if sizes is None:  # a prefill of an earlier kvlink: this engine's sizes
        sizes = block_sizes if len(block_sizes) == len(groups) else [block_sizes[0]] * len(groups)
    if not _block_list(sizes) or not sizes or 0 in sizes:
        return "remote_block_sizes must be a positive integer per KV cache group"
    tokens = params.get("remote_num_tokens")
    if tokens is None:
        tokens = min(len(g) * b for g, b in zip(groups, sizes))
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        return "remote_num_tokens must be a non-negative integer"
    hold = params.get("remote_hold")
    if hold is not None and core.hold_token(hold) is None:
        return "remote_hold must be an integer from 1 to 2^64-1"
    return _Remote(list(addresses), rid, groups, tokens, list(sizes), hold, follow)
