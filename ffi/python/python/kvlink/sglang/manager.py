"""kvlink's SGLang backend, the per-rank part: ``KvlinkKVManager`` (its kvlink engines, one per
index space; the bootstrap registration and routes; the rooms in flight, and the messages and
completions that move them) and ``KvlinkTransferError``. The rooms themselves, ``KvlinkKVSender``
and ``KvlinkKVReceiver``, are in ``kvlink.sglang.conn``, whose docstring describes the flow.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional


import kvlink
from kvlink.sglang import bootstrap, wire
from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs
from sglang.srt.disaggregation.utils import DisaggregationMode

logger = logging.getLogger(__name__)

_REMEMBERED_ROOMS = 4096
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


def _env_seconds(name: str, default: float) -> float:
    try:
        from sglang.srt.environ import envs

        return float(getattr(envs, name).get())
    except Exception:  # noqa: BLE001 - older SGLang, or the variable unset
        return float(os.environ.get(name, default))


def _host() -> str:
    host = os.environ.get("KVLINK_HOST")
    if host:
        return host
    if os.environ.get("KVLINK_AUTH_KEY") or os.environ.get("KVLINK_AUTH_KEY_FILE"):
        try:
            from sglang.srt.utils.network import get_local_ip_auto

            return get_local_ip_auto()
        except Exception:  # noqa: BLE001
            pass
    return "127.0.0.1"


def _layout_tag(desc: str) -> str:
    """``desc`` as a kvlink layout tag (at most 32 bytes): itself when short enough, else a
    digest of it (DeepSeek-V4 names its main and compressed KV layouts, well over 32 bytes)."""
    if len(desc.encode()) <= 32:
        return desc
    return "sgl-" + hashlib.blake2b(desc.encode(), digest_size=14).hexdigest()


def _attn_tp() -> tuple:
    try:
        from sglang.srt.runtime_context import get_parallel

        g = get_parallel().attn_tp_group
        return int(g.rank_in_group), int(g.world_size)
    except Exception:  # noqa: BLE001 - no parallel context (a bare test): one rank
        return 0, 1


class KvlinkKVManager(BaseKVManager):
    """One per scheduler rank: kvlink engines for the KV pages, the aux rows and each state type,
    the rooms in flight, and the messages and completions that move them."""

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: Optional[bool] = False):
        self.kv_args = args
        self.mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.bootstrap_timeout = _env_seconds("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)
        self.waiting_timeout = _env_seconds("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300)
        _refuse_unsupported(server_args)
        # Both sides number ranks inside the attention-TP group (SGLang's prefill passes the
        # global TP rank as engine_rank, its decode the rank in the group).
        self.tp_rank, self.tp_size = _attn_tp()
        self.engine_rank = self.tp_rank
        self.page_size = int(args.page_size)
        # What prefill and decode must share (compared through the registry, in full), and the
        # engines' 32-byte tag of it.
        self.dtype = f"{args.kv_cache_dtype_str}/{getattr(args, 'kv_layout', None) or 'default'}/p{self.page_size}"
        self.tag = _layout_tag(self.dtype)
        host = _host()
        listen = f"[{host}]:0" if ":" in host else f"{host}:0"
        opts = dict(
            transport=os.environ.get("KVLINK_TRANSPORT", "auto"),
            tp_rank=self.engine_rank,
            tp_size=self.tp_size,
            request_timeout=float(os.environ.get("KVLINK_REQUEST_TIMEOUT", 60)),
            abort_timeout=float(os.environ.get("KVLINK_ABORT_TIMEOUT", 480)),
            lease=float(os.environ.get("KVLINK_LEASE", 30)),
            rdma_device=(getattr(args, "ib_device", None) or os.environ.get("KVLINK_RDMA_DEVICE")) or None,
        )
        # One engine per index space: block ids of one read index every tensor of its layout.
        self.kv = self._engine(listen, opts, args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens,
                               self.page_size, self.tag)
        aux_ptrs = list(getattr(args, "aux_data_ptrs", None) or [])
        self.aux = (self._engine(listen, opts, aux_ptrs, args.aux_data_lens, args.aux_item_lens, 1,
                                 "sglang-aux") if aux_ptrs else None)
        self.states: List[Optional[kvlink.Engine]] = []
        for i, ptrs in enumerate(getattr(args, "state_data_ptrs", None) or []):
            self.states.append(self._engine(listen, opts, ptrs, args.state_data_lens[i],
                                            args.state_item_lens[i], 1, f"sglang-state-{i}")
                               if ptrs else None)
        self.engines = [e for e in [self.kv, self.aux, *self.states] if e is not None]
        # request id -> the sender or receiver it belongs to
        self.owners: Dict[str, Any] = {}
        # decode: cancelled reads whose last writes may still land (request id -> engine)
        self.draining: Dict[str, kvlink.Engine] = {}
        self.senders: Dict[int, "KvlinkKVSender"] = {}
        self.receivers: Dict[int, "KvlinkKVReceiver"] = {}
        # prefill: wants that came before their sender; rooms a prefill sender gave up on before
        # any want (answered with an abort); attempts a decode aborted before its want came
        self.early_wants: "OrderedDict[int, tuple]" = OrderedDict()
        self.aborted: "OrderedDict[int, str]" = OrderedDict()
        self.withdrawn: "OrderedDict[tuple, str]" = OrderedDict()
        self.req_to_decode_prefix_len: Dict[int, int] = {}
        # decode: what SGLang's decode scheduler reads, and the routes it learned
        self.prefill_info_table: Dict[str, Any] = {}
        self.routes: Dict[tuple, Dict[str, Any]] = {}
        self.bad_messages = 0
        self.unsent_messages = 0
        # decode: retracted requests sent back to their prefill (``submit_prefill_recompute``),
        # and those whose /generate failed, applied on the scheduler thread
        self.recompute: Optional[ThreadPoolExecutor] = None
        self.recompute_failed: "deque[tuple]" = deque()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.register_to_bootstrap()
        logger.info("kvlink %s rank %d: KV engine %s at %s, %d index spaces (%s)", self.mode.value,
                    self.engine_rank, self.kv.engine_id, self.kv.handshake_address, len(self.engines),
                    "RDMA on " + self.kv.rdma_device if self.kv.rdma_device else
                    f"TCP; RDMA: {self.kv.rdma_unavailable_reason}")

    def _engine(self, listen: str, opts: Dict[str, Any], ptrs: List[int], lens: List[int],
                item_lens: List[int], tokens_per_block: int, dtype: str) -> kvlink.Engine:
        e = kvlink.Engine(listen, **opts)
        try:
            regions: Dict[int, int] = {}
            tensors = []
            for ptr, size, item in zip(ptrs, lens, item_lens):
                ptr, size, item = int(ptr), int(size), int(item)
                if item <= 0 or size < item:
                    raise kvlink.InvalidArgument(f"buffer at {ptr:#x}: {size} bytes of {item}-byte items")
                if ptr not in regions:
                    regions[ptr] = e.register_memory(ptr, size)
                tensors.append((regions[ptr], 0, item, item, size // item))
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
        entry = {"dp_rank": 0, "tp_rank": self.engine_rank, "tp_size": self.tp_size, "dp_size": 1,
                 "addr": self.kv.handshake_address, "engine_id": self.kv.engine_id,
                 "page_size": self.page_size, "dtype": self.dtype}
        http_port = getattr(sa, "port", None)
        if isinstance(http_port, int) and 0 < http_port < 65536:
            entry["http_port"] = http_port
        bootstrap.register(f"{host}:{port}", entry)

    # -- decode: where the prefill ranks are ---------------------------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: whether every prefill rank behind ``bootstrap_addr`` registered (SGLang asks
        before it initialises receivers, and gives up after some tries)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        info = bootstrap.get(bootstrap_addr, "/kvlink/info")
        if not info or info.get("complete") is not True:
            return False
        from types import SimpleNamespace

        try:
            self.prefill_info_table[bootstrap_addr] = SimpleNamespace(
                dp_size=int(info["dp_size"]), tp_size=int(info["tp_size"]), follow_bootstrap_room=True,
                page_size=info.get("page_size"), dtype=info.get("dtype"))
        except (KeyError, TypeError, ValueError):
            logger.warning("kvlink: the bootstrap server at %s answered %r", bootstrap_addr, info)
            return False
        return True

    def forget_route(self, bootstrap_addr: str) -> None:
        """Drops what was learned about a prefill (it may have restarted on other ports)."""
        self.prefill_info_table.pop(bootstrap_addr, None)
        for key in [k for k in self.routes if k[0] == bootstrap_addr]:
            del self.routes[key]

    def route(self, bootstrap_addr: str, dp_rank: int) -> Dict[str, Any]:
        """The prefill rank this decode rank reads from; raises ``KvlinkTransferError``-ready
        text (``ValueError``) when it is unknown or incompatible."""
        key = (bootstrap_addr, dp_rank, self.engine_rank)
        if key in self.routes:
            return self.routes[key]
        if not self.try_ensure_parallel_info(bootstrap_addr):
            raise ValueError(f"the prefill at {bootstrap_addr} has not registered all its ranks")
        info = self.prefill_info_table[bootstrap_addr]
        if info.tp_size != self.tp_size:
            raise ValueError(f"prefill attention TP {info.tp_size}, decode {self.tp_size}: kvlink pairs equal "
                             "TP sizes only (heterogeneous TP is not supported yet)")
        if info.dtype != self.dtype:
            raise ValueError(f"KV cache {info.dtype!r} on the prefill, {self.dtype!r} here")
        r = bootstrap.get(bootstrap_addr, f"/kvlink/route?dp_rank={dp_rank}&tp_rank={self.engine_rank}")
        if not r or not isinstance(r.get("addr"), str) or not isinstance(r.get("engine_id"), str):
            raise ValueError(f"prefill dp {dp_rank} tp {self.engine_rank} is not registered at {bootstrap_addr}")
        self.routes[key] = r
        return r

    # -- progress --------------------------------------------------------------------------

    def pump(self) -> None:
        """Takes every engine's finished transfers and the KV engine's messages, and hands each
        to its room. Called from every poll; never blocks."""
        while self.recompute_failed:
            receiver, why = self.recompute_failed.popleft()
            receiver._fail(why, tell_peer=True)
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

    def drain(self, rids: List[str]) -> None:
        """Waits until the cancelled reads ``rids`` were reported (their last write landed), at
        most ``_DRAIN_S``: SGLang reuses a failed request's pages right after ``clear()``."""
        end = time.monotonic() + _DRAIN_S
        while any(r in self.draining for r in rids):
            left = end - time.monotonic()
            if left <= 0:
                logger.error("kvlink: cancelled reads %s not reported within %.0f s; their pages may "
                             "still be written", [r for r in rids if r in self.draining], _DRAIN_S)
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
                logger.warning("kvlink: could not send a message to %s (%d so far): %s", peer,
                               self.unsent_messages, e)
            return False

    def _bad(self, sender_id: str, why: str) -> None:
        self.bad_messages += 1
        if self.bad_messages <= 10 or self.bad_messages % 1000 == 0:
            logger.warning("kvlink: dropped a malformed message from engine %s (%d so far): %s",
                           sender_id, self.bad_messages, why)

    def _dispatch(self, sender_id: str, m: Dict[str, Any]) -> None:
        room, kind, nonce = m["room"], m["t"], m["nonce"]
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
                    _remember(self.early_wants, room, (m, sender_id))
            elif kind == "abort" and nonce is not None:
                if sender is not None and sender.want is not None and sender.want["nonce"] == nonce:
                    sender._on_peer_abort(m["reason"], sender_id)
                elif sender is None or sender.want is None:
                    # An attempt withdrawn before its want got here: its want will be ignored.
                    _remember(self.withdrawn, (room, nonce), m["reason"])
                    early = self.early_wants.get(room)
                    if early is not None and early[0]["nonce"] == nonce:
                        del self.early_wants[room]
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

    def submit_prefill_recompute(self, kv_receiver: Any, payload: Dict[str, Any]) -> None:
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
            kv_receiver._fail("the retracted request cannot go back to its prefill: it registered no HTTP "
                              "port with the bootstrap server", tell_peer=True)
            return
        host = kv_receiver.bootstrap_addr.rsplit(":", 1)[0]
        url = f"http://{host}:{port}/generate"
        if self.recompute is None:
            self.recompute = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvlink-recompute")
        self.recompute.submit(self._post_recompute, kv_receiver, url, payload)

    def _post_recompute(self, kv_receiver: Any, url: str, payload: Dict[str, Any]) -> None:
        rid = payload.get("rid")
        req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
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
        if self.recompute is not None:
            self.recompute.shutdown(wait=False, cancel_futures=True)
        for e in self.engines:
            e.close()

    def teardown(self) -> None:
        self.close()


