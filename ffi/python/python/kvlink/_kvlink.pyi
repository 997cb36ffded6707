"""kvlink's native core, re-exported by the ``kvlink`` package: moves LLM KV-cache blocks
between inference engines (RDMA READ, TCP fallback).

Request ids are ``str`` end to end: the ids returned by ``get_finished`` and ``TpAggregator.take``
are the ones passed to ``read_blocks`` / ``hold_blocks``.
"""

from collections.abc import Sequence
from typing import Any

__version__: str
TRANSPORTS: tuple[str, ...]
"""The names ``Engine(transport=...)`` accepts: auto, network, tcp, rdma, local."""

class KvlinkError(Exception):
    """Base class of kvlink errors."""

class InvalidArgument(KvlinkError):
    """An argument is unusable (sizes, block ids out of range, unknown region, bad address)."""

class KvlinkTimeout(KvlinkError):
    """A wait ran past its deadline (connect, handshake, request)."""

class IncompatiblePeer(KvlinkError):
    """The peer's layout, dtype, block size or TP size differs; the message lists each field."""

class PeerError(KvlinkError):
    """The peer refused, broke the protocol or could not be reached."""

class RdmaUnavailable(KvlinkError):
    """RDMA was required but cannot be used; the message says why."""

class Finished:
    """What finished since the last call, each request exactly once."""

    sending: list[str]
    """Sends confirmed by the reader: the prefill blocks may be freed."""
    receiving: list[str]
    """Receives complete: every byte is in place, the request may be scheduled."""
    failed: list[tuple[str, str, bool, str]]
    """``(request_id, side, expired, reason)``; side is ``"send"`` or ``"recv"``. Blocks may be reused."""
    failures: list[dict[str, Any]]
    """The entries of ``failed`` as dicts: ``id``, ``side``, ``expired``, ``reason`` and
    ``cause``: ``"expired"``, ``"peer"`` (the peer aborted or refused it), ``"connection"``,
    ``"rdma"``, ``"gpu"``, ``"cancelled"``, ``"unconfirmed"`` (every byte arrived, but the
    prefill did not confirm it held the blocks until then: recompute) or ``"other"``."""
    reports: list[dict[str, Any]]
    """One per request in ``receiving``: ``id``, ``peer``, ``bytes``, ``segments``, ``blocks``,
    ``work_requests``, ``transport`` (``"tcp"``, ``"rdma"`` or ``"local"``), ``seconds`` (from
    ``read_blocks`` to the report) and ``timeline``: seconds from ``read_blocks`` to
    ``connected``, ``first_byte``, ``last_byte`` and ``confirmed``, and ``held`` (how long the
    prefill had held the request when the read's done notice arrived); ``None`` for a step not
    seen. Empty for sets built by ``TpAggregator``."""
    def is_empty(self) -> bool: ...

def tp_sources(decode_rank: int, decode_size: int, prefill_size: int) -> list[int]:
    """The prefill ranks that decode rank ``decode_rank`` of ``decode_size`` reads from a prefill
    of ``prefill_size`` ranks. Raises ``InvalidArgument`` when neither size is a multiple of
    the other."""

