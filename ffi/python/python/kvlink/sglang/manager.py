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
from kvlink.sglang import bootstrap, nic, wire
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


def _gpu_pci(gpu_id: Optional[int]) -> Optional[str]:
    """The PCI address of CUDA device ``gpu_id`` (``0000:3b:00.0``), when there is one."""
    if gpu_id is None:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        p = torch.cuda.get_device_properties(int(gpu_id))
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except Exception:  # noqa: BLE001 - no CUDA, or a torch without PCI ids
        return None


def _layout_tag(desc: str) -> str:
    """``desc`` as a kvlink layout tag (at most 32 bytes): itself when short enough, else a
    digest of it (DeepSeek-V4 names its main and compressed KV layouts, well over 32 bytes)."""
    if len(desc.encode()) <= 32:
        return desc
    return "sgl-" + hashlib.blake2b(desc.encode(), digest_size=14).hexdigest()


_PARALLEL_FIELDS = ("attn_tp_rank", "attn_tp_size", "attn_dp_rank", "attn_dp_size", "attn_cp_size",
                    "pp_size", "dp_size")


def _parallel() -> Dict[str, Any]:
    """This rank's place as SGLang resolved it (``get_parallel()``: attention TP, DP and CP, PP,
    system DP), never guessed from raw arguments: ``--dwdp-size`` and context parallelism change
    them after parsing. A value SGLang has not published is an error at start."""
    from sglang.srt.runtime_context import get_parallel

    p, out = get_parallel(), {}
    for name in _PARALLEL_FIELDS:
        try:
            v = getattr(p, name)
        except Exception as e:  # noqa: BLE001 - SGLang raises several kinds for "not published"
            raise ValueError(f"kvlink: SGLang's parallel context has no {name}: {e}") from None
        if type(v) is not int or v < 0:
            raise ValueError(f"kvlink: SGLang's parallel context has {name}={v!r}")
        out[name] = v
    for name, default in (("load_balance_method", "follow_bootstrap_room"), ("enable_kv_cache_sharding", False)):
        try:
            out[name] = getattr(p, name)
        except Exception:  # noqa: BLE001 - an SGLang without the option
            out[name] = default
    return out


def _dp_group(par: Dict[str, Any], args: KVArgs) -> tuple:
    """``(rank, count)`` of the prefill group a room is routed to, as SGLang's bootstrap keys
    it: the attention-DP rank, or with system DP (``--dp-size`` without DP attention) the
    replica's rank."""
    if par["dp_size"] > 1:
        return int(getattr(args, "system_dp_rank", 0) or 0), par["dp_size"]
    return par["attn_dp_rank"], par["attn_dp_size"]


def _mha_layout() -> str:
    """How SGLang's MHA pool lays out a page, chosen as its ``MHATokenToKVPool`` chooses:
    ``hnd`` (head-major, SGLANG_USE_HND_KVCACHE), AITER's ``vectorized_5d`` (head-major) or
    ``nhd`` (token-major, the default)."""
    from sglang.srt.environ import envs

    if envs.SGLANG_USE_HND_KVCACHE.get():
        return "hnd"
    try:
        from sglang.srt.mem_cache import memory_pool

        if getattr(memory_pool, "_use_aiter", False):
            return envs.SGLANG_AITER_KV_CACHE_LAYOUT.get().lower()
    except Exception:  # noqa: BLE001 - no AITER setting in this SGLang
        pass
    return "nhd"


