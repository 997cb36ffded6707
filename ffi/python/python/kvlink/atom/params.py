"""The transfer parameters a kvlink prefill hands ATOM's router and a decode reads back: the
keys of ATOM's Mooncake connector (so ATOM's router and proxy pass them on unchanged) plus the
hold's token under ``kvlink_hold``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core import address, block_ids, hold_token
from .settings import Settings, port_offset


@dataclass(frozen=True)
class Read:
    """A decode rank's read of one request: the prefill TP group's addresses in rank order,
    block lists, the prefill's id and the hold's token."""

    addresses: list[str]
    local_blocks: list[int]
    remote_blocks: list[int]
    remote_id: str
    hold: int
    #: Leading prompt blocks this decode already held (its prefix cache), not read.
    cached: int = 0
    #: This decode's and the prefill's state slots, in a model with SLOT state.
    local_slot: int | None = None
    remote_slot: int | None = None


def state_slot(seq: Any) -> int | None:
    """The request's state slot (ATOM's ``per_req_cache_group``), or None when it has none."""
    slot = getattr(seq, "per_req_cache_group", -1)
    if not getattr(seq, "has_per_req_cache", False) or not isinstance(slot, int) or slot < 0:
        return None
    return slot


class Refused(ValueError):
    """Transfer parameters a decode will not read; ``addresses`` (when known) lets it tell the
    prefill at once instead of leaving the hold to expire."""

    def __init__(self, reason: str, addresses: list[str] | None = None, remote_id: str = "", hold: int = 0):
        super().__init__(reason)
        self.addresses = addresses or []
        self.remote_id = remote_id
        self.hold = hold


def prefill_output(
    seq: Any, s: Settings, host: str, blocks: list[int], token: int, slot: int | None = None
) -> dict[str, Any]:
    """What a prefill's ``request_finished`` publishes for its decode (``kvlink_slot``: the
    state slot it holds, in a model with SLOT state)."""
    drafts = getattr(seq, "spec_token_ids", None)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(blocks),
        "remote_engine_id": f"kvlink@{address(host, s.handshake_port)}",
        "remote_host": host,
        "remote_port": s.handshake_port,
        "remote_handshake_port": s.handshake_port,
        "tp_size": s.tp_size,
        "dp_rank": s.dp_rank,
        "remote_dp_size": s.dp_size,
        "remote_pp_size": 1,
        "transfer_id": seq.id,
        "first_token_id": seq.output_tokens[0] if seq.output_tokens else None,
        "draft_token_ids": [int(x) for x in drafts] if drafts is not None and len(drafts) else [],
        "prefix_cache_hit_tokens": getattr(seq, "prefix_cache_hit_tokens", 0),
        "kvlink_hold": token,
        "kvlink_slot": slot,
    }


def _int(params: dict[str, Any], key: str, default: int | None = None, low: int = 0) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise Refused(f"transfer parameter {key}={value!r} is not an integer >= {low}")
    return value


def read_for(seq: Any, params: dict[str, Any], s: Settings) -> Read:
    """The read a decode request's parameters ask for, into ``seq.block_table`` past the blocks
    this decode already holds (its prefix cache). Raises ``Refused`` with the reason."""
    host = params.get("remote_host")
    if not isinstance(host, str) or not host:
        raise Refused(f"transfer parameter remote_host={host!r} is not a host")
    port = _int(params, "remote_handshake_port", low=1)
    tp = _int(params, "remote_tp_size", params.get("tp_size", 1), low=1)
    dp_rank = _int(params, "remote_dp_rank", params.get("dp_rank", 0))
    dp_size = _int(params, "remote_dp_size", 1, low=1)
    if _int(params, "remote_pp_size", 1, low=1) != 1:
        raise Refused("the prefill runs pipeline parallelism, which kvlink does not read from")
    addresses = [address(host, port + port_offset(dp_rank, r, tp, dp_size)) for r in range(tp)]
    if any(not 0 < port + port_offset(dp_rank, r, tp, dp_size) < 65536 for r in range(tp)):
        raise Refused(f"the prefill's ports from {port} (DP rank {dp_rank}, TP {tp}) leave the port range")
    remote_id = str(_int(params, "transfer_id"))
    if "kvlink_hold" not in params:
        raise Refused(
            "the transfer parameters do not come from a kvlink prefill (no kvlink_hold)", addresses, remote_id
        )
    hold = hold_token(params["kvlink_hold"])
    if hold is None:
        raise Refused(f"transfer parameter kvlink_hold={params['kvlink_hold']!r} is not a hold's token (1 to 2^64-1)")
    remote = block_ids(params.get("remote_block_ids"))
    if remote is None:
        raise Refused(
            f"transfer parameter remote_block_ids={params.get('remote_block_ids')!r} is not a list of "
            "block ids (integers 0 to 2^32-1)",
            addresses,
            remote_id,
            hold,
        )
    needed = -(-seq.num_prompt_tokens // s.block_size)
    local = list(seq.block_table)
    if len(remote) < needed or len(local) < needed:
        raise Refused(
            f"{seq.num_prompt_tokens} prompt tokens need {needed} blocks; the prefill holds {len(remote)}, "
            f"this decode allocated {len(local)}",
            addresses,
            remote_id,
            hold,
        )
    # Blocks this decode already holds (a prefix cache hit) are not read; the last prompt block
    # always is, so a read is never empty.
    skip = min(seq.num_cached_tokens // s.block_size, needed - 1)
    remote_slot = params.get("kvlink_slot")
    bad_slot = isinstance(remote_slot, bool) or not isinstance(remote_slot, int) or remote_slot < 0
    if remote_slot is not None and bad_slot:
        raise Refused(f"transfer parameter kvlink_slot={remote_slot!r} is not a state slot", addresses, remote_id, hold)
    local_slot = state_slot(seq)
    if (local_slot is None) != (remote_slot is None):
        raise Refused(
            f"the prefill holds state slot {remote_slot!r}, this decode has {local_slot!r}: a model with "
            "per-request state needs both",
            addresses,
            remote_id,
            hold,
        )
    pages = (local[skip:needed], list(remote[skip:needed]))
    return Read(addresses, pages[0], pages[1], remote_id, hold, skip, local_slot, remote_slot)
