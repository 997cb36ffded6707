"""kvlink's SGLang backend, the per-rank part: ``KvlinkKVManager`` (its kvlink engines, one per
index space; the bootstrap registration and routes; the rooms in flight, and the messages and
completions that move them) and ``KvlinkTransferError``. The rooms themselves, ``KvlinkKVSender``
and ``KvlinkKVReceiver``, are in ``kvlink.sglang.conn``, whose docstring describes the flow.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs
from sglang.srt.disaggregation.utils import DisaggregationMode

import kvlink
from kvlink import core
from kvlink.sglang import bootstrap, nic, settings, states, wire

logger = logging.getLogger(__name__)

_REMEMBERED_ROOMS = 4096
# How often the peers that rooms wait on are looked at.
_PEER_CHECK_S = 1.0
# SGLang polls every request of a queue in turn, and each poll pumps: within this interval one
# pump serves them all (a scheduler step's polls take far less).
_PUMP_INTERVAL_S = 0.001
# How long clear() waits for the cancelled reads of a room to stop writing (kvlink waits for
# what is in flight at most its I/O timeout).
_DRAIN_S = 15.0


class KvlinkTransferError(Exception):
    """Why a room's transfer failed, as SGLang's schedulers read it (``failure_reason``,
    ``is_from_another_rank``)."""

    def __init__(self, room: int, reason: str, is_from_another_rank: bool = False):
        super().__init__(reason)
        self.bootstrap_room = room
        self.failure_reason = reason
        self.is_from_another_rank = is_from_another_rank

    def __str__(self) -> str:
        return f"kvlink transfer of room {self.bootstrap_room} failed: {self.failure_reason}"


class KvlinkKVManager(BaseKVManager):
    """One per scheduler rank: kvlink engines for the KV pages, the aux rows and each state type,
    the rooms in flight, and the messages and completions that move them."""

    # SGLang's deferred release of a failed room's pages (SGLANG_DISAGGREGATION_DEFERRED_
    # DECODE_KV_RELEASE): the decode keeps them until is_abort_release_safe, so clear() then
    # finds nothing left to wait for instead of blocking the scheduler thread.
    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ):
        self.kv_args = args
        self.mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.enable_deferred_decode_kv_release = settings.env_flag("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE")
        self.pumped = 0.0
        self.bootstrap_timeout = settings.env_seconds("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)
        self.waiting_timeout = settings.env_seconds("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300)
        par = settings.parallel()
        settings.refuse_unsupported(server_args, par, disaggregation_mode)
        # Both sides number ranks inside the attention-TP group (SGLang's prefill passes the
        # global TP rank as engine_rank, its decode the rank in the group).
        self.tp_rank, self.tp_size = par["attn_tp_rank"], par["attn_tp_size"]
        self.engine_rank = self.tp_rank
        self.dp_rank, self.dp_size = settings.dp_group(par, args)
        self.page_size = int(args.page_size)
        self.heads = settings.kv_heads(args, server_args, self.tp_size, self.is_mla_backend)
        self.conv = settings.mamba2_conv(server_args) if getattr(args, "state_types", None) else None
        # What prefill and decode must share (compared through the registry, in full), and the
        # engines' 32-byte tag of it. A KV layout SGLang names (DeepSeek-V4's) or, for MHA
        # pools, how a page orders tokens and heads.
        layout = getattr(args, "kv_layout", None) or ("mla" if self.is_mla_backend else settings.mha_layout())
        self.dtype = f"{args.kv_cache_dtype_str}/{layout}/p{self.page_size}"
        self.tag = settings.layout_tag(self.dtype)
        link = settings.link()
        self._make_engines(args, link, layout)
        self.engines = [e for e in [self.kv, self.aux, *self.states] if e is not None]
        self.metrics = core.serve_metrics(link, self.engines, self.dp_rank * self.tp_size + self.tp_rank)
        # request id -> the sender or receiver it belongs to
        self.owners: dict[str, Any] = {}
        # decode: cancelled reads whose last writes may still land (request id -> engine)
        self.draining: dict[str, kvlink.Engine] = {}
        # room -> its sender (prefill) or receiver (decode), kvlink.sglang.sender / .receiver
        self.senders: dict[int, Any] = {}
        self.receivers: dict[int, Any] = {}
        # prefill: senders with chunks waiting for a GPU event (room -> sender)
        self.waiting_senders: dict[int, Any] = {}
        # prefill: wants that came before their sender; rooms a prefill sender gave up on before
        # any want (answered with an abort); attempts a decode aborted before its want came
        self.early_wants: OrderedDict[int, list[tuple[Any, Any]]] = OrderedDict()
        self.aborted: OrderedDict[int, str] = OrderedDict()
        self.withdrawn: OrderedDict[tuple, str] = OrderedDict()
        self.req_to_decode_prefix_len: dict[int, int] = {}
        # decode: what SGLang's decode scheduler reads, and the routes it learned
        self.prefill_info_table: dict[str, Any] = {}
        self.routes: dict[tuple, dict[str, Any]] = {}
        # decode: registry lookups under way (off the scheduler thread), and the DP groups'
        # ranks they found
        self.lookups: dict[str, Any] = {}
        self.lookup_pool: ThreadPoolExecutor | None = None
        self.groups: dict[tuple, list[dict[str, Any]]] = {}
        self.bad_messages = 0
        self.unsent_messages = 0
        # Peers rooms wait on whose session is down: address -> since when. A room fails once
        # its peer stays down KVLINK_PEER_TIMEOUT seconds.
        self.peer_timeout = float(os.environ.get("KVLINK_PEER_TIMEOUT", 10))
        self.peers_down: dict[str, float] = {}
        self.peers_checked = 0.0
        # decode: retracted requests sent back to their prefill (``submit_prefill_recompute``),
        # and those whose /generate failed, applied on the scheduler thread
        self.recompute: ThreadPoolExecutor | None = None
        self.recompute_failed: deque[tuple] = deque()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.register_to_bootstrap()
        logger.info(
            "kvlink %s rank %d: KV engine %s at %s, %d index spaces (%s)",
            self.mode.value,
            self.engine_rank,
            self.kv.engine_id,
            self.kv.handshake_address,
            len(self.engines),
            core.transport_summary(self.kv),
        )

    def _make_engines(self, args: KVArgs, link: core.Settings, layout: str) -> None:
        """The rank's engines, one per index space (``kv``, ``aux``, ``states``), each with the
        memory of its space registered and its layout declared."""
        # A page repeats the local heads once per token (token-major) or holds each head's
        # tokens together (head-major).
        runs = self.page_size if layout == "nhd" else 1
        kv_heads = (self.heads[0], self.heads[1], runs) if self.heads and layout in ("nhd", "hnd") else None
        listen = core.listen_address(link, 0, settings.node_address)
        rdma = nic.choose(
            link.rdma_device,
            getattr(args, "ib_device", None),
            getattr(args, "gpu_id", None),
            settings.gpu_pci(getattr(args, "gpu_id", None)),
        )
        opts = dict(link.engine_options(), rdma_device=rdma)
        # One engine per index space: block ids of one read index every tensor of its layout.
        # The KV engine is this rank of the attention-TP group (it reads head slices of
        # prefill ranks of another TP size); the aux and state engines pair one prefill rank
        # with one decode rank, whole rows.
        self.kv = self._engine(
            listen,
            dict(opts, tp_rank=self.tp_rank, tp_size=self.tp_size),
            args.kv_data_ptrs,
            args.kv_data_lens,
            args.kv_item_lens,
            self.page_size,
            self.tag,
            kv_heads,
        )
        aux_ptrs = list(getattr(args, "aux_data_ptrs", None) or [])
        self.aux = (
            self._engine(listen, opts, aux_ptrs, args.aux_data_lens, args.aux_item_lens, 1, "sglang-aux")
            if aux_ptrs
            else None
        )
        # Each state type on an engine of its own, tagged with its name (a pair whose types
        # differ fails at the handshake too).
        state_ptrs = list(getattr(args, "state_data_ptrs", None) or [])
        self.state_types = states.check(list(getattr(args, "state_types", None) or [])[: len(state_ptrs)])
        if len(self.state_types) != len(state_ptrs):
            raise ValueError(f"kvlink: {len(state_ptrs)} state buffers but {len(self.state_types)} state types")
        self.states: list[kvlink.Engine | None] = []
        # Per state type, why a decode of another attention TP size cannot read it (None: by
        # head, on an engine that is this rank of the attention-TP group, as the KV engine).
        self.state_split: list[str | None] = []
        for i, ptrs in enumerate(state_ptrs):
            pieces, why = states.split(
                args, i, self.state_types[i], self.heads, self.page_size, self.tp_size, self.conv, self.is_mla_backend
            )
            self.state_split.append(why)
            tp = dict(tp_rank=self.tp_rank, tp_size=self.tp_size) if why is None else {}
            self.states.append(
                self._engine(
                    listen,
                    dict(opts, **tp),
                    ptrs,
                    args.state_data_lens[i],
                    args.state_item_lens[i],
                    1,
                    f"sglang-{self.state_types[i]}",
                    pieces=pieces,
                )
                if ptrs
                else None
            )

    def _engine(
        self,
        listen: str,
        opts: dict[str, Any],
        ptrs: list[int],
        lens: list[int],
        item_lens: list[int],
        tokens_per_block: int,
        dtype: str,
        heads: tuple | None = None,
        pieces: list[list[states.Piece]] | None = None,
    ) -> kvlink.Engine:
        """An engine with ``ptrs`` registered, each buffer one tensor of ``item_lens``-byte
        blocks with ``heads``, or the tensors of its ``pieces`` (offset and bytes in each
        block, and heads)."""
        e = kvlink.Engine(listen, **opts)
        try:
            regions: dict[int, int] = {}
            tensors = []
            for n, (ptr, size, item) in enumerate(zip(ptrs, lens, item_lens)):
                ptr, size, item = int(ptr), int(size), int(item)
                if item <= 0 or size < item:
                    raise kvlink.InvalidArgument(f"buffer at {ptr:#x}: {size} bytes of {item}-byte items")
                if ptr not in regions:
                    regions[ptr] = e.register_memory(ptr, size)
                for at, count, h in pieces[n] if pieces is not None else [(0, item, heads)]:
                    tensors.append((regions[ptr], at, item, count, size // item, 0, h))
            e.set_layout(tensors, tokens_per_block, dtype)
        except Exception:
            e.close()
            raise
        return e

    def register_to_bootstrap(self) -> None:
        """Tells the bootstrap server this rank's KV engine (retried in the background)."""
        sa = self.server_args
        # The bootstrap server runs beside the first node's tokenizer manager.
        dist = getattr(sa, "dist_init_addr", None)
        host = dist.rsplit(":", 1)[0].strip("[]") if dist else (getattr(sa, "host", None) or "127.0.0.1")
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        port = int(getattr(sa, "disaggregation_bootstrap_port", 8998))
        entry = {
            "dp_rank": self.dp_rank,
            "tp_rank": self.engine_rank,
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "addr": self.kv.handshake_address,
            "engine_id": self.kv.engine_id,
            "page_size": self.page_size,
            "dtype": self.dtype,
            "heads": self.heads is not None,
            "states": self.state_types,
            # Each state type's engine ("" where this rank has no buffer of it): a decode of
            # another attention TP size reads the types it can split from the group's ranks.
            "state_addrs": [e.handshake_address if e is not None else "" for e in self.states],
            # Why a decode of another attention TP size cannot read each state type ("": it can).
            "state_split": [w or "" for w in self.state_split],
        }
        http_port = getattr(sa, "port", None)
        if isinstance(http_port, int) and 0 < http_port < 65536:
            entry["http_port"] = http_port
        bootstrap.register(f"{host}:{port}", entry)

    # -- decode: where the prefill ranks are ---------------------------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: whether every prefill rank behind ``bootstrap_addr`` registered (SGLang asks
        before it initialises receivers, once a second, and gives up after some tries). The
        registry is asked off the scheduler thread: a call starts the lookup, and a later one
        takes its answer (a bootstrap server that does not answer never stalls the scheduler)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        lookup = self.lookups.get(bootstrap_addr)
        if lookup is None:
            if self.lookup_pool is None:
                self.lookup_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvlink-bootstrap")
            self.lookups[bootstrap_addr] = self.lookup_pool.submit(bootstrap.look_up, bootstrap_addr)
            return False
        if not lookup.done():
            return False
        del self.lookups[bootstrap_addr]
        found = lookup.result()
        if found is None:
            return False
        info, groups = found
        self.prefill_info_table[bootstrap_addr] = info
        for dp, ranks in groups.items():
            self.groups[(bootstrap_addr, dp)] = ranks
        return True

    def forget_route(self, bootstrap_addr: str) -> None:
        """Drops what was learned about a prefill (it may have restarted on other ports)."""
        self.prefill_info_table.pop(bootstrap_addr, None)
        for table in (self.routes, self.groups):
            for key in [k for k in table if k[0] == bootstrap_addr]:
                del table[key]

    def route(self, bootstrap_addr: str, dp_rank: int) -> dict[str, Any]:
        """The prefill ranks this decode rank reads from: ``addrs`` and ``engine_ids`` of the
        whole attention-TP group of DP group ``dp_rank`` (rank order, as kvlink's reads take
        them), ``sources`` (the ranks this one reads: ``kvlink.tp_sources``), ``http_port``.
        Raises ``ValueError`` with the reason when they are unknown or cannot pair."""
        key = (bootstrap_addr, dp_rank)
        if key in self.routes:
            return self.routes[key]
        if not self.try_ensure_parallel_info(bootstrap_addr):
            raise ValueError(f"the prefill at {bootstrap_addr} has not registered all its ranks")
        info = self.prefill_info_table[bootstrap_addr]
        if info.dtype != self.dtype:
            raise ValueError(f"KV cache {info.dtype!r} on the prefill, {self.dtype!r} here")
        if info.states != self.state_types:
            raise ValueError(f"state types {info.states} on the prefill, {self.state_types} here")
        if not 0 <= dp_rank < info.dp_size:
            raise ValueError(f"prefill DP rank {dp_rank}: the prefill at {bootstrap_addr} has {info.dp_size}")
        p, d = info.tp_size, self.tp_size
        try:
            sources = kvlink.tp_sources(self.tp_rank, d, p)
        except kvlink.InvalidArgument as e:
            raise ValueError(f"prefill attention TP {p}, decode {d}: {e}") from None
        if p != d:
            if not self.is_mla_backend and not (self.heads and info.heads):
                raise ValueError(
                    f"prefill attention TP {p}, decode {d}: the KV heads of this model are not "
                    "known on both sides (its configuration could not be read), so pages cannot "
                    "be split by head"
                )
        ranks = self.groups.get((bootstrap_addr, dp_rank))
        if ranks is None or len(ranks) != p:
            raise ValueError(f"prefill DP group {dp_rank} is not registered at {bootstrap_addr}")
        if p != d:
            # Why this rank's state, or the prefill's, cannot be read between these TP sizes.
            mine = [w if e is not None else "" for e, w in zip(self.states, self.state_split)]
            why = states.unsplittable(self.state_types, mine) or states.unsplittable(
                self.state_types, ranks[0].get("state_split") or [], " on the prefill"
            )
            if why is not None:
                raise ValueError(f"prefill attention TP {p}, decode {d}: {why}")
        state_addrs = states.addresses(ranks, len(self.states))
        if p != d and any(e is not None and not all(state_addrs[i]) for i, e in enumerate(self.states)):
            raise ValueError(f"prefill attention TP {p}, decode {d}: the prefill's ranks named no state engines")
        r = {
            "addrs": [x["addr"] for x in ranks],
            "engine_ids": [x["engine_id"] for x in ranks],
            "sources": list(sources),
            "state_addrs": state_addrs,
            "http_port": ranks[0].get("http_port"),
        }
        self.routes[key] = r
        return r

    # -- progress --------------------------------------------------------------------------

    def pump(self, force: bool = False) -> None:
        """Takes every engine's finished transfers and the KV engine's messages, and hands each
        to its room. Called from every poll (at most once per ``_PUMP_INTERVAL_S`` unless
        ``force``); never blocks."""
        now = time.monotonic()
        if not force and now - self.pumped < _PUMP_INTERVAL_S:
            return
        self.pumped = now
        while self.recompute_failed:
            receiver, why = self.recompute_failed.popleft()
            receiver._fail(why, tell_peer=True)
        self._watch_peers()
        for sender in list(self.waiting_senders.values()):
            sender.flush()
        for e in self.engines:
            self._finished(e.get_finished())
        for sender_id, body in self.kv.messages():
            try:
                m = wire.decode(body)
            except wire.BadMessage as e:
                self._bad(sender_id, str(e))
                continue
            self._dispatch(sender_id, m)

    def _finished(self, f: Any) -> None:
        if f.is_empty():
            return
        for rid in list(f.sending) + list(f.receiving):
            self.draining.pop(rid, None)
            owner = self.owners.pop(rid, None)
            if owner is not None:
                owner._done(rid)
        for d in f.failures:
            self.draining.pop(d["id"], None)
            owner = self.owners.pop(d["id"], None)
            if owner is not None:
                owner._fail(f"{d['side']} {d['id']} {d['cause']}: {d['reason']}", tell_peer=True)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """Decode, SGLang's deferred release: whether no cancelled read of the room can still
        write into its pages (every one was reported). ``required_acks`` is SGLang's count of
        prefill acknowledgements; kvlink's reader knows of its own reads."""
        self.pump(force=True)
        r = self.receivers.get(bootstrap_room)
        return r is None or not any(rid in self.draining for rid in r.cancelled)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """SGLang's deferred release ended for the room (nothing is kept per room)."""

    def _watched(self) -> dict[str, list[Any]]:
        """The peers live rooms wait on: for a sender, the decode ranks that asked; for a
        receiver that asked, the prefill ranks it reads."""
        out: dict[str, list[Any]] = {}
        for s in self.senders.values():
            if s.outcome is None:
                for w in s.wants.values():
                    out.setdefault(w["addr"], []).append(s)
        for r in self.receivers.values():
            if r.outcome is None and r.asked_at is not None and r.route is not None:
                for i in r.route["sources"]:
                    out.setdefault(r.route["addrs"][i], []).append(r)
        return out

    def _watch_peers(self) -> None:
        """Once a second: fails the rooms of a peer whose session with this rank's KV engine
        stayed down ``peer_timeout`` seconds (its process died, its host or link went away:
        the engine's keep-alives notice within three silent periods). A peer that is down is
        pinged, which connects again, so one that is alive comes back up in time."""
        now = time.monotonic()
        if now - self.peers_checked < _PEER_CHECK_S:
            return
        self.peers_checked = now
        watched = self._watched()
        for addr in [a for a in self.peers_down if a not in watched]:
            del self.peers_down[addr]
        for addr, rooms in watched.items():
            state, why = self.kv.session_state(addr)
            if state in ("up", "connecting") and addr not in self.peers_down:
                continue
            if state == "up":
                del self.peers_down[addr]
                continue
            since = self.peers_down.setdefault(addr, now)
            if now - since < self.peer_timeout:
                if state != "connecting":
                    self.send(addr, wire.ping())
                continue
            del self.peers_down[addr]
            peer = "prefill" if self.mode != DisaggregationMode.PREFILL else "decode"
            for room in rooms:
                room._fail(
                    f"the {peer} engine at {addr} has been unreachable for {now - since:.0f} s "
                    f"(KVLINK_PEER_TIMEOUT): {why or state}",
                    tell_peer=True,
                )

    def drain(self, rids: list[str]) -> None:
        """Waits until the cancelled reads ``rids`` were reported (their last write landed), at
        most ``_DRAIN_S``: SGLang reuses a failed request's pages right after ``clear()``."""
        end = time.monotonic() + _DRAIN_S
        while any(r in self.draining for r in rids):
            left = end - time.monotonic()
            if left <= 0:
                logger.error(
                    "kvlink: cancelled reads %s not reported within %.0f s; their pages may still be written",
                    [r for r in rids if r in self.draining],
                    _DRAIN_S,
                )
                return
            engines = {id(e): e for r, e in self.draining.items() if r in rids}
            for e in engines.values():
                self._finished(e.wait_finished(min(left, 0.05)))

    def send(self, peer: str, body: bytes) -> bool:
        """Sends a message; a refusal (peer unreachable with its queue full, engine closed) is
        logged and counted, never raised into SGLang's scheduler."""
        try:
            self.kv.send_message(peer, body)
            return True
        except kvlink.KvlinkError as e:
            self.unsent_messages += 1
            if self.unsent_messages <= 10 or self.unsent_messages % 1000 == 0:
                logger.warning("kvlink: could not send a message to %s (%d so far): %s", peer, self.unsent_messages, e)
            return False

    def _bad(self, sender_id: str, why: str) -> None:
        self.bad_messages += 1
        if self.bad_messages <= 10 or self.bad_messages % 1000 == 0:
            logger.warning(
                "kvlink: dropped a malformed message from engine %s (%d so far): %s", sender_id, self.bad_messages, why
            )

    def _dispatch(self, sender_id: str, m: dict[str, Any]) -> None:
        room, kind, nonce = m["room"], m["t"], m["nonce"]
        if kind == "ping":
            return
        if self.mode == DisaggregationMode.PREFILL:
            sender = self.senders.get(room)
            if kind == "want":
                if (room, nonce) in self.withdrawn:
                    return
                if sender is not None:
                    sender._on_want(m, sender_id)
                elif room in self.aborted:
                    self.send(m["addr"], wire.abort(room, nonce, self.aborted[room]))
                else:
                    early = [w for w in self.early_wants.get(room, []) if w[1] != sender_id]
                    _remember(self.early_wants, room, early[-64:] + [(m, sender_id)])
            elif kind == "abort" and nonce is not None:
                if sender is not None and any(w["nonce"] == nonce for w in sender.wants.values()):
                    sender._on_peer_abort(m["reason"], sender_id)
                else:
                    # An attempt withdrawn before its want got here: its want will be ignored.
                    _remember(self.withdrawn, (room, nonce), m["reason"])
                    early = [w for w in self.early_wants.get(room, []) if w[0]["nonce"] != nonce]
                    if early:
                        self.early_wants[room] = early
                    else:
                        self.early_wants.pop(room, None)
            else:
                self._bad(sender_id, f"a {kind} message on a prefill")
        else:
            receiver = self.receivers.get(room)
            if receiver is None:
                logger.debug("kvlink: %s message for room %d, which this decode rank does not know", kind, room)
            elif nonce is not None and nonce != receiver.nonce:
                logger.debug("kvlink: %s message for an earlier attempt at room %d", kind, room)
            elif kind == "chunk":
                receiver._on_chunk(m, sender_id)
            elif kind == "abort":
                receiver._on_peer_abort(m["reason"], sender_id)
            else:
                self._bad(sender_id, f"a {kind} message on a decode")

    # -- decode: retraction ------------------------------------------------------------------

    def submit_prefill_recompute(self, kv_receiver: Any, payload: dict[str, Any]) -> None:
        """A retracted request goes back to its prefill: SGLang's decode scheduler has set up a
        new receiver for it (its ``want`` names the room again) and asks the prefill's HTTP API
        to compute the prompt again (``payload``, SGLang's ``/generate`` body); the prefill then
        sends the KV as for any request. Only the first rank posts it (the prefill's server
        fans it out to its ranks); the post runs off the scheduler thread, and a failure fails
        the room at the next poll, telling the prefill."""
        if self.tp_rank != 0:
            return
        route = getattr(kv_receiver, "route", None)
        port = route.get("http_port") if route else None
        if port is None:
            kv_receiver._fail(
                "the retracted request cannot go back to its prefill: it registered no HTTP "
                "port with the bootstrap server",
                tell_peer=True,
            )
            return
        host = kv_receiver.bootstrap_addr.rsplit(":", 1)[0]
        url = f"http://{host}:{port}/generate"
        if self.recompute is None:
            self.recompute = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvlink-recompute")
        self.recompute.submit(self._post_recompute, kv_receiver, url, payload)

    def _post_recompute(self, kv_receiver: Any, url: str, payload: dict[str, Any]) -> None:
        rid = payload.get("rid")
        req = urllib.request.Request(
            url, data=json.dumps(payload).encode(), method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.waiting_timeout) as r:
                r.read(1 << 20)
            return
        except urllib.error.HTTPError as e:
            why = f"the prefill's /generate answered {e.code} for retracted request {rid}"
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
            why = f"sending retracted request {rid} back to its prefill ({url}) failed: {e}"
        logger.error("kvlink: %s", why)
        self.recompute_failed.append((kv_receiver, why))

    def close(self) -> None:
        for pool in (self.recompute, self.lookup_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if self.metrics is not None:
            self.metrics.shutdown()
            self.metrics = None
        for e in self.engines:
            e.close()

    def teardown(self) -> None:
        self.close()


def _remember(d: OrderedDict[Any, Any], room: Any, value: Any) -> None:
    d[room] = value
    d.move_to_end(room)
    while len(d) > _REMEMBERED_ROOMS:
        d.popitem(last=False)