def _kv_heads(args: KVArgs, server_args: Any, attn_tp_size: int, is_mla: bool) -> Optional[tuple]:
    """``(total, local)`` KV heads when TP splits the KV pages by head (not MLA), from the
    model's configuration as SGLang's pools size themselves (both sides the same way: a pair
    declares heads on both engines or on neither); ``None`` when it cannot be told, and then
    prefill and decode must have the same attention TP size."""
    if is_mla:
        return None
    try:
        from sglang.srt.configs.model_config import ModelConfig

        mc = ModelConfig.from_server_args(server_args)
        total, local = int(mc.get_total_num_kv_heads()), int(mc.get_num_kv_heads(attn_tp_size))
    except Exception as e:  # noqa: BLE001 - no model configuration to read
        logger.info("kvlink: KV heads unknown (%s): prefill and decode need the same attention TP size", e)
        return None
    given = (getattr(args, "total_kv_head_num", None), getattr(args, "kv_head_num", None))
    if all(isinstance(x, int) for x in given) and given != (total, local):
        raise ValueError(f"kvlink: SGLang's pool holds {given[1]} of {given[0]} KV heads, the model "
                         f"configuration says {local} of {total}")
    if total <= 0 or local <= 0:
        return None
    return total, local


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
        par = _parallel()
        _refuse_unsupported(server_args, par, disaggregation_mode)
        # Both sides number ranks inside the attention-TP group (SGLang's prefill passes the
        # global TP rank as engine_rank, its decode the rank in the group).
        self.tp_rank, self.tp_size = par["attn_tp_rank"], par["attn_tp_size"]
        self.engine_rank = self.tp_rank
        self.dp_rank, self.dp_size = _dp_group(par, args)
        self.page_size = int(args.page_size)
        self.heads = _kv_heads(args, server_args, self.tp_size, self.is_mla_backend)
        # What prefill and decode must share (compared through the registry, in full), and the
        # engines' 32-byte tag of it. A KV layout SGLang names (DeepSeek-V4's) or, for MHA
        # pools, how a page orders tokens and heads.
        layout = getattr(args, "kv_layout", None) or ("mla" if self.is_mla_backend else _mha_layout())
        self.dtype = f"{args.kv_cache_dtype_str}/{layout}/p{self.page_size}"
        self.tag = _layout_tag(self.dtype)
        # A page repeats the local heads once per token (token-major) or holds each head's
        # tokens together (head-major).
        runs = self.page_size if layout == "nhd" else 1
        kv_heads = (self.heads[0], self.heads[1], runs) if self.heads and layout in ("nhd", "hnd") else None
        host = _host()
        listen = f"[{host}]:0" if ":" in host else f"{host}:0"
        opts = dict(
            transport=os.environ.get("KVLINK_TRANSPORT", "auto"),
            request_timeout=float(os.environ.get("KVLINK_REQUEST_TIMEOUT", 60)),
            abort_timeout=float(os.environ.get("KVLINK_ABORT_TIMEOUT", 480)),
            lease=float(os.environ.get("KVLINK_LEASE", 30)),
            rdma_device=nic.choose(os.environ.get("KVLINK_RDMA_DEVICE"), getattr(args, "ib_device", None),
                                   getattr(args, "gpu_id", None), _gpu_pci(getattr(args, "gpu_id", None))),
        )
        # One engine per index space: block ids of one read index every tensor of its layout.
        # The KV engine is this rank of the attention-TP group (it reads head slices of
        # prefill ranks of another TP size); the aux and state engines pair one prefill rank
        # with one decode rank, whole rows.
        self.kv = self._engine(listen, dict(opts, tp_rank=self.tp_rank, tp_size=self.tp_size), args.kv_data_ptrs,
                               args.kv_data_lens, args.kv_item_lens, self.page_size, self.tag, kv_heads)
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
                item_lens: List[int], tokens_per_block: int, dtype: str,
                heads: Optional[tuple] = None) -> kvlink.Engine:
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
                tensors.append((regions[ptr], 0, item, item, size // item, 0, heads))
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
        entry = {"dp_rank": self.dp_rank, "tp_rank": self.engine_rank, "tp_size": self.tp_size,
                 "dp_size": self.dp_size, "addr": self.kv.handshake_address, "engine_id": self.kv.engine_id,
                 "page_size": self.page_size, "dtype": self.dtype, "heads": self.heads is not None}
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
                page_size=info.get("page_size"), dtype=info.get("dtype"), heads=info.get("heads") is True)
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
        if not 0 <= dp_rank < info.dp_size:
            raise ValueError(f"prefill DP rank {dp_rank}: the prefill at {bootstrap_addr} has {info.dp_size}")
        p, d = info.tp_size, self.tp_size
        try:
            sources = kvlink.tp_sources(self.tp_rank, d, p)
        except kvlink.InvalidArgument as e:
            raise ValueError(f"prefill attention TP {p}, decode {d}: {e}") from None
        if p != d:
            if not self.is_mla_backend and not (self.heads and info.heads):
                raise ValueError(f"prefill attention TP {p}, decode {d}: the KV heads of this model are not "
                                 "known on both sides (its configuration could not be read), so pages cannot "
                                 "be split by head")
            if any(e is not None for e in self.states):
                raise ValueError(f"prefill attention TP {p}, decode {d}: kvlink moves state types (mamba, "
                                 "sliding window, ...) only between equal attention TP sizes")
        g = bootstrap.get(bootstrap_addr, f"/kvlink/group?dp_rank={dp_rank}")
        ranks = g.get("ranks") if g else None
        if (not isinstance(ranks, list) or len(ranks) != p
                or not all(isinstance(r, dict) and isinstance(r.get("addr"), str)
                           and isinstance(r.get("engine_id"), str) for r in ranks)):
            raise ValueError(f"prefill DP group {dp_rank} is not registered at {bootstrap_addr}")
        r = {"addrs": [x["addr"] for x in ranks], "engine_ids": [x["engine_id"] for x in ranks],
             "sources": list(sources), "http_port": ranks[0].get("http_port")}
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


def _refuse_unsupported(sa: Any, par: Dict[str, Any], mode: DisaggregationMode) -> None:
    """Configurations this backend does not implement fail at start, saying which (from the
    parallel sizes SGLang resolved, ``par``)."""
    why = []
    for attr, what in (("pp_size", "pipeline parallelism"), ("attn_cp_size", "attention context parallelism")):
        if par[attr] > 1:
            why.append(f"{what} ({attr}={par[attr]})")
    if par["enable_kv_cache_sharding"] is True:
        why.append("KV cache sharding across attention TP")
    dp = par["dp_size"] if par["dp_size"] > 1 else par["attn_dp_size"]
    if (mode == DisaggregationMode.PREFILL and dp > 1
            and par["load_balance_method"] not in ("follow_bootstrap_room", "auto")):
        why.append(f"the {par['load_balance_method']} load balance method with {dp} DP ranks (a decode finds "
                   "the prefill DP rank of a room as room % DP size: follow_bootstrap_room)")
    if getattr(sa, "disaggregation_decode_allocation_policy", "early") not in ("early", None):
        why.append("the prefill_complete decode allocation policy")
    if getattr(sa, "enable_memory_saver", False) is True:
        why.append("the memory saver (KV memory released and remapped)")
    for env in ("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "SGLANG_DISAGG_STAGING_BUFFER"):
        if os.environ.get(env, "").lower() in ("1", "true", "yes"):
            why.append(env)
    if why:
        raise ValueError("the kvlink transfer backend does not support " + ", ".join(why))


def _remember(d: "OrderedDict[Any, Any]", room: Any, value: Any) -> None:
    d[room] = value
    d.move_to_end(room)
    while len(d) > _REMEMBERED_ROOMS:
        d.popitem(last=False)