class Engine:
    """One kvlink engine per worker process (one per tensor-parallel rank). A setting left None
    takes the engine's default: request_timeout 60 s, abort_timeout 480 s, handshake_timeout
    5 s, tcp_streams 4, staging_chunk_bytes 2 MiB, staging_buffers 32, lease 30 s,
    session_idle 120 s, spin_us 50 (how long ``wait_finished`` polls while reads are in flight
    before it sleeps, a small TCP read its socket and a small RDMA read its completion queue,
    and a TCP data connection serving this engine's memory its socket for the reader's next
    request after each; 0 never polls)."""

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        *,
        transport: str = "auto",
        tp_rank: int = 0,
        tp_size: int = 1,
        request_timeout: float | None = None,
        abort_timeout: float | None = None,
        handshake_timeout: float | None = None,
        tcp_streams: int | None = None,
        rdma_device: str | None = None,
        engine_id: str | None = None,
        gpu: bool = True,
        staging_chunk_bytes: int | None = None,
        staging_buffers: int | None = None,
        auth_key: str | bytes | None = None,
        insecure: bool = False,
        lease: float | None = None,
        session_idle: float | None = None,
        spin_us: int | None = None,
    ) -> None: ...
    @property
    def handshake_address(self) -> str:
        """Address peers use for the handshake; put it into the request's transfer parameters."""
    @property
    def engine_id(self) -> str: ...
    @property
    def rdma_device(self) -> str | None: ...
    @property
    def rdma_unavailable_reason(self) -> str | None: ...
    def register_memory(self, ptr: int, size: int, *, device: bool | None = None, owner: Any = None) -> int:
        """Registers memory by address. ``owner`` (the object owning the memory) is kept alive
        until deregister() has returned; without one, the memory must stay valid until then.
        ``device=None`` asks the loaded GPU runtimes whether it is GPU memory."""
    def register_array(self, array: Any) -> int:
        """Registers a numpy or CuPy array or a CPU/cuda torch tensor (contiguous, writable);
        keeps it alive. GPU memory goes by RDMA directly, by TCP through pinned staging."""
    def capabilities(self) -> dict[str, tuple[bool, str]]:
        """``{"rdma"|"tcp"|"cuda"|"hip": (available, detail or why not)}``."""
    def deregister(self, region: int) -> None:
        """Stops exporting a region once no transfer uses it (GIL released while waiting)."""
    def set_layout(self, tensors: Sequence[tuple[Any, ...]], tokens_per_block: int, dtype: str) -> None:
        """Tensors as ``(region, offset, block_stride, block_bytes, num_blocks[, group[,
        heads[, token_runs]]])``, in agreed order. ``group``: the tensor's block group (block-id
        space, from 0; default 0). ``heads``: ``(total, local, runs)`` when TP splits the
        tensor's KV heads (``total`` over all ranks, ``local`` on this rank, a block being
        ``runs`` repetitions of the local heads: 1 for head-major ``[heads, tokens, dim]``
        blocks, the tokens per block for token-major ones); ``None`` (default) when every rank
        holds it whole (MLA). Declared heads let engines of other TP sizes read each other.
        ``token_runs``: how many stretches of all the block's tokens a block holds side by side
        (1 for ``[tokens, ...]`` blocks, the local heads for head-major ones); declared, it lets
        engines of other block sizes read each other; ``None`` (default): not declared."""
    def register_kv_caches(self, arrays: list[Any], tokens_per_block: int, dtype: str) -> list[int]:
        """Registers per-tensor caches (first axis = blocks) and sets the layout in that order;
        returns the region ids. On error, the regions it registered are deregistered again."""
    def read_blocks(
        self,
        peer: str | Sequence[str],
        request_id: str,
        local_blocks: Sequence[int] | Sequence[Sequence[int]],
        remote_blocks: Sequence[int] | Sequence[Sequence[int]],
        remote_request_id: str | None = None,
        remote_tokens_per_block: int | None = None,
        first_tokens: Sequence[int] | None = None,
        hold: int | None = None,
    ) -> None:
        """Starts reading ``remote_blocks`` of ``peer`` into ``local_blocks``; returns at once.
        ``peer``: one engine's handshake address, or the prefill TP group's addresses in rank
        order (this rank reads the ranks ``tp_sources`` names: its share of the heads of one
        rank, or the heads of several side by side; TP sizes must divide one another). Block
        lists: one list, or one list per block group of the layout. ``remote_request_id``: the
        id the prefill holds the request under, when it differs from ``request_id`` (this
        engine's own, used by get_finished() and cancel()). ``remote_tokens_per_block``: the
        prefill's tokens per block when they differ from this engine's (one a multiple of the
        other; both layouts declare token runs): the lists then cover the same run of tokens,
        each in its own block size. ``first_tokens``: per block group, the tokens of the first
        block of the larger size (either side's) before the first one read (a cached prefix or
        a sliding window that starts inside it). ``hold``: the token of the prefill's hold
        (what its ``hold_blocks`` returned): only that hold confirms the read."""
    def release(self, request_id: str) -> bool:
        """Prefill side: drops the hold of ``request_id`` (aborted or preempted before its
        reader was told); the grant ends at once and nothing is reported for it. Returns whether
        it was held, once its blocks may be reused: a hold an RDMA reader pinned as it posted
        its reads is waited for until that reader says it is done or the pin lapses (20 ms at
        most, once per hold; the GIL is released meanwhile)."""
    def reject(self, peer: str, remote_request_id: str, reason: str = "rejected", hold: int | None = None) -> None:
        """Decode side: tells the prefill at ``peer`` this engine will not read its request
        ``remote_request_id``, so it frees the blocks now (a request rejected or aborted before
        its read started). ``hold``: the hold's token (else whichever hold of that id). Returns
        at once."""
    def send_message(self, peer: str, body: bytes) -> None:
        """Sends ``body`` (at most 64 KiB) to the engine at ``peer`` over the authenticated
        control connection, for its application (``messages()``); in call order per peer.
        Returns at once; an undeliverable message is logged and counted (``messages_unsent``)."""
    def messages(self) -> list[tuple[str, bytes]]:
        """Messages peers sent since the last call, oldest first: ``(sender engine id, body)``.
        The inbox keeps at most 4,096 messages or 16 MiB; call it every scheduler step."""
    def hold_blocks(
        self,
        request_id: str,
        blocks: Sequence[int] | Sequence[Sequence[int]],
        reader: str | None = None,
        abort_timeout: float | None = None,
        token: int | None = None,
    ) -> int:
        """Prefill side: hold ``blocks`` of a request (one list, or one per block group) and
        grant them to its readers (over TCP they may read those blocks, and only those, under
        this request id) until every reader confirmed, one aborted, or the abort timeout. The
        readers are the decode ranks that read this rank (several when the decode's TP size is
        a multiple of this one's). ``reader`` names the only engine allowed to read and
        confirm. Returns the hold's token (``token``, non-zero, or one the engine picks): the
        reader passes it to ``read_blocks(hold=...)``."""
    def hold_growing(
        self,
        request_id: str,
        blocks: Sequence[int] | Sequence[Sequence[int]],
        reader: str | None = None,
        abort_timeout: float | None = None,
        token: int | None = None,
    ) -> int:
        """Prefill side: hold a request whose blocks are not all final yet, as hold_blocks()
        does, but ``blocks`` may be empty, the hold grows by extend_hold() as blocks become
        final, and confirms no read before seal_hold(). Readers that follow the request
        (``follow_blocks()``) read each part as it is held. Returns the hold's token."""
    def extend_hold(
        self,
        request_id: str,
        blocks: Sequence[int] | Sequence[Sequence[int]],
        tensors: tuple[int, int] | None = None,
    ) -> None:
        """Prefill side: add ``blocks`` (final from now on, after those held so far) to the
        growing hold of ``request_id`` and tell its followers. ``tensors``: ``(start, end)``
        of the layout's tensors when only those are final (a step whose layers become final a
        group at a time): new blocks with ``(0, end)``, then ``[]`` with the next tensors of
        the same blocks until the last. Raises for a request not held, a sealed hold, blocks
        held already, tensors out of order. Never blocks."""
    def seal_hold(self, request_id: str) -> None:
        """Prefill side: seal the growing hold of ``request_id``: it is complete, its readers
        may confirm their reads, and its followers are told. Never blocks."""
    def follow_blocks(
        self,
        peer: str,
        request_id: str,
        local_blocks: Sequence[int] | Sequence[Sequence[int]],
        remote_request_id: str | None = None,
        hold: int | None = None,
        first_part_timeout: float | None = None,
        part_timeout: float | None = None,
        skip: Sequence[int] | None = None,
    ) -> None:
        """Decode side: start a progressive read of the request the prefill at ``peer`` holds
        (or will hold) under ``remote_request_id`` (default ``request_id``) into
        ``local_blocks`` (all the request's blocks here, paired in order with the prefill's as
        it holds them). Each part is read as soon as it is held; the read ends in
        get_finished() once the prefill sealed its hold, every part is here and it confirmed
        them, or fails (the hold ended first, a part late, the request timeout).
        ``first_part_timeout`` and ``part_timeout`` (seconds; default the request timeout)
        bound the wait for the first part and each later one. ``skip``: per block group, how
        many of the prefill's first blocks are not read (a prefix this engine has cached;
        ``local_blocks`` then pair with the blocks after them). Returns at once."""
    def cancel(self, request_id: str) -> bool:
        """Decode side: cancel a read in flight (it ends in ``failed``, its prefill is told);
        ``False`` when none with that id is in flight. Never blocks."""
    def get_finished(self) -> Finished:
        """Everything finished since the last call. Never blocks."""
    def wait_finished(self, timeout: float) -> Finished:
        """Like get_finished(), waiting up to ``timeout`` seconds (GIL released)."""
    def connect(self, peer: str, timeout: float = 10.0) -> dict[str, Any]:
        """Handshake with ``peer`` (or reuse the session); returns its descriptor summary."""
    def session_state(self, peer: str) -> tuple[str, str | None]:
        """What this engine knows of its session with ``peer``, without waiting or connecting:
        ``("none" | "connecting" | "up" | "down", reason or None)``. A session is down once its
        connection closed or stayed silent for three keep-alives, or its last connect failed;
        the next read or message to the peer connects again."""
    def in_flight(self) -> tuple[int, int]:
        """``(receiving, holding)``."""
    def close(self) -> None:
        """Closes the ports and sessions; reads in flight fail; idempotent (also via ``with``)."""
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> Engine: ...
    def __exit__(self, *exc: Any) -> bool: ...
    def stats(self) -> dict[str, int]:
        """Monotonic counters: handshakes_accepted/refused, data_requests_served/refused,
        bytes_served, bytes_staged_out/in (GPU memory moved through TCP staging buffers),
        notices_refused, reads_pinned (RDMA reads confirmed by a pin),
        messages_received/refused/sent/unsent, reads_done/failed/expired/cancelled, bytes_read,
        sends_done/failed/expired/lease_expired, sessions_opened, sessions_closed_idle; gauges:
        control_connections, data_connections, sessions, queue_pairs
        (``kvlink.metrics.render`` exports them)."""

