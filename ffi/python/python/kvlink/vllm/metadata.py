"""What the connector's scheduler side and workers exchange: the handshake metadata of a
worker, a decode read, the per-step connector metadata, and the transfer statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .progressive import Growth


@dataclass
class KvlinkHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What one worker advertises to its scheduler: its engine's handshake address."""

    address: str
    engine_id: str
    tp_rank: int
    tp_size: int


@dataclass
class ReadSpec:
    """One decode read: the prefill's blocks ``remote_blocks`` of request ``remote_request_id``
    into this engine's ``local_blocks``, one list per KV cache group, paired by position; each
    TP rank reads the prefill ranks kvlink pairs it with (``kvlink.tp_sources``)."""

    remote_addresses: list[str]
    remote_request_id: str
    local_blocks: list[list[int]]
    remote_blocks: list[list[int]]
    refused: str = ""
    """Why the read cannot be made, when the scheduler found it unusable: it then ends as a
    failed read at once (its blocks reported as load errors)."""
    remote_block_size: int = 0
    """The prefill's tokens per block when they differ from this engine's (0: the same): the
    lists then cover the same tokens, each in its own block size."""
    first_tokens: list[int] = field(default_factory=list)
    """Per KV cache group, the tokens of the first block of the larger size before the first
    one read (empty: 0)."""
    hold: int | None = None
    """The token of the prefill's hold (``remote_hold``): only that hold confirms the read."""
    follow: bool = False
    """A progressive read: the prefill's hold grows while it runs (``remote_blocks`` empty);
    each rank follows the prefill rank of its own rank (equal TP sizes)."""
    skip: list[int] = field(default_factory=list)
    """A progressive read's blocks per KV cache group that this engine has cached already:
    the prefill's first ones, not read."""

    def all_local(self) -> list[int]:
        """Every local block of the read (for load errors)."""
        return [b for group in self.local_blocks for b in group]


@dataclass
class KvlinkConnectorMetadata(KVConnectorMetadata):
    """What the scheduler asks its workers to do in one step (pickled with the step)."""

    holds: dict[str, list[list[int]]] = field(default_factory=dict)
    """Prefill: request id -> blocks to hold and grant to its readers, per KV cache group."""
    hold_tokens: dict[str, int] = field(default_factory=dict)
    """Prefill: request id -> the token every rank holds it under (its ``remote_hold``)."""
    grows: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Prefill, progressive: request id -> ``(transfer id, hold token)`` of a hold to open with
    no block yet (its decode follows it under the transfer id)."""
    growth: dict[str, Growth] = field(default_factory=dict)
    """Prefill, progressive: request id -> what this step makes final of its hold."""
    releases: list[str] = field(default_factory=list)
    """Prefill: holds to drop (request aborted or preempted); no send is reported for them."""
    reads: dict[str, ReadSpec] = field(default_factory=dict)
    """Decode: request id -> read to start."""
    cancels: list[str] = field(default_factory=list)
    """Decode: reads to cancel (after the reads of this step are started)."""
    rejects: list[tuple[list[str], str, str, int | None]] = field(default_factory=list)
    """Decode: ``(remote_addresses, remote_request_id, reason, hold token)`` of requests that
    will not be read: each prefill rank frees the blocks at once."""


@dataclass
class KvlinkConnectorStats(KVConnectorStats):
    """Transfers finished by the workers since the last report: reads done (bytes, seconds
    per transport) and failures by cause. Aggregated over workers and intervals by summing."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {
            "reads": 0,
            "bytes": 0,
            "seconds": 0.0,
            "by_transport": {},
            "failures": {},
            "parts": 0,
        }

    def record_read(self, report: dict[str, Any]) -> None:
        self.data["reads"] += 1
        self.data["bytes"] += int(report["bytes"])
        self.data["seconds"] += float(report["seconds"])
        t = self.data["by_transport"]
        t[report["transport"]] = t.get(report["transport"], 0) + 1

    def record_part(self) -> None:
        """A progressive hold grew by a part (blocks, or layers of them)."""
        self.data["parts"] += 1

    def record_failure(self, cause: str) -> None:
        f = self.data["failures"]
        f[cause] = f.get(cause, 0) + 1

    def aggregate(self, other: KVConnectorStats) -> KvlinkConnectorStats:
        o = other.data
        if not o:
            return self
        self.data["reads"] += o.get("reads", 0)
        self.data["bytes"] += o.get("bytes", 0)
        self.data["seconds"] += o.get("seconds", 0.0)
        self.data["parts"] += o.get("parts", 0)
        for key in ("by_transport", "failures"):
            for k, v in o.get(key, {}).items():
                self.data[key][k] = self.data[key].get(k, 0) + v
        return self

    def reduce(self) -> dict[str, Any]:
        d = self.data
        out: dict[str, Any] = {
            "Num reads": d["reads"],
            "Read MiB": round(d["bytes"] / 2**20, 3),
            # Per read, from read_blocks to the last byte (includes queueing and handshakes).
            "Avg read s": round(d["seconds"] / d["reads"], 6) if d["reads"] else 0.0,
            "Avg read GB/s": round(d["bytes"] / d["seconds"] / 1e9, 3) if d["seconds"] else 0.0,
        }
        if d["parts"]:
            out["Hold parts"] = d["parts"]
        for k, v in sorted(d["by_transport"].items()):
            out[f"Reads over {k}"] = v
        for k, v in sorted(d["failures"].items()):
            out[f"Failures ({k})"] = v
        return out

    def is_empty(self) -> bool:
        return self.data["reads"] == 0 and not self.data["failures"] and not self.data["parts"]
