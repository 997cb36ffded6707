"""SGLang's state types as kvlink moves them: which rows of a state buffer a request's payload
names, and how a prefill's rows pair with a decode's. Pure functions, no I/O.

Each state type's buffers hold one row per index (``state_item_lens`` bytes); kvlink reads
whole rows, block-granular, on an engine of the type's own. The payloads SGLang builds:

- ``mamba``: the request's state slots; both sides must name as many.
- ``dsa_tail`` (DeepSeek's kpool-compress tail): a 6-field descriptor ``[row, start, n1, 0,
  n2, ring size]`` of the live tokens in one request row's ring (empty when none are live).
  kvlink reads the whole row, which puts the live tokens where the decode's descriptor expects
  them when both rings have the same size; rings of different sizes (other speculative-slot
  counts) are refused.
- positional types (``qsa_pending``, ``qsa_compressed``, ``swa_ring``, ``c128_state``,
  ``request_row``): the lists must be equal in length.
- paged types (``swa``, ``dsa``, ``block_scale``, ``block_scale_swa``, ``minimax_*``): a
  difference of length is tolerated as SGLang's own backends tolerate it (the window may
  drift by a page): both lists are cut to the shorter one's length.

Between different attention TP sizes, a decode rank reads the ``swa`` pages by KV head, as it
reads the KV pages (SGLang's SWA sub-pool holds the sliding-window layers' K and V in pages
of the same heads); the other types are read whole, between equal TP sizes only
(``split_reason``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

EXACT = frozenset({"mamba", "dsa_tail", "qsa_pending", "qsa_compressed", "swa_ring", "c128_state", "request_row"})
PAGED = frozenset({"swa", "dsa", "block_scale", "block_scale_swa", "minimax_index_k", "minimax_dense_kv"})
KNOWN = EXACT | PAGED


def name(state_type: object) -> str:
    """A state type's wire name (SGLang's ``StateType`` members are ``str`` enums)."""
    return str(getattr(state_type, "value", state_type))


def check(types: Sequence[object]) -> list[str]:
    """The names of ``types``; raises ``ValueError`` naming any this backend does not know."""
    names = [name(t) for t in types]
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise ValueError(
            f"the kvlink transfer backend does not know SGLang state types {unknown} (it moves {sorted(KNOWN)})"
        )
    return names


def rows(state_type: str, indices: Iterable[Any] | None) -> tuple[list[int], int | None]:
    """The rows a payload names, and for ``dsa_tail`` its ring size. Raises ``ValueError`` on
    a malformed descriptor."""
    idx = [int(x) for x in (indices if indices is not None else [])]
    if state_type != "dsa_tail":
        return idx, None
    if not idx:
        return [], None
    if len(idx) != 6 or idx[0] < 0 or idx[5] <= 0:
        raise ValueError(f"a dsa_tail descriptor is [row, start, n1, 0, n2, ring size], got {idx}")
    return [idx[0]], idx[5]


def pair(
    state_type: str, prefill: Sequence[int], decode: Sequence[int], prefill_ring: int | None, decode_ring: int | None
) -> tuple[list[int], list[int]]:
    """``(decode rows, prefill rows)`` to read, row for row; raises ``ValueError`` with both
    sides' values when they cannot pair."""
    p, d = list(prefill), list(decode)
    if state_type == "dsa_tail" and p and d and prefill_ring != decode_ring:
        raise ValueError(
            f"dsa_tail rings of {prefill_ring} slots on the prefill and {decode_ring} on the "
            "decode (other speculative-slot counts): kvlink moves whole rows"
        )
    if len(p) == len(d):
        return d, p
    if state_type in EXACT:
        raise ValueError(f"{state_type} state: the prefill sent {len(p)} indices, this decode expects {len(d)}")
    n = min(len(p), len(d))
    return d[:n], p[:n]


def page_heads(state_type: str, heads: tuple | None, page_size: int, swa_layout: str | None) -> tuple | None:
    """``(total, local, runs)`` KV heads of a state type's pages when a decode of another
    attention TP size can read them by head (``swa`` pages of a known layout: token-major
    ``nhd`` repeats the local heads once per token, head-major ``hnd`` holds each head's
    tokens together), else None."""
    if state_type != "swa" or heads is None or swa_layout not in ("nhd", "hnd"):
        return None
    return (heads[0], heads[1], page_size if swa_layout == "nhd" else 1)


def split_reason(state_type: str, by_head: bool) -> str | None:
    """Why a decode of another attention TP size cannot read this state type (None: it reads
    its heads of it)."""
    if by_head:
        return None
    if state_type == "swa":
        return (
            "its pages' heads are not known (the model configuration could not be read, or "
            "SGLang's SWA pool layout is not nhd or hnd)"
        )
    return f"kvlink reads SGLang's {state_type} state whole, between equal attention TP sizes only"


def addresses(ranks: list[dict[str, Any]], n: int) -> list[list[str]]:
    """Per state type, its engine's address on each prefill rank of a group (rank order; ""
    where a rank named none)."""
    out = []
    for i in range(n):
        per = []
        for r in ranks:
            named = r.get("state_addrs")
            a = named[i] if isinstance(named, list) and i < len(named) else ""
            per.append(a if isinstance(a, str) else "")
        out.append(per)
    return out