class TpAggregator:
    """Releases a request once every TP rank reported it; a failure on any rank fails it."""

    def __init__(self, world_size: int, rank_timeout: float = 60.0) -> None: ...
    def add(self, rank: int, finished: Any) -> None:
        """One rank's report: a Finished, or any object with ``sending``, ``receiving`` and
        ``failed`` attributes of the same shapes (Finished is not picklable; ranks in other
        processes send the three lists)."""
    def take(self) -> Finished: ...
    @property
    def pending(self) -> int: ...

class EventPublisher:
    """Publishes an engine's KV-cache events, byte-compatible with vLLM's and SGLang's
    publishers (``kvlink.events.Publisher``). Encoding, numbering and sending run on kvlink's
    thread."""

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        dp_rank: int = 0,
        encoding: str = "current",
        replay_format: str = "current",
        buffer_steps: int = 10000,
        max_queue: int = 100000,
        snapshot_max_blocks: int = 1048576,
    ) -> None: ...
    @property
    def endpoint(self) -> str:
        """The live endpoint (the real port when port 0 was asked for)."""
    @property
    def replay_endpoint(self) -> str | None: ...
    @property
    def incarnation(self) -> int | None:
        """This run's incarnation, stamped on every batch as a fourth element."""
    def publish(self, events: Sequence[Any], ts: float | None = None, dp_rank: int | None = None) -> None:
        """One batch (one scheduler step) of event dicts or engine event objects; never
        blocks. Raises ``KvlinkError`` when the queue is full (ipc and connected endpoints;
        batch dropped and counted) or closed, ``InvalidArgument`` for an unreadable event
        (nothing sent)."""
    def stats(self) -> dict[str, int]:
        """published, dropped, queued, next_seq, replay_requests, replayed_batches,
        bad_replay_requests, replay_timeouts."""
    def close(self, timeout: float = 5.0) -> dict[str, int] | None:
        """Sends what is queued (up to ``timeout``), closes, returns the final counters."""
    def __enter__(self) -> EventPublisher: ...
    def __exit__(self, *exc: Any) -> bool: ...

