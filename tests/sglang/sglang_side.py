"""One rank of one side of an SGLang prefill/decode pair, on CPU, run as its own process:
SGLang's real queues (``PrefillBootstrapQueue``, the prefill mixin's ``send_kv_chunk`` and
inflight queue; ``DecodePreallocQueue``, ``DecodeTransferQueue``), its KV pool and page
allocator (sized by SGLang's ``ModelConfig`` from a real model's ``config.json`` in
tests/vllm/models, cut to 4 layers: Llama 3.1 8B's ``MHATokenToKVPool`` with 8 KV heads of 128,
DeepSeek-V2-Lite's ``MLATokenToKVPool``, gpt-oss-20b's hybrid ``SWAKVPool`` with its SWA
allocator; for Qwen3-Coder-Next and Nemotron-H, SGLang's request pool with its ``MambaPool``
and a ``HybridLinearKVPool`` of the attention layers: ``mamba_side``; DeepSeek-V4 Flash's pool
as SGLang's configurator builds it, with 256-token pages: ``dsv4_side``), metadata buffers, with
kvlink's backend loaded through SGLang's own plugin loader. Parallel sizes are SGLang's own (``ServerArgs`` with ``tp_size``, ``dp_size``,
``enable_dp_attention``, published with ``publish``; gloo groups for its all-reduces). Only the
model's forward and the scheduler loop are stand-ins: the prefill writes each token's K and V as
a function of (room, position, layer, global head, dim) and its first output token as a function
of the room; each decode rank checks every byte of its own heads.

Usage: ``python sglang_side.py prefill|decode PLAN_JSON [RANK]``; prints one JSON line per
request outcome, then ``{"summary": ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
from array import array
from types import SimpleNamespace as NS
from typing import Any, Dict, List

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dsv4_side  # noqa: E402
import mamba_side  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ports import free_port  # noqa: E402

PAGE = 16
POOL_TOKENS = 8192
MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm", "models")


class Shape:
    """This rank's KV heads (or MLA latent), from SGLang's ModelConfig as its pools are sized."""

    def __init__(self, model: str, attn_tp_rank: int, attn_tp_size: int):
        from sglang.srt.configs.model_config import AttentionArch, ModelConfig
        from sglang.srt.server_args import ServerArgs

        self.config = ModelConfig.from_server_args(ServerArgs(model_path=model, device="cpu"))
        self.layers = self.config.num_hidden_layers
        self.mla = self.config.attention_arch == AttentionArch.MLA
        # DeepSeek-V4: SGLang's compressed-attention pools (dsv4_side), checked row by row.
        self.dsv4 = dsv4_side.is_dsv4(self.config)
        if self.mla:
            self.latent = (self.config.kv_lora_rank, self.config.qk_rope_head_dim)
        # Hybrid sliding-window models (gpt-oss): SGLang's SWAKVPool, the window's pages moved
        # as SGLang's SWA state.
        self.swa = bool(getattr(self.config, "is_hybrid_swa", False))
        self.window = self.config.sliding_window_size if self.swa else None
        # Hybrid linear-attention models (gated delta net): SGLang's mamba state pool beside a
        # KV pool of the full-attention layers only (mamba_side).
        self.rank, self.tp = attn_tp_rank, attn_tp_size
        self.mamba = mamba_side.cache_params(self.config)
        self.conv_blocks = mamba_side.conv_blocks(self.config) if self.mamba is not None else None
        self.attn_layers = [i for i in range(self.layers) if self.mamba is None or i not in self.mamba.layers]
        self.total = self.config.get_total_num_kv_heads()
        self.heads = self.config.get_num_kv_heads(attn_tp_size)
        self.head_dim = self.config.head_dim
        # The global heads this rank holds (replicated when TP outnumbers the heads).
        self.first = attn_tp_rank * self.total // attn_tp_size if attn_tp_size <= self.total else \
            attn_tp_rank // (attn_tp_size // self.total)


def expected_k(shape: Shape, room: int, positions: torch.Tensor, layer: int) -> torch.Tensor:
    base = (room % 97) * 13 + positions.to(torch.int64) * 7 + layer * 5
    heads = torch.arange(shape.first, shape.first + shape.heads, dtype=torch.int64)
    hd = heads[:, None] * shape.head_dim + torch.arange(shape.head_dim, dtype=torch.int64)[None]
    return ((base[:, None, None] + hd[None]) % 2000).to(torch.float16)


def expected_v(shape: Shape, room: int, positions: torch.Tensor, layer: int) -> torch.Tensor:
    return -expected_k(shape, room, positions, layer) - 1


def expected_latent(shape: Shape, room: int, positions: torch.Tensor, layer: int) -> torch.Tensor:
    base = (room % 89) * 11 + positions.to(torch.int64) * 3 + layer * 7
    dims = torch.arange(sum(shape.latent), dtype=torch.int64)
    return ((base[:, None, None] + dims[None, None]) % 1900).to(torch.float16)


def sub_pool(pool, alloc, shape: Shape, layer: int, loc: torch.Tensor):
    """The pool, its layer index and the slots of ``loc`` (full-pool slots) for model layer
    ``layer``: a hybrid pool keeps sliding-window layers in its SWA pool."""
    if not shape.swa:
        return pool, layer, loc
    idx, is_swa = pool.layers_mapping[layer]
    if is_swa:
        return pool.swa_kv_pool, idx, alloc.translate_loc_from_full_to_swa(loc)
    return pool.full_kv_pool, idx, loc


def write_kv(pool, alloc, shape: Shape, room: int, loc: torch.Tensor, positions: torch.Tensor) -> None:
    """The stand-in forward: every layer's KV of these tokens, as a function of the room."""
    for i, layer in enumerate(shape.attn_layers):
        if shape.mamba is not None:
            pool.full_kv_pool.k_buffer[i][loc] = expected_k(shape, room, positions, layer)
            pool.full_kv_pool.v_buffer[i][loc] = expected_v(shape, room, positions, layer)
        elif shape.swa:
            sub, idx, slots = sub_pool(pool, alloc, shape, layer, loc)
            sub.k_buffer[idx][slots] = expected_k(shape, room, positions, layer)
            sub.v_buffer[idx][slots] = expected_v(shape, room, positions, layer)
        elif shape.mla:
            pool.kv_buffer[layer][loc] = expected_latent(shape, room, positions, layer)
        else:
            pool.k_buffer[layer][loc] = expected_k(shape, room, positions, layer)
            pool.v_buffer[layer][loc] = expected_v(shape, room, positions, layer)