def _refuse_unsupported(sa: Any) -> None:
    """Configurations this backend does not implement yet fail at start, saying which."""
    why = []
    for attr, ok, what in (("pp_size", 1, "pipeline parallelism"), ("attn_cp_size", 1, "attention context parallelism"),
                           ("attn_dp_size", 1, "DP attention"), ("dp_size", 1, "data parallelism")):
        v = getattr(sa, attr, ok)
        if isinstance(v, int) and v > ok:
            why.append(f"{what} ({attr}={v})")
    if getattr(sa, "disaggregation_decode_allocation_policy", "early") not in ("early", None):
        why.append("the prefill_complete decode allocation policy")
    if getattr(sa, "enable_memory_saver", False) is True:
        why.append("the memory saver (KV memory released and remapped)")
    for env in ("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "SGLANG_DISAGG_STAGING_BUFFER"):
        if os.environ.get(env, "").lower() in ("1", "true", "yes"):
            why.append(env)
    if why:
        raise ValueError("the kvlink transfer backend does not support " + ", ".join(why) + " yet")


def _remember(d: "OrderedDict[Any, Any]", room: Any, value: Any) -> None:
    d[room] = value
    d.move_to_end(room)
    while len(d) > _REMEMBERED_ROOMS:
        d.popitem(last=False)