class EventSubscriber:
    """Reads a vLLM, SGLang, ATOM or kvlink KV-event stream (``kvlink.events.Subscriber``):
    batches in sequence order, each once; gaps filled by replay; resync signals."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout: float = 2.0,
        connect_timeout: float = 10.0,
        start_from: int | None = None,
        max_buffered: int = 10000,
        snapshots: bool = False,
    ) -> None: ...
    def next(self, timeout: float = 1.0) -> dict[str, Any] | None:
        """One item or None after ``timeout``: ``{"kind": "batch", "seq", "ts", "dp_rank",
        "events", "skipped"}``, ``{"kind": "malformed", "seq", "reason"}``, or ``{"kind":
        "resync", "reason": "publisher_restart", "last", "now"}`` / ``{"kind": "resync",
        "reason": "history_lost", "from", "resumed"}``, or ``{"kind": "gap_filled", "from",
        "through"}`` after a replay recovered everything it was asked for; with
        ``snapshots=True``, ``{"kind": "snapshot", "seq", "topic", "batches": [{"ts",
        "dp_rank", "events"}], "skipped"}`` when a kvlink publisher's ring no longer held the
        history (it replaces what was derived from the stream)."""
    def __iter__(self) -> EventSubscriber: ...
    def __next__(self) -> dict[str, Any]: ...
    @property
    def last_seq(self) -> int | None: ...
    def stats(self) -> dict[str, int]:
        """received, delivered, duplicates, replays (gaps and late joins filled by replay),
        replay_failures, resyncs, malformed_batches, skipped_events, bad_messages, snapshots."""

class EventMerger:
    """Merges several publishers' streams into one renumbered stream with its own replay
    (``kvlink.events.Merger``)."""

    def __init__(
        self,
        inputs: Sequence[tuple[str, str | None]],
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        encoding: str = "current",
        input_topic: str = "",
        keep_topics: bool = False,
        tp_size: int = 1,
    ) -> None: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def replay_endpoint(self) -> str | None: ...
    def stats(self) -> dict[str, Any]:
        """The output's counters, ``tp_groups`` (with ``tp_size`` > 1: per group, events
        forwarded, held and evicted), and ``inputs``: per input endpoint, connected, last_seq,
        batches, resyncs, malformed, dropped."""
    def close(self) -> None: ...

class PageSplitter:
    """A stored token run as BlockStored pages of ``block_size`` tokens with chained SHA-256
    digests and ``token_offset``; ``hash``: ``"vllm"`` (low 64 bits, unsigned) or
    ``"sglang"`` (first 8 bytes, signed)."""

    def __init__(self, block_size: int, hash: str = "vllm") -> None: ...
    def split(
        self,
        tokens: Sequence[int],
        parent: bytes | None = None,
        token_offset: int = 0,
        medium: str | None = None,
    ) -> tuple[list[dict[str, Any]], bytes | None]:
        """``(events, last_digest)``; pass ``last_digest`` as ``parent`` for the next run."""

class EventIndex:
    """Which engine holds which KV blocks, per holder (engine, DP rank, medium, KV-cache
    group), from their event streams, and how many of a prompt's leading blocks each holds.
    A holder is ``"exact"``, ``"recovering"`` (events were lost: older blocks are withheld from
    answers) or ``"stale"`` (marked down); a publisher restart drops the engine's blocks."""

    def __init__(self, *, max_blocks: int = 16777216, max_holders: int = 65536) -> None: ...
    def apply(self, engine: str, item: dict[str, Any]) -> None:
        """Applies an item of ``engine``'s ``Subscriber`` (or a ``Merger``'s stream)."""
    def apply_events(self, engine: str, events: Sequence[Any], dp_rank: int | None = None) -> None:
        """Applies a list of events (dicts or the engines' event objects) as one batch."""
    def overlap_tokens(
        self,
        tokens: Sequence[int],
        block_size: int,
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[dict[str, Any]]:
        """Holders of the prompt's leading full blocks, most blocks first: dicts with
        ``engine``, ``dp_rank``, ``medium``, ``group``, ``blocks``, ``tokens``, ``state``."""
    def overlap_hashes(self, hashes: Sequence[int]) -> list[dict[str, Any]]:
        """Holders of the leading blocks named by the engines' own block hashes."""
    def set_stale(self, engine: str, stale: bool) -> None: ...
    def remove_engine(self, engine: str) -> None: ...
    def holders(self) -> list[dict[str, Any]]: ...
    def stats(self) -> dict[str, int]: ...