def wrong_kv(pool, alloc, shape: Shape, room: int, slots: torch.Tensor, positions: torch.Tensor) -> List[str]:
    """The layers whose KV in ``slots`` is not what the prefill wrote (for sliding-window
    layers, within the window SGLang moves: from the page holding the window's first token)."""
    bad = []
    for i, layer in enumerate(shape.attn_layers):
        if shape.mamba is not None:
            kv = pool.full_kv_pool
            if not (torch.equal(kv.k_buffer[i][slots], expected_k(shape, room, positions, layer))
                    and torch.equal(kv.v_buffer[i][slots], expected_v(shape, room, positions, layer))):
                bad.append(f"full layer {layer}")
            continue
        if shape.swa:
            sub, idx, mine = sub_pool(pool, alloc, shape, layer, slots)
            if pool.layers_mapping[layer][1]:
                start = max(0, len(positions) - shape.window) // PAGE * PAGE
                mine, pos = mine[start:], positions[start:]
            else:
                pos = positions
            if not (torch.equal(sub.k_buffer[idx][mine], expected_k(shape, room, pos, layer))
                    and torch.equal(sub.v_buffer[idx][mine], expected_v(shape, room, pos, layer))):
                bad.append(f"{'SWA' if pool.layers_mapping[layer][1] else 'full'} layer {layer}")
            continue
        if shape.mla:
            if not torch.equal(pool.kv_buffer[layer][slots], expected_latent(shape, room, positions, layer)):
                bad.append(f"latent layer {layer}")
            continue
        if not torch.equal(pool.k_buffer[layer][slots], expected_k(shape, room, positions, layer)):
            bad.append(f"K layer {layer}")
        if not torch.equal(pool.v_buffer[layer][slots], expected_v(shape, room, positions, layer)):
            bad.append(f"V layer {layer}")
    return bad


def first_token(room: int) -> int:
    return 1000 + room % 1000


