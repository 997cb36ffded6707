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

Between different attention TP sizes, on an MLA backend (SGLang's MLA and DeepSeek-V4 pools)
every state type but ``mamba`` is whole and the same on every rank, as the latents are, and is
read whole as they are. Otherwise a decode rank reads the ``swa`` pages by KV head, as it
reads the KV pages (SGLang's SWA sub-pool holds the sliding-window layers' K and V in pages
of the same heads), and its slice of each ``mamba`` state tensor by SGLang's own description
of how TP shards it (``mamba_slices``); the other types are read whole, between equal TP sizes
only (``split_reason``).
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


Piece = tuple[int, int, "tuple[int, int, int] | None"]
"""Part of a state slot: byte offset, bytes, and ``(total, local, runs)`` heads (None: whole)."""


def tensor_slices(item: int, dim: int, outer: int, groups: Sequence[int] | None, tp: int) -> list[Piece] | str:
    """One mamba state tensor as a decode of another attention TP size reads it, from what
    SGLang says of it: ``dim`` (``state_dim_per_tensor``) the local size of the axis TP
    shards, 0 when every rank holds the slot whole; ``outer`` (``state_slice_outer_counts``)
    the rows before that axis; ``groups`` (``state_conv_shard_groups``) the full sizes of a
    conv state's sub-blocks each sharded on its own (a gated delta net's query, key and
    value). The slot's pieces, each with its channels as heads, or why not."""
    if dim == 0:
        return [(0, item, None)]
    if dim < 0 or outer <= 0 or item % (dim * outer):
        return f"a state slot of {item} bytes is not {outer} rows of {dim} channels"
    unit = item // (dim * outer)
    if groups is None:
        return [(0, item, (dim * tp, dim, outer))]
    if outer != 1:
        return f"its conv sub-blocks {list(groups)} sit inside each of its {outer} rows"
    if sum(groups) != dim * tp or any(g <= 0 or g % tp for g in groups):
        return f"its conv sub-blocks {list(groups)} do not split evenly into {dim} channels per rank of {tp}"
    out: list[Piece] = []
    at = 0
    for g in groups:
        out.append((at * unit, g // tp * unit, (g, g // tp, 1)))
        at += g // tp
    return out


def mamba_slices(
    items: Sequence[int],
    dims: Sequence[int],
    outers: Sequence[int],
    groups: Sequence[Any],
    tp: int,
    conv: tuple[list[int], int] | None = None,
) -> list[list[Piece]] | str:
    """Every tensor of SGLang's mamba state (``tensor_slices``), or why a decode of another
    attention TP size cannot read them by slice. Where SGLang describes no conv sub-blocks,
    ``conv`` (``settings.mamba2_conv``: a Mamba-2 conv's x, B and C and its channels on this
    rank) gives them to the tensors of that many channels; without either, a sharded state is
    refused: a Mamba-2 conv state is its x, B and C, each sharded on its own, and one slice
    across them would mix them."""
    n = len(items)
    if len(dims) != n or len(outers) != n:
        return "SGLang gives no TP slice sizes for its tensors"
    subs = list(groups) if len(groups) == n else [None] * n
    if not any(subs) and conv is not None:
        subs = [list(conv[0]) if int(d) == conv[1] else None for d in dims]
    if any(d > 0 for d in dims) and not any(subs):
        return (
            "SGLang describes no sub-blocks of this model's conv state (a Mamba-2 conv state "
            "is x, B and C, each sharded on its own), so a slice of it would mix them"
        )
    out = []
    for item, dim, outer, sub in zip(items, dims, outers, subs):
        pieces = tensor_slices(int(item), int(dim), int(outer), sub, tp)
        if isinstance(pieces, str):
            return pieces
        out.append(pieces)
    return out


def split(
    args: Any,
    i: int,
    name: str,
    heads: tuple | None,
    page_size: int,
    tp: int,
    conv: tuple[list[int], int] | None = None,
    mla: bool = False,
) -> tuple[list[list[Piece]] | None, str | None]:
    """State type ``i`` (``name``) of SGLang's ``KVArgs``: its tensors as a decode of another
    attention TP size reads them (per tensor its pieces with their heads), or None and why it
    cannot. ``conv``: a Mamba-2 conv state's sub-blocks (``mamba_slices``). ``mla``: SGLang's
    MLA backends (its MLA and DeepSeek-V4 pools) keep every state but mamba whole and the same
    on every rank, as their latents: read whole, as the latents are."""
    items = [int(x) for x in args.state_item_lens[i]]
    if mla and name != "mamba":
        return [[(0, item, None)] for item in items], None
    if name == "mamba":
        sliced = mamba_slices(
            items,
            _nth(args, "state_dim_per_tensor", i),
            _nth(args, "state_slice_outer_counts", i),
            _nth(args, "state_conv_shard_groups", i),
            tp,
            conv,
        )
        if isinstance(sliced, str):
            return None, f"{split_reason(name)}: {sliced}"
        return sliced, None
    by_head = page_heads(name, heads, page_size, getattr(args, "swa_kv_cache_layout", None))
    if by_head is None:
        return None, split_reason(name)
    return [[(0, item, by_head)] for item in items], None


def _nth(args: Any, field: str, i: int) -> list[Any]:
    """Entry ``i`` of a per-state-type list of ``args`` (empty where SGLang gives none)."""
    values = getattr(args, field, None) or []
    return list(values[i]) if i < len(values) and values[i] is not None else []


def unsplittable(names: Sequence[str], whys: Sequence[Any], side: str = "") -> str | None:
    """The first state type of ``names`` with a reason in ``whys`` (``split``'s, or what a
    prefill registered of them: "" where none) why a decode of another attention TP size
    cannot read it, or None."""
    for name, why in zip(names, whys):
        if isinstance(why, str) and why:
            return f"{name} state{side}: {why}"
    return None


def split_reason(state_type: str) -> str:
    """Why a decode of another attention TP size cannot read this state type (when ``split``
    finds no heads or slices for it)."""
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
