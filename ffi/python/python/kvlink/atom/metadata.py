"""What the scheduler side hands every TP rank each step (pickled by ATOM's runner queue)."""

from __future__ import annotations

from dataclasses import dataclass

from atom.kv_transfer.disaggregation.types import ConnectorMetadata

from .params import Read


@dataclass(frozen=True)
class Hold:
    """A prefill request's blocks to hold for its readers, and the hold's token."""

    blocks: list[int]
    token: int
    #: The request's state slot (ATOM's ``per_req_cache_group``) in a model with SLOT state.
    slot: int | None = None


class KvlinkMetadata(ConnectorMetadata):
    """One step's work for the worker side, keyed by ATOM's request id (``seq.id``)."""

    def __init__(self) -> None:
        super().__init__()
        #: Prefill: hold these requests' blocks (a request held again replaces its hold).
        self.holds: dict[int, Hold] = {}
        #: Prefill: drop these holds (aborted; ATOM already freed their blocks).
        self.releases: list[int] = []
        #: Decode: start these reads.
        self.reads: dict[int, Read] = {}
        #: Decode: cancel these reads (the request was aborted while its read ran).
        self.cancels: list[int] = []
        #: Decode: tell these prefills a request will not be read:
        #: ``(addresses, remote id, hold token, reason)``.
        self.rejects: list[tuple[list[str], str, int, str]] = []
