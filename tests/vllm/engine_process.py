"""One vLLM engine for the connector tests, in its own process: vLLM's real scheduler
(``AsyncScheduler`` by default, as vLLM picks; CPU, a real model's ``config.json``, no weights)
with kvlink's connector loaded by vLLM's own factory in both roles, one worker-side connector
per TP rank, and a stand-in for the model runner that does what each GPU worker does around
the connector every step (bind metadata, forward, start loads, collect transfer results), the
ranks' results combined by vLLM's ``KVOutputAggregator``.

The KV caches are vLLM's own: each layer's KV cache spec from vLLM's own layers, the model
built without weights on the meta device (``model_specs.model_specs``; the TP group is the
one thing stubbed there), the KV cache config computed by vLLM (``get_kv_cache_configs``), the
layout resolved by vLLM (``resolve_kv_cache_layout``: the connector's preference, or
``VLLM_KV_CACHE_LAYOUT``) and the caches allocated by ``allocate_kv_cache``, the path the GPU
model runner takes: one backing allocation, a ``[blocks, heads, tokens, K|V]`` view per layer.

The forward writes, for every token it computes, bytes that are a function of the token id,
its position, the layer and the KV head (``token_bytes``; MLA's latent has one head) into the
token's slot of the request's blocks, each TP rank for the heads it holds. A decode can
therefore check every byte it received without knowing the prefill's block ids or TP size:
at the step a request is first scheduled after its load, each of its computed positions must
hold exactly ``token_bytes`` of its token, head by head (in a sliding-window group, the
positions its window still sees; in a chunked local attention group, those of the next
token's chunk).

The test process drives it through a ``multiprocessing`` pipe (``serve``): add requests,
step, abort, report state.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from contents import channel_bytes, state_bytes, state_pieces, token_bytes
from model_specs import MODEL_OPTIONS, declared_layouts, model_dir, model_specs

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK_SIZE = 16
class Engine:
    """A vLLM scheduler, the worker-side connectors and the KV caches of one engine.

    ``model``: a folder of ``models/``; ``layout``: ``None`` lets vLLM resolve the layout
    (the connector's preference among what the backends support), a name forces it as
    ``VLLM_KV_CACHE_LAYOUT`` does; ``kernel_block``: a kernel block size smaller than the
    block size (vLLM's kernel block splitting); ``dp_index``: the engine's data-parallel
    index, as vLLM sets it; ``prefix_caching`` off makes a Mamba hybrid's state one block per
    request (vLLM's mamba cache mode "none"; "align" with it on)."""

    def __init__(
        self,
        name: str,
        num_blocks: int,
        extra: Dict[str, Any],
        model: str,
        asynchronous: bool,
        tp: int = 1,
        block_size: int = BLOCK_SIZE,
        kernel_block: Optional[int] = None,
        dp_index: int = 0,
        supported: Optional[List[str]] = None,
        prefix_caching: bool = True,
        max_model_len: int = 2048,
        chunk: int = 256,
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
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, init_none_hash

        try:  # vLLM 0.33 moved the planning out of kv_cache_utils, grouping first
            from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
        except ImportError:
            from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

            get_global_kv_cache_groups = None
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import SlidingWindowSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        init_none_hash(sha256)
        self.name = name
        self.block_size = block_size
        mc = ModelConfig(
            model=model_dir(model),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            seed=0,
            max_model_len=max_model_len,
            **MODEL_OPTIONS.get(os.path.basename(model), {}),
        )
        config = VllmConfig(
            model_config=mc,
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=chunk,
                max_model_len=max_model_len,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvlinkConnector",
                kv_connector_module_path="kvlink.vllm",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
                kv_load_failure_policy="recompute",
            ),
            device_config=DeviceConfig("cpu"),
        )
        # TP ranks live in this one process (no torch.distributed on CPU): each rank's
        # worker-side connector is made while kvlink.vllm.worker._tp_rank answers that rank.
        config.parallel_config.tensor_parallel_size = tp
        if os.path.basename(model) in MODEL_OPTIONS:
            # vLLM lets a KV consumer of a multimodal model take pre-computed embeddings, whose
            # processor needs the tokenizer a folder without weights lacks; these tests send
            # text (token ids) only, which never reaches that processor.
            config.model_config.multimodal_config.enable_mm_embeds = False
        config.parallel_config.data_parallel_index = dp_index
        # vLLM turns its hybrid KV cache manager off on platforms without GPU support, CPU
        # included; on a GPU it stays on with a connector that supports it (kvlink's does):
        # what a GPU platform decides, set here.
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        # Likewise its CPU platform turns prefix caching off for MLA models (its CPU kernels
        # cannot start from a cached prefix); a GPU platform leaves it as configured.
        config.cache_config.enable_prefix_caching = prefix_caching
        specs, self.shared = model_specs(config, tp)
        # Compressed attention layers (DeepSeek-V4's): one stored state per this many tokens.
        from vllm.v1.kv_cache_interface import AttentionSpec

        self.per_state = {
            n: int(s.tokens_per_state) for n, s in specs.items() if isinstance(s, AttentionSpec) and s.tokens_per_state > 1
        }
        # As the engine core does: the layout from what the backends support, the connector's
        # preference and VLLM_KV_CACHE_LAYOUT.
        supported = supported or declared_layouts(config)
        self.kv_layout = resolve_kv_cache_layout(config, [supported], specs.values())
        per_block = sum(spec.page_size_bytes for spec in specs.values())
        memory = [num_blocks * per_block]
        if get_global_kv_cache_groups is None:  # vLLM 0.32
            (kv_cache_config,) = get_kv_cache_configs(config, [specs], memory)
        else:  # vLLM 0.33, as its engine core calls them
            groups = get_global_kv_cache_groups(config, [specs])
            (kv_cache_config,) = get_kv_cache_configs(config, [specs], memory, groups)
        kv_cache_config.kv_cache_layout = self.kv_layout.name
        # As the engine core does: the scheduler's config holds each group's layers' kind
        # (a group of one kind's layers with pages of different sizes, UniformTypeKVCacheSpecs,
        # unwrapped), the workers' the packed groups; the configured block size becomes the
        # smallest of the groups that take part in prefix caching.
        sched_config = generate_scheduler_kv_cache_config([kv_cache_config])
        num_blocks = kv_cache_config.num_blocks
        config.cache_config.num_gpu_blocks = num_blocks
        groups = sched_config.kv_cache_groups
        if groups:
            sizes = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
            config.cache_config.block_size = min(sizes or [g.kv_cache_spec.block_size for g in groups])
        self.layer_names = list(specs)
        self.group_of = {n: g for g, spec in enumerate(groups) for n in spec.layer_names}
        # Per group, its tokens per block (vLLM may give groups of other kinds other sizes).
        self.group_block_size = [g.kv_cache_spec.block_size for g in groups]
        # Per group, the sliding window in tokens (0: full attention).
        self.windows = [
            g.kv_cache_spec.sliding_window if isinstance(g.kv_cache_spec, SlidingWindowSpec) else 0 for g in groups
        ]
        # Per group, the attention chunk in tokens (0: not chunked local attention).
        self.chunks = [getattr(g.kv_cache_spec, "attention_chunk_size", None) or 0 for g in groups]
        # Per state group (Mamba-kind, and compressor rings: one block per request), its
        # speculative scratch blocks (the running state is the block before them).
        from vllm.v1.kv_cache_interface import CircularBufferSpec, MambaSpec

        mamba = {g for g, s in enumerate(groups) if isinstance(s.kv_cache_spec, MambaSpec)}
        # Every rank holds a ring whole (vLLM builds compressors without TP).
        self.rings = {g for g, s in enumerate(groups) if isinstance(s.kv_cache_spec, CircularBufferSpec)}
        self.scratch = {g: groups[g].kv_cache_spec.num_speculative_blocks for g in mamba}
        self.scratch.update(dict.fromkeys(self.rings, 0))
        # Per state group, vLLM's mamba cache mode ("none" for a ring) and the tokens per block.
        self.state_mode = {g: getattr(groups[g].kv_cache_spec, "mamba_cache_mode", "none") for g in self.scratch}
        self.state_block_size = {g: groups[g].kv_cache_spec.block_size for g in self.scratch}
        # Per Mamba-kind group and rank, where vLLM's TP split puts each piece of a layer's page.
        self.state_pieces = {
            g: [state_pieces(groups[g].kv_cache_spec, tp, r, mc.hf_text_config) for r in range(tp)] for g in mamba
        }
        self.mla = mc.use_mla
        # Layers of MLA's kind in a model of attention heads (MiniMax-M3's indexer keys).
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        self.latent = {n for n, s in specs.items() if isinstance(s, MLAAttentionSpec)}
        self.total_heads = 1 if self.mla else mc.get_total_num_kv_heads()
        from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes

        self.scheduler_block_size, self.hash_block_size = resolve_kv_cache_block_sizes(sched_config, config)
        alignment = resolve_cache_hit_alignment_tokens(sched_config, config, self.scheduler_block_size, self.hash_block_size)
        for c in (kv_cache_config, sched_config):
            c.hash_block_size, c.cache_hit_alignment_tokens = self.hash_block_size, alignment
        # vLLM turns asynchronous scheduling on by default (for this config too); the
        # synchronous scheduler is what it uses otherwise.
        config.scheduler_config.async_scheduling = asynchronous
        self.scheduler = (AsyncScheduler if asynchronous else Scheduler)(
            vllm_config=config,
            kv_cache_config=sched_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            # As the engine core does: the scheduling granularity (the groups' block sizes'
            # common multiple: a Mamba group in mode "none" spans the model length) and the
            # prefix hashes' block size.
            block_size=self.scheduler_block_size,
            hash_block_size=self.hash_block_size,
        )
        import kvlink.vllm.worker as kv_worker
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        rank_of = kv_worker._tp_rank
        self.workers = []
        try:
            for r in range(tp):
                kv_worker._tp_rank = lambda r=r: r
                self.workers.append(
                    KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
                )
        finally:
            kv_worker._tp_rank = rank_of
        # vLLM's own combination of the ranks' transfer results (a request is finished once
        # every rank reported it).
        self.aggregator = KVOutputAggregator.from_connector(self.workers[0], tp)
        kernel = [kernel_block] * len(groups) if kernel_block else None
        self.caches = [
            allocate_kv_cache(kv_cache_config, torch.device("cpu"), self.kv_layout, kernel) for _ in range(tp)
        ]
        # Cross-layer KV sharing, as the GPU model runner sets it up after allocating: the
        # layers that reuse another layer's cache are added to kv_caches as its aliases.
        for caches in self.caches:
            for layer, target in self.shared.items():
                caches[layer] = caches[target]
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
        # Benchmarks (tools/bench-vllm-overlap.py): seconds of emulated forward per token and
        # layer (the forward then sleeps instead of writing, and nothing is checked), and when
        # each request that loaded its KV was first scheduled (time.monotonic()).
        self.compute = 0.0
        self.admitted: Dict[str, float] = {}
        self.asynchronous = asynchronous
        # Asynchronous scheduling: the step scheduled before, whose output the scheduler takes
        # after scheduling the next one (vLLM's batch queue of two).
        self.pending = None

    # -- the stand-in model runner --

    def _slot(self, rank: int, layer: str, block: int, offset: int):
        """One token's slot (a compressed layer's: one state's, ``offset`` counting states) in
        a layer's cache on ``rank``: its bytes per head held there, ``(heads, bytes)``, and the
        global numbers of those heads."""
        v = self.caches[rank][layer]
        per = v.shape[2]  # tokens per kernel block
        kernel = block * (v.shape[0] // self.num_blocks) + offset // per
        held = v.shape[1]
        whole = self.mla or layer in self.latent  # one vector per token, on every rank
        first = 0 if whole else rank * held * self.total_heads // max(self.total_heads, held * len(self.workers))
        return v[kernel, :, offset % per].view(torch.uint8), np.arange(first, first + held)

    def _blocks(self, rid: str, layer: str):
        return self.scheduler.kv_cache_manager.get_block_ids(rid)[self.group_of[layer]]

    def _state_block(self, rid: str, layer: str, upto: int) -> int:
        """The block of a state layer's group that holds the request's running state after
        ``upto`` tokens, where vLLM's Mamba kernels look for it: in the "align" mode (prefix
        caching) the block of the last computed token's position (a block allocated for the
        next token, which the step writes, comes after it); in "none" the running-state slot
        (``clip_ssm_state_blocks``, as vLLM's NixlConnector reads it)."""
        from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks

        group = self.group_of[layer]
        blocks = list(self._blocks(rid, layer))
        if self.state_mode[group] == "align":
            return blocks[(upto - 1) // self.state_block_size[group]] if blocks else 0
        blocks = clip_ssm_state_blocks(blocks, self.scratch[group])
        return blocks[-1] if blocks else 0

    def _state_slot(self, rank: int, layer: str, block: int):
        """A state layer's page on ``rank``: its ``[1, 1, C]`` bytes (conv, SSM, ... packed)."""
        return self.caches[rank][layer][block].view(torch.uint8).reshape(-1)

    def _state_content(self, tokens: List[int], li: int, layer: str, rank: int, size: int) -> np.ndarray:
        """What a state layer's page on ``rank`` holds after ``tokens``: channel by channel
        where vLLM splits the state over TP ranks (so that any TP size's slice of it can be
        checked), else a pattern of the tokens, the layer and the rank (one for every rank: a
        compressor's ring)."""
        group = self.group_of[layer]
        pieces = self.state_pieces.get(group, [None] * len(self.workers))[rank]
        if pieces is None:
            return state_bytes(tokens, li, 0 if group in self.rings else rank, size)
        out = np.zeros(size, dtype=np.uint8)
        for part, (at, per, channels) in enumerate(pieces):
            out[at : at + per * len(channels)] = channel_bytes(tokens, li, part, channels, per).reshape(-1)
        return out

    def _write_states(self, req, upto: int) -> None:
        """The stand-in for a Mamba-kind layer's forward: the running state after the first
        ``upto`` tokens (``_state_content``)."""
        for li, layer in enumerate(self.layer_names):
            if self.group_of[layer] in self.scratch:
                b = self._state_block(req.request_id, layer, upto)
                for rank in range(len(self.workers)):
                    slot = self._state_slot(rank, layer, b)
                    want = self._state_content(req.all_token_ids[:upto], li, layer, rank, slot.shape[0])
                    slot.copy_(torch.from_numpy(want))

    def _write(self, req, start: int, end: int, only: Optional[str] = None) -> None:
        """Writes positions ``[start, end)`` of every layer, or of layer ``only`` (the states,
        with the first layer's)."""
        tokens = req.all_token_ids
        if self.scratch and end <= len(tokens) and only in (None, self.layer_names[0]):
            self._write_states(req, end)
        # Under asynchronous scheduling a decode step computes a token sampled by the step
        # before, which the scheduler has not seen yet: its id is unknown here, so its KV is
        # not written (no test reads it).
        for pos in range(start, min(end, len(tokens))):
            for li, layer in enumerate(self.layer_names):
                if self.group_of[layer] in self.scratch or only not in (None, layer):
                    continue
                size, per = self.group_block_size[self.group_of[layer]], self.per_state.get(layer, 1)
                if pos % per != per - 1:
                    continue  # a compressed layer stores a state once its tokens are all there
                b = self._blocks(req.request_id, layer)[pos // size]
                if b == 0:
                    continue  # vLLM's null block: a position a sliding window no longer keeps
                for rank in range(len(self.workers)):
                    slot, heads = self._slot(rank, layer, b, pos % size // per)
                    slot.copy_(torch.from_numpy(token_bytes(tokens[pos], pos, li, heads, slot.shape[1])))

    def _verify(self, req, upto: int) -> None:
        """Every position below ``upto`` holds its token's bytes, head by head (in a sliding
        window's group, the positions the window still sees: vLLM's null block anywhere else
        is a failure)."""
        tokens = req.all_token_ids
        for li, layer in enumerate(self.layer_names):
            if self.group_of[layer] in self.scratch:
                b = self._state_block(req.request_id, layer, upto)
                for rank in range(len(self.workers)):
                    got = self._state_slot(rank, layer, b).numpy()
                    want = self._state_content(tokens[:upto], li, layer, rank, got.shape[0])
                    if b == 0 or not np.array_equal(got, want):
                        wrong = np.flatnonzero(got != want)
                        self.bad.append(
                            f"{req.request_id} rank {rank} layer {li}: the state after {upto} tokens in block {b} "
                            f"({len(wrong)} of {len(got)} bytes differ, from byte {wrong[:1].tolist()} to {wrong[-1:].tolist()})"
                        )
                        return
        for pos in range(upto):
            for li, layer in enumerate(self.layer_names):
                if self.group_of[layer] in self.scratch:
                    continue
                window, chunk = self.windows[self.group_of[layer]], self.chunks[self.group_of[layer]]
                size, per = self.group_block_size[self.group_of[layer]], self.per_state.get(layer, 1)
                if pos % per != per - 1:
                    continue  # a compressed layer's state of the tokens up to this one is not stored
                b = self._blocks(req.request_id, layer)[pos // size]
                # A sliding window's group: positions before the window are not kept, and vLLM
                # frees the block of the window's first position when the next token is
                # computed (its null block then stands there).
                if window and (pos <= upto - window or (b == 0 and pos == upto - window + 1)):
                    continue
                # An attention chunk's group: the next token attends to its own chunk only.
                if chunk and pos < upto // chunk * chunk:
                    continue
                for rank in range(len(self.workers)):
                    slot, heads = self._slot(rank, layer, b, pos % size // per)
                    got = slot.numpy()
                    if b == 0 or not np.array_equal(got, token_bytes(tokens[pos], pos, li, heads, got.shape[1])):
                        self.bad.append(
                            f"{req.request_id} rank {rank} position {pos} of {upto} layer {li} block {b} in {self._blocks(req.request_id, layer)}"
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
                self.admitted[new.req_id] = time.monotonic()
                if not self.compute:
                    self._verify(req, new.num_computed_tokens)
        req_ids, sampled, work = [], [], []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            end = req.num_computed_tokens  # already advanced by schedule()
            work.append((req, end - n, end))
            req_ids.append(rid)
            # A partial prefill samples nothing; otherwise one token (ignore_eos: max_tokens
            # ends it).
            sampled.append([] if end < req.num_tokens else [7 + (end % 500)])
        # As vLLM's model runner does: the connector's loads (and holds) start before the
        # forward; the forward writes layer after layer, each attention layer's save hook
        # called once it is written (vLLM's maybe_transfer_kv_layer); the connector waits for
        # its saves once the forward is done.
        for w in self.workers:
            w.start_load_kv(None)
        for layer in self.layer_names:
            if self.compute:
                time.sleep(self.compute * sum(end - start for _, start, end in work))
            else:
                for req, start, end in work:
                    self._write(req, start, end, layer)
            if self.group_of[layer] not in self.scratch:
                for w in self.workers:
                    w.save_kv_layer(layer, self.caches[0][layer], None)
        outputs = []
        for w in self.workers:
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
            block_hasher=get_request_block_hasher(self.hash_block_size, sha256),
        )
        req.kv_transfer_params = dict(params) if params else None
        self.scheduler.add_request(req)

    def set_compute(self, seconds: float) -> None:
        """Emulated forward time per token and layer (0: write and check every byte)."""
        self.compute = seconds

    def admitted_at(self, rid: str) -> Optional[float]:
        """When ``rid`` was first scheduled with its KV loaded (``time.monotonic()``), if it was."""
        return self.admitted.get(rid)

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
            "layout": self.kv_layout.name,
            "num_blocks": self.num_blocks,
            "verified": list(self.verified),
            "bad": list(self.bad),
            "reads": dict(self.reads),
            "connector_stats": dict(self.stats),
            "finished_sending": self.finished_sending_seen,
        }


def serve(conn, name: str, num_blocks: int, extra: Dict[str, Any], options: Dict[str, Any]) -> None:
    """Process entry point: builds the engine, then answers commands until ``("exit",)``."""
    try:
        layout = options.pop("layout", None)
        if layout is not None:
            os.environ["VLLM_KV_CACHE_LAYOUT"] = layout  # as a user forces one
        conv = options.pop("conv_layout", None)
        if conv is not None:
            os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = conv  # as a user sets it
        engine = Engine(name, num_blocks, extra, **options)
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
