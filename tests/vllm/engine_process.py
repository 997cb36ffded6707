"""One vLLM engine for the connector tests, in its own process: vLLM's real scheduler
(``AsyncScheduler`` by default, as vLLM picks; CPU, a local model config, no weights) with
kvlink's connector loaded by vLLM's own factory in both roles, one worker-side connector per TP
rank, and a stand-in for the model runner that does what each GPU worker does around the
connector every step (bind metadata, forward, start loads, collect transfer results), the
ranks' results combined by vLLM's ``KVOutputAggregator``.

The forward writes, for every token it computes, bytes that are a function of the token id,
its position, the layer, K or V and the KV head (``token_bytes``; MLA's latent has no head)
into the token's slot of the request's blocks, each TP rank for the heads it holds. A decode
can therefore check every byte it received without knowing the prefill's block ids or TP size:
at the step a request is first scheduled after its load, each of its computed positions must
hold exactly ``token_bytes`` of its token, head by head.

``hybrid`` puts the second layer in a sliding-window KV cache group of its own (vLLM's hybrid
KV cache manager, as for Gemma-style models): its blocks have their own ids, and only the
blocks its window still sees are sent and checked.

The test process drives it through a ``multiprocessing`` pipe (``serve``): add requests,
step, abort, report state.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from typing import Any, Dict, List

import numpy as np
import torch

LAYERS = 2
# KV heads of the model, over all TP ranks (each of TP 1, 2 or 4 ranks holds its share).
KV_HEADS = 4
HEAD_DIM = 16
BLOCK_SIZE = 16
EOS = 2
MLA_DIM = 576
# The sliding window of the hybrid configuration's second layer, in tokens.
WINDOW = 48


def _hnd(n: int, heads: int) -> torch.Tensor:
    """FlashAttention's cache with head-major blocks: allocated ``[2, n, heads, block, dim]``
    and handed over as the ``[2, n, block, heads, dim]`` view vLLM's HND layout gives."""
    return torch.zeros(2, n, heads, BLOCK_SIZE, HEAD_DIM, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)


# The KV cache layouts vLLM's attention backends hand to register_kv_caches, per layer:
# (cache for n blocks and this rank's heads, K/V planes). MLA's latent is one plane; uint8
# stands for fp8.
LAYOUTS = {
    "flash": (lambda n, h: torch.zeros(2, n, BLOCK_SIZE, h, HEAD_DIM, dtype=torch.bfloat16), 2),
    "flash_hnd": (_hnd, 2),
    "flashinfer": (lambda n, h: torch.zeros(n, 2, BLOCK_SIZE, h, HEAD_DIM, dtype=torch.float16), 2),
    "mla": (lambda n, h: torch.zeros(n, BLOCK_SIZE, MLA_DIM, dtype=torch.uint8), 1),
}


def token_bytes(token: int, pos: int, layer: int, kv: int, head: int, size: int) -> np.ndarray:
    """What the stand-in forward writes for one token and KV head: ``size`` bytes."""
    base = (token * 7 + pos * 13 + layer * 29 + kv * 53 + head * 97) % 251
    return ((np.arange(size, dtype=np.int64) * 131 + base) % 251 + 1).astype(np.uint8)