def setup(role: str, plan: Dict[str, Any], rank: int, http_port: int = 30000):
    """SGLang's server arguments and parallel context for rank ``rank`` of this side (the plan's
    ``tp`` ranks, ``dp`` of them DP attention ranks), its gloo groups, and its KV shape."""
    from sglang.srt.plugins import load_plugins

    # What every SGLang process does first: the kvlink entry point registers the backend.
    load_plugins()
    from sglang.srt.runtime_context import SpawnRanks, get_parallel
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish

    global PAGE
    # SGLang pages DeepSeek-V4's sliding window by 256 tokens (it refuses any other size).
    PAGE = dsv4_side.PAGE if plan.get("model") in dsv4_side.MODELS else 16
    side = plan.get(role, {})
    tp, dp = side.get("tp", 1), side.get("dp", 1)
    model = os.path.join(MODELS, plan.get("model", "llama-3.1-8b"))
    sa = ServerArgs(model_path=model, disaggregation_mode=role, disaggregation_transfer_backend="kvlink",
                    disaggregation_bootstrap_port=plan["bootstrap_port"], device="cpu", page_size=PAGE,
                    port=http_port, tp_size=tp, dp_size=dp, enable_dp_attention=dp > 1,
                    # No radix tree on these stand-ins (a hybrid model's would need mamba state
                    # snapshots, which the CPU platform does not support).
                    disable_radix_cache=True)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    par = get_parallel()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(plan["master_ports"][role])
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    # Every rank builds every group, in the same order (torch.distributed's rule).
    singles = [dist.new_group([r], backend="gloo") for r in range(tp)]
    attn = [dist.new_group(list(range(d * par.attn_tp_size, (d + 1) * par.attn_tp_size)), backend="gloo")
            for d in range(tp // par.attn_tp_size)]
    group = attn[rank // par.attn_tp_size]
    par.override_permanently(attn_tp_group=NS(cpu_group=group, rank_in_group=par.attn_tp_rank,
                                              world_size=par.attn_tp_size), dp_rank=0)
    return sa, group, singles[rank], Shape(model, par.attn_tp_rank, par.attn_tp_size), par.attn_dp_rank, dp


def mine(spec: Dict[str, Any], role: str, dp_rank: int, dp: int) -> bool:
    """Whether a request is this DP rank's: the prefill's by its room (SGLang's
    follow_bootstrap_room), the decode's by another rule, so rooms cross DP ranks."""
    if dp == 1:
        return True
    return (spec["room"] if role == "prefill" else spec["room"] // 7) % dp == dp_rank


def kv_pool(shape: Shape):
    """SGLang's pool for the model and the allocator over it."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    if shape.swa:
        c = shape.config
        pool = SWAKVPool(size=POOL_TOKENS, size_swa=POOL_TOKENS, page_size=PAGE, dtype=torch.float16,
                         head_num=shape.heads, head_dim=shape.head_dim,
                         swa_attention_layer_ids=list(c.swa_attention_layer_ids),
                         full_attention_layer_ids=list(c.full_attention_layer_ids), device="cpu",
                         enable_memory_saver=False, enable_alt_stream=False)
        return pool, SWATokenToKVPoolAllocator(POOL_TOKENS, POOL_TOKENS, PAGE, torch.float16, "cpu", pool,
                                               need_sort=False)
    pool = _single_pool(shape)
    return pool, PagedTokenToKVPoolAllocator(POOL_TOKENS, PAGE, torch.float16, "cpu", pool, need_sort=False)


def alloc_pages(alloc, shape: Shape, n: int) -> torch.Tensor:
    """``n`` page-aligned token slots of a new request, as SGLang's scheduler allocates them
    (the hybrid allocator only by extend: full and SWA slots together, mapped)."""
    if not shape.swa:
        return alloc.alloc(n)
    zero, seq = torch.tensor([0]), torch.tensor([n])
    return alloc.alloc_extend(zero, zero, seq, seq, torch.tensor([-1], dtype=torch.int64), n)


def _single_pool(shape: Shape):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if shape.mla:
        return MLATokenToKVPool(size=POOL_TOKENS, page_size=PAGE, dtype=torch.float16, kv_lora_rank=shape.latent[0],
                                qk_rope_head_dim=shape.latent[1], layer_num=shape.layers, device="cpu",
                                enable_memory_saver=False, start_layer=0, end_layer=shape.layers)
    return MHATokenToKVPool(size=POOL_TOKENS, page_size=PAGE, dtype=torch.float16, head_num=shape.heads,
                            head_dim=shape.head_dim, layer_num=shape.layers, device="cpu",
                            enable_memory_saver=False, start_layer=0, end_layer=shape.layers,
                            enable_alt_stream=False)


def make_req(rid: str, n: int, room: int, port: int):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", range(1, n + 1)),
               sampling_params=SamplingParams(max_new_tokens=8), bootstrap_host="127.0.0.1",
               bootstrap_port=port, bootstrap_room=room)


class Outputs:
    """The scheduler's output streamer: records each request's end and its reason."""

    def __init__(self):
        self.ends: Dict[str, str] = {}

    def stream_output(self, reqs, return_logprob, *args):
        for r in reqs:
            if r.finished_reason is not None and r.rid not in self.ends:
                self.ends[r.rid] = getattr(r.finished_reason, "message", type(r.finished_reason).__name__)


def recompute_server(port: int, specs: Dict[str, Dict[str, Any]]):
    """POST /generate on ``port``: a retracted request's body is queued for the prefill's loop
    (``posted``), or refused with 500 when its spec says ``recompute_fails``."""
    import queue as q
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    posted: "q.Queue[Dict[str, Any]]" = q.Queue()
    refused: set = set()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            server.count += 1
            spec = specs.get(body.get("rid"), {})
            code = 500 if spec.get("recompute_fails") else 200
            if code == 200:
                posted.put(body)
            else:
                refused.add(body.get("rid"))
            data = b"{}"
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.count, server.posted, server.refused = 0, posted, refused
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def emit(d: Dict[str, Any]) -> None:
    print(json.dumps(d), flush=True)


def run_prefill(plan: Dict[str, Any], rank: int) -> None:
    from sglang.srt.disaggregation import prefill as P
    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    port = plan["bootstrap_port"]
    # The prefill's HTTP API, as far as a retracted request needs it: POST /generate takes the
    # request back (the backend registers this port with the bootstrap server).
    generate = recompute_server(free_port(), {s["rid"]: s for s in plan["requests"]})
    sa, group, single, shape, dp_rank, dp = setup("prefill", plan, rank, generate.server_address[1])
    requests = [s for s in plan["requests"] if mine(s, "prefill", dp_rank, dp)]
    from sglang.srt.disaggregation.utils import get_kv_class, KVClassType

    backend = TransferBackend(sa.disaggregation_transfer_backend)
    # SGLang starts the bootstrap server beside its first node's tokenizer manager: once.
    server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port) if rank == 0 else None
    # No radix tree on this stand-in: releasing a finished request's pages is the scheduler's.
    P.release_kv_cache = lambda req, tree_cache, checkpoint=False: None
    P.checkpoint_kv_cache = lambda req, cache: None
    if shape.mamba is not None:
        r2t = mamba_side.req_pool(shape, "prefill")
        pool, alloc = mamba_side.kv_pool(shape, r2t, POOL_TOKENS, PAGE)
    elif shape.dsv4:
        r2t = ReqToTokenPool(size=32, max_context_len=1024, device="cpu", enable_memory_saver=False)
        pool, alloc = dsv4_side.kv_pool(shape.config, r2t, "prefill")
    else:
        pool, alloc = kv_pool(shape)
        r2t = ReqToTokenPool(size=32, max_context_len=1024, device="cpu", enable_memory_saver=False)
    out = Outputs()

    class Scheduler(P.SchedulerDisaggregationPrefillMixin):
        pass

    s = Scheduler()
    s.__dict__.update(
        tp_worker=NS(model_runner=NS(effective_logical_max_total_num_tokens=POOL_TOKENS, kv_cache_dtype_str="auto")),
        kv_shard_widening=1, token_to_kv_pool_allocator=alloc, rust_server=None, model_config=shape.config,
        sliding_window_size=shape.window,
        server_args=sa, req_to_token_pool=r2t, attn_cp_cpu_group=single, attn_tp_cpu_group=group, pp_group=None,
        processed_tokens_counter=0, tree_cache=NS(finish=lambda *a: None), output_streamer=out,
        metrics_reporter=NS(enable_metrics=False), scheduler_stage_metrics=None, enable_staging=False,
        enable_overlap=False, kv_checksum_computer=None, disagg_prefill_inflight_queue=[],
        disagg_prefill_pending_chunk_rids=set(), waiting_queue=[],
        retire_unadmitted_request=lambda r: None, _release_aborted_request=lambda r: None,
    )
    meta = MetadataBuffers(32, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=16)
    idx = ReqToMetadataIdxAllocator(32)
    s.req_to_metadata_buffer_idx_allocator, s.disagg_metadata_buffers = idx, meta
    s.disagg_prefill_bootstrap_queue = queue = P.PrefillBootstrapQueue(
        token_to_kv_pool=pool, draft_token_to_kv_pool=None, req_to_metadata_buffer_idx_allocator=idx,
        metadata_buffers=meta, gpu_id=0, bootstrap_port=port, max_total_num_tokens=POOL_TOKENS, scheduler=s,
        scheduler_stage_metrics=None, transfer_backend=backend)
    mgr = queue.kv_manager
    space = dsv4_side.regions(mgr.kv_args) if shape.dsv4 else None
    emit({"ready": True, "backend": type(mgr).__name__})

    def add(r, spec):
        queue.add(r, shape.total)
        if space is not None:
            dsv4_side.forward_on_send(r.disagg_kv_sender, r.bootstrap_room, space)

    reqs = {}
    for spec in requests:
        if spec.get("rebootstrap"):
            continue  # comes back through POST /generate
        r = make_req(spec["rid"], spec["n"], spec["room"], port)
        reqs[spec["rid"]] = (r, spec)
        add(r, spec)
    computing: List[Any] = []  # (req, spec, next position)
    ended: Dict[str, str] = {}
    aborted = set()
    deadline = time.monotonic() + plan.get("deadline", 60)
    while len(ended) < len(requests) and time.monotonic() < deadline:
        while not generate.posted.empty():
            body = generate.posted.get()
            spec = next(s for s in requests if s["rid"] == body["rid"])
            r = make_req(spec["rid"], spec["n"], int(body["bootstrap_room"]), port)
            reqs[spec["rid"]] = (r, spec)
            add(r, spec)
        for spec in requests:
            if spec.get("recompute_fails") and spec["rid"] in generate.refused:
                ended.setdefault(spec["rid"], "refused")
        for rid, (r, spec) in reqs.items():
            if spec.get("abort_before_want") and rid not in aborted:
                # Aborted before any decode asked (the decode adds the request later).
                aborted.add(rid)
                r.disagg_kv_sender.abort()
            # The scheduler's abort of a request still in the bootstrap queue, once its decode asked.
            # (Polled here first, so the abort lands before pop_bootstrapped can take the request.)
            if (spec.get("abort_in_bootstrap") and rid not in aborted
                    and r.disagg_kv_sender.poll() is not None and r.disagg_kv_sender.want is not None):
                aborted.add(rid)
                r.disagg_kv_sender.abort()
        for r in queue.pop_bootstrapped():
            spec = reqs[r.rid][1]
            r2t.alloc([r])
            n = spec["n"]
            n_alloc = (n + PAGE - 1) // PAGE * PAGE
            loc = alloc_pages(alloc, shape, n_alloc)
            r2t.write((r.kv.req_pool_idx, slice(0, n_alloc)), loc.to(torch.int32))
            if not shape.dsv4:
                write_kv(pool, alloc, shape, spec["room"], loc[:n], torch.arange(n))
            if shape.mamba is not None:
                mamba_side.write_state(r2t, shape, spec["room"], n, r)
            r.kv.kv_allocated_len = n_alloc
            spec["_pages"] = [int(x) // PAGE for x in loc[0:n_alloc:PAGE]]
            computing.append([r, spec, 0])
        for item in list(computing):
            r, spec, pos = item
            n, step = spec["n"], spec.get("chunk", 64)
            if pos + step < n:
                # A non-last chunk of chunked prefill: process_prefill_chunk -> send_kv_chunk.
                item[2] = pos + step
                r.extend_end = pos + step
                s.send_kv_chunk(r)
                if spec.get("rehold_after_first_chunk") and pos == 0:
                    # The first chunk's hold ends and its id is held again over the same pages
                    # (a new hold, a new token), before the decode reads what the chunk message
                    # announced: that read's bytes arrive, but only the old hold could confirm
                    # it.
                    sender = r.disagg_kv_sender
                    (cid,) = [k for k in sender.out if k.endswith(".c0")]
                    assert mgr.kv.release(cid)
                    mgr.kv.hold_blocks(cid, spec["_pages"][: step // PAGE], reader=next(iter(sender.wants)))
                    emit({"reheld": cid})
                if spec.get("die_after_first_chunk"):
                    emit({"dying": r.rid})
                    os._exit(3)
                if spec.get("abort_after_first_chunk_sent") and pos == 0:
                    # The scheduler aborts a request whose first chunk the decode was told of
                    # (and may be reading): the holds end, and the decode fails the room.
                    r.disagg_kv_sender.abort()
            else:
                # The last chunk: process_batch_result_disagg_prefill.
                computing.remove(item)
                r.extend_end = n
                r.output_ids.append(first_token(spec["room"]))
                r.hidden_states_tensor = None
                s.disagg_prefill_inflight_queue.append(r)
                if not r.pending_bootstrap:
                    s.send_kv_chunk(r, last_chunk=True)
        for r in s.process_disagg_prefill_inflight_queue():
            why = getattr(r.finished_reason, "message", None) if r.finished_reason is not None else None
            ended.setdefault(r.rid, why or "ok")
        for rid, why in out.ends.items():
            ended.setdefault(rid, why)
        time.sleep(0.002)
    for spec in requests:
        end = ended.get(spec["rid"])
        if end is None:
            # Where an unfinished request stands, for the test's failure message.
            r = reqs.get(spec["rid"], (None,))[0]
            sender = getattr(r, "disagg_kv_sender", None) if r is not None else None
            end = "unfinished: " + ("never added" if r is None else repr({
                k: getattr(sender, k, None) for k in ("outcome", "reason", "expected", "chunks", "last_sent")}))
        emit({"rid": spec["rid"], "room": spec["room"], "end": end})
    held = sum(e.in_flight()[1] for e in mgr.engines)
    emit({"summary": {"held": held, "senders": len(mgr.senders), "bad_messages": mgr.bad_messages,
                      "stats": mgr.kv.stats(), "generate_posts": generate.count}})
    generate.shutdown()
    # Let the decode read what it was granted before the engines go away.
    time.sleep(plan.get("linger", 0.5))
    mgr.close()
    if server is not None:
        server.close()


def run_decode(plan: Dict[str, Any], rank: int) -> None:
    from sglang.srt.disaggregation import decode as D
    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    port = plan["bootstrap_port"]
    sa, group, _, shape, dp_rank, dp = setup("decode", plan, rank)
    backend = TransferBackend(sa.disaggregation_transfer_backend)
    if shape.mamba is not None:
        r2t = mamba_side.req_pool(shape, "decode")
        pool, alloc = mamba_side.kv_pool(shape, r2t, POOL_TOKENS, PAGE)
    else:
        r2t = D.DecodeReqToTokenPool(size=32, max_context_len=1024, device="cpu", enable_memory_saver=False,
                                     pre_alloc_size=32)
        pool, alloc = dsv4_side.kv_pool(shape.config, r2t, "decode") if shape.dsv4 else kv_pool(shape)
    tree = RadixCache(CacheInitParams(disable=True, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                                      page_size=PAGE))
    out = Outputs()

    class Scheduler(D.SchedulerDisaggregationDecodeMixin):
        pass

    s = Scheduler()
    s.__dict__.update(
        tp_worker=NS(model_runner=NS(kv_cache_dtype_str="auto"), is_hybrid_swa=shape.swa), random_seed=0,
        model_config=shape.config, server_args=sa, enable_hisparse=False, enable_lora=False,
        enable_priority_scheduling=False, enable_decode_hicache=False, running_batch=NS(reqs=[]),
        waiting_queue=[], last_batch=None, output_streamer=out, metrics_reporter=NS(enable_metrics=False),
        spec_algorithm=NS(is_none=lambda: True), enable_overlap=False, kv_checksum_computer=None,
        batch_result_processor=NS(_maybe_update_reasoning_tokens=lambda req, tok: None),
        sliding_window_size=shape.window,
    )
    meta = MetadataBuffers(64, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=16)
    idx = ReqToMetadataIdxAllocator(64)
    tq = D.DecodeTransferQueue(req_to_metadata_buffer_idx_allocator=idx, metadata_buffers=meta, scheduler=s,
                               tree_cache=tree)
    s.disagg_decode_transfer_queue = tq
    dq = D.DecodePreallocQueue(req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, draft_token_to_kv_pool=None,
                               req_to_metadata_buffer_idx_allocator=idx, metadata_buffers=meta, scheduler=s,
                               transfer_queue=tq, tree_cache=tree, gpu_id=0, bootstrap_port=port,
                               max_total_num_tokens=POOL_TOKENS, num_reserved_decode_tokens=16,
                               transfer_backend=backend)
    s.disagg_decode_prealloc_queue = dq
    mgr = dq.kv_manager
    space = dsv4_side.regions(mgr.kv_args) if shape.dsv4 else None
    named: Dict[str, Dict[str, Any]] = {}  # the rows SGLang named for each request (DeepSeek-V4)

    def add(r, **kw):
        dq.add(r, **kw)
        if space is not None:
            (d,) = [d for d in dq.queue if d.req is r]
            dsv4_side.record_rows(d.kv_receiver, named.setdefault(r.rid, {}))

    emit({"ready": True, "backend": type(mgr).__name__})
    free_pages_at_start = alloc.available_size()

    reqs = {}
    later: List[Any] = []  # (when, req, spec): requests the decode gets later than the prefill
    for spec in plan["requests"]:
        if not mine(spec, "decode", dp_rank, dp):
            continue
        r = make_req(spec["rid"], spec["n"], spec["room"], port)
        reqs[spec["rid"]] = (r, spec)
        # A request the decode retracted: its receiver asks again, and its prefill computes it
        # again at the decode's request (submit_prefill_recompute).
        if spec.get("decode_delay"):
            later.append((time.monotonic() + spec["decode_delay"], r, spec))
            continue
        add(r, is_rebootstrap=bool(spec.get("rebootstrap")))
    ended: Dict[str, Dict[str, Any]] = {}
    aborted = set()
    deadline = time.monotonic() + plan.get("deadline", 60)
    while (len(ended) < len(reqs) or tq.has_pending_deferred_releases()) and time.monotonic() < deadline:
        # As the scheduler's process_decode_queue: failed rooms' pages come back once kvlink
        # says no cancelled read of them can still write (SGLang's deferred release).
        tq.resolve_deferred_releases()
        for item in [x for x in later if x[0] <= time.monotonic()]:
            later.remove(item)
            add(item[1])
        good, _failed = dq.pop_preallocated()
        tq.extend(good)
        for d in tq.queue:
            spec = reqs[d.req.rid][1]
            # The scheduler's abort of a request in the transfer queue, once a chunk was read.
            if spec.get("abort_after_first_chunk") and d.req.rid not in aborted and d.kv_receiver.chunks > 0:
                aborted.add(d.req.rid)
                d.kv_receiver.abort()
            if spec.get("decode_dies_after_first_chunk") and d.kv_receiver.chunks > 0:
                emit({"dying": d.req.rid})
                os._exit(3)
        for r in tq.pop_transferred():
            spec = reqs[r.rid][1]
            n, room = spec["n"], spec["room"]
            slots = r2t.req_to_token[r.kv.req_pool_idx, :n].long()
            if space is not None:
                bad = dsv4_side.wrong_rows(space, room, named.get(r.rid, {}), mgr.kv_args.state_types)
            else:
                bad = wrong_kv(pool, alloc, shape, room, slots, torch.arange(n))
            if shape.mamba is not None:
                bad += mamba_side.wrong_state(r2t, shape, room, n, r)
            ok_token = list(r.output_ids) == [first_token(room)]
            ended[r.rid] = {"end": "ok", "bytes_ok": not bad, "bad": bad, "first_token_ok": ok_token,
                            "pages": (n + PAGE - 1) // PAGE}
            # The request goes on decoding; here its pages go back.
            alloc.free(r2t.req_to_token[r.kv.req_pool_idx, :r.kv.kv_allocated_len])
            r2t.free(r)
        for rid, why in out.ends.items():
            ended.setdefault(rid, {"end": why})
        time.sleep(0.002)
    for rid, (r, spec) in reqs.items():
        rcv = mgr.receivers.get(spec["room"])
        state = repr({k: getattr(rcv, k, None) for k in ("outcome", "reason", "route", "asked_at", "chunks",
                                                          "last_seen")}) if rcv is not None else "no receiver"
        emit({"rid": rid, "room": spec["room"], **ended.get(rid, {"end": f"unfinished: {state}"})})
    receiving = sum(e.in_flight()[0] for e in mgr.engines)
    emit({"summary": {"receiving": receiving, "receivers": len(mgr.receivers), "bad_messages": mgr.bad_messages,
                      "free_pages_back": alloc.available_size() == free_pages_at_start,
                      "stats": mgr.kv.stats()}})
    mgr.close()


if __name__ == "__main__":
    role, plan = sys.argv[1], json.loads(sys.argv[2])
    (run_prefill if role == "prefill" else run_decode)(plan, int(sys.argv[3]) if len(sys.argv) > 3 else 0)