def model_dir() -> str:
    """A local model directory with a small Llama config (no weights, no tokenizer)."""
    d = os.path.join(tempfile.gettempdir(), "kvlink-vllm-test-model")
    os.makedirs(d, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": KV_HEADS * HEAD_DIM * 2,
        "num_attention_heads": KV_HEADS * 2,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": LAYERS,
        "intermediate_size": 128,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": EOS,
        "rms_norm_eps": 1e-5,
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


class Engine:
    """A vLLM scheduler, the worker-side connector and the KV caches of one engine."""

    def __init__(
        self, name: str, num_blocks: int, extra: Dict[str, Any], layout: str, asynchronous: bool, tp: int = 1, hybrid: bool = False
    ):
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
        from vllm.v1.structured_output import StructuredOutputManager

        init_none_hash(sha256)
        self.name = name
        model = ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=2048)
        config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=256,
                max_model_len=2048,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvlinkConnector",
                kv_connector_module_path="kvlink.vllm",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
                kv_load_failure_policy="recompute",
            ),
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.num_gpu_blocks = num_blocks
        # TP ranks live in this one process (no torch.distributed on CPU): each rank's
        # worker-side connector is made while kvlink.vllm.worker._tp_rank answers that rank.
        config.parallel_config.tensor_parallel_size = tp
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        self.heads = KV_HEADS // tp  # this engine's heads per rank
        full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=self.heads, head_size=HEAD_DIM, dtype=torch.bfloat16)
        if hybrid:
            sliding = SlidingWindowSpec(
                block_size=BLOCK_SIZE, num_kv_heads=self.heads, head_size=HEAD_DIM, dtype=torch.bfloat16, sliding_window=WINDOW
            )
            groups = [KVCacheGroupSpec(self.layer_names[:1], full), KVCacheGroupSpec(self.layer_names[1:], sliding)]
        else:
            groups = [KVCacheGroupSpec(self.layer_names, full)]
        # Which KV cache group each layer is in, and how many trailing blocks of a prompt a
        # group keeps (0: all).
        self.group_of = {n: g for g, spec in enumerate(groups) for n in spec.layer_names}
        self.tails = [0] + ([-(-WINDOW // BLOCK_SIZE) + 1] if hybrid else [])
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        # vLLM turns asynchronous scheduling on by default (for this config too); the
        # synchronous scheduler is what it uses otherwise.
        config.scheduler_config.async_scheduling = asynchronous
        self.scheduler = (AsyncScheduler if asynchronous else Scheduler)(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK_SIZE,
        )
        import kvlink.vllm.worker as kv_worker
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        rank_of = kv_worker._tp_rank
        self.workers = []
        try:
            for r in range(tp):
                kv_worker._tp_rank = lambda r=r: r
                self.workers.append(KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config))
        finally:
            kv_worker._tp_rank = rank_of
        # vLLM's own combination of the ranks' transfer results (a request is finished once
        # every rank reported it).
        self.aggregator = KVOutputAggregator.from_connector(self.workers[0], tp)
        # The layouts vLLM's attention backends hand to register_kv_caches, per rank.
        self.layout = layout
        make, self.planes = LAYOUTS[layout]
        self.caches = [{n: make(num_blocks, self.heads) for n in self.layer_names} for _ in range(tp)]
        for w, caches in zip(self.workers, self.caches):
            w.register_kv_caches(caches)
        # As vLLM's EngineCore does with what every worker returned, keyed (pp rank, tp rank).
        self.scheduler.connector.set_xfer_handshake_metadata_pp_aware(
            {(0, r): w.get_handshake_metadata() for r, w in enumerate(self.workers)}
        )
        self.num_blocks = num_blocks
        self.requests: Dict[str, Any] = {}
        self.verified: List[str] = []
        self.bad: List[str] = []
        self.reads: Dict[str, int] = {}
        self.stats: Dict[str, Any] = {}
        self.finished_sending_seen = 0
        self.asynchronous = asynchronous
        # Asynchronous scheduling: the step scheduled before, whose output the scheduler takes
        # after scheduling the next one (vLLM's batch queue of two).
        self.pending = None

    # -- the stand-in model runner --

    def _slots(self, rank: int, layer: str, kv: int, block: int, offset: int):
        """The bytes of one token's slot, per global KV head it holds on ``rank`` (one slot
        with head 0 for MLA's latent, which every rank holds whole)."""
        t = self.caches[rank][layer]
        if self.layout == "mla":
            return [(0, t[block, offset].view(torch.uint8))]
        s = t[kv, block, offset] if self.layout in ("flash", "flash_hnd") else t[block, kv, offset]
        first = rank * self.heads
        return [(first + j, s[j].view(torch.uint8)) for j in range(self.heads)]

    def _blocks(self, rid: str, layer: str):
        return self.scheduler.kv_cache_manager.get_block_ids(rid)[self.group_of[layer]]

    def _write(self, req, start: int, end: int) -> None:
        tokens = req.all_token_ids
        # Under asynchronous scheduling a decode step computes a token sampled by the step
        # before, which the scheduler has not seen yet: its id is unknown here, so its KV is
        # not written (no test reads it).
        for pos in range(start, min(end, len(tokens))):
            off = pos % BLOCK_SIZE
            for li, layer in enumerate(self.layer_names):
                b = self._blocks(req.request_id, layer)[pos // BLOCK_SIZE]
                if b == 0:
                    continue  # vLLM's null block: a position a sliding window no longer keeps
                for rank in range(len(self.workers)):
                    for kv in range(self.planes):
                        for head, slot in self._slots(rank, layer, kv, b, off):
                            slot.copy_(torch.from_numpy(token_bytes(tokens[pos], pos, li, kv, head, slot.numel())))

    def _verify(self, req, upto: int) -> None:
        """Every position below ``upto`` holds its token's bytes, head by head (in a sliding
        window's group, the positions the window still sees)."""
        tokens = req.all_token_ids
        for pos in range(upto):
            off = pos % BLOCK_SIZE
            for li, layer in enumerate(self.layer_names):
                if self.tails[self.group_of[layer]] and pos <= upto - WINDOW:
                    continue
                b = self._blocks(req.request_id, layer)[pos // BLOCK_SIZE]
                for rank in range(len(self.workers)):
                    for kv in range(self.planes):
                        for head, slot in self._slots(rank, layer, kv, b, off):
                            got = slot.numpy()
                            if b == 0 or not np.array_equal(got, token_bytes(tokens[pos], pos, li, kv, head, got.size)):
                                self.bad.append(
                                    f"{req.request_id} rank {rank} position {pos} layer {li} kv {kv} head {head} block {b}"
                                )
                                return
        self.verified.append(req.request_id)

    def step(self) -> Dict[str, Any]:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        for rid, spec in meta.reads.items():
            self.reads[rid] = len(spec.all_local())
        for w in self.workers:
            w.bind_connector_metadata(meta)
        # Requests scheduled for the first time: what they did not compute here must have
        # arrived intact (loaded, or a local prefix hit computed here earlier).
        for new in so.scheduled_new_reqs:
            req = self.scheduler.requests[new.req_id]
            if new.num_computed_tokens > 0 and (req.kv_transfer_params or {}).get("remote_request_id"):
                self._verify(req, new.num_computed_tokens)
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            end = req.num_computed_tokens  # already advanced by schedule()
            self._write(req, end - n, end)
            req_ids.append(rid)
            # A partial prefill samples nothing; otherwise one token (ignore_eos: max_tokens
            # ends it).
            sampled.append([] if end < req.num_tokens else [7 + (end % 500)])
        outputs = []
        for w in self.workers:
            # As vLLM's model runner does when the step has no synchronous loads: the
            # connector's loads (and holds) start once the forward is launched.
            w.start_load_kv(None)
            w.wait_for_save()
            results = w.get_transfer_results(so.finished_req_ids)
            invalid = w.get_block_ids_with_load_errors()
            stats = w.get_kv_connector_stats()
            if stats is not None:
                for k, v in stats.reduce().items():
                    self.stats[k] = self.stats.get(k, 0) + v if isinstance(v, int) else v
            w.clear_connector_metadata()
            kv_out = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=invalid,
                kv_connector_stats=stats,
            )
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                    kv_connector_output=kv_out,
                )
            )
        mro = self.aggregator.aggregate(outputs)
        self.finished_sending_seen += len(mro.kv_connector_output.finished_sending or ())
        if self.asynchronous:
            previous, self.pending = self.pending, (so, mro)
            if previous is None:
                return {"finished": [], "scheduled": len(req_ids)}
            so, mro = previous
        outputs = self.scheduler.update_from_output(so, mro)
        finished = []
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    finished.append(
                        {"id": o.request_id, "reason": str(o.finish_reason), "params": o.kv_transfer_params}
                    )
        return {"finished": finished, "scheduled": len(req_ids)}

    # -- commands --

    def add(self, rid: str, prompt: List[int], max_tokens: int, params: Dict[str, Any] | None) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            mm_features=None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )
        req.kv_transfer_params = dict(params) if params else None
        self.scheduler.add_request(req)

    def abort(self, rids: List[str]) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(rids, RequestStatus.FINISHED_ABORTED)

    def state(self) -> Dict[str, Any]:
        pool = self.scheduler.kv_cache_manager.block_pool
        engines = [w.engine for w in self.workers]
        in_flight = [sum(e.in_flight()[i] for e in engines) for i in (0, 1)]
        stats: Dict[str, int] = {}
        for e in engines:
            for k, v in e.stats().items():
                stats[k] = stats.get(k, 0) + v
        return {
            "free_blocks": pool.free_block_queue.num_free_blocks,
            "total_blocks": pool.num_gpu_blocks - 1,  # block 0 is vLLM's null block
            "requests": len(self.scheduler.requests),
            "in_flight": in_flight,
            "engine_stats": stats,
            "addresses": [e.handshake_address for e in engines],
            "verified": list(self.verified),
            "bad": list(self.bad),
            "reads": dict(self.reads),
            "connector_stats": dict(self.stats),
            "finished_sending": self.finished_sending_seen,
        }


def serve(
    conn, name: str, num_blocks: int, extra: Dict[str, Any], layout: str, asynchronous: bool, tp: int, hybrid: bool = False
) -> None:
    """Process entry point: builds the engine, then answers commands until ``("exit",)``."""
    try:
        engine = Engine(name, num_blocks, extra, layout, asynchronous, tp, hybrid)
        conn.send(("ok", engine.state()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            for w in engine.workers:
                w.shutdown()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(engine, cmd)(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
