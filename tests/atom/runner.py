"""A stand-in for ATOM's ``ModelRunner`` (which needs a GPU build of aiter): the KV cache comes
from ATOM's own attention builder (its ``allocate_kv_cache_tensors``, ``build_kv_cache_tensor``
and ``get_kv_transfer_tensors``, on the CPU), ATOM's ``set_kv_cache_data`` creates the worker
connector and registers it; the forward is ``kvmodel``'s, writing and checking every KV byte.
Models with per-request state (DeepSeek-V4, gated delta net hybrids) get ATOM's builder for
them and their pool plan (``dsv4``, ``gdn``), and a forward that also checks and moves on
each request's state.

Stubbed: the model (no weights), the CUDA device (``torch.zeros(device="cuda")`` lands on the
CPU), and the two connector methods, whose bodies are ``ModelRunner``'s."""

from __future__ import annotations

import os
from types import SimpleNamespace as NS

import stub  # noqa: F401  (installs the aiter stub in every process)
import torch

import dsv4
import gdn
import kvmodel

NUM_BLOCKS = int(os.environ.get("KVLINK_ATOM_BLOCKS", "48"))
#: Seconds each forward takes (a slow prefill, for aborts mid-forward).
STEP_DELAY = float(os.environ.get("KVLINK_ATOM_STEP_DELAY", "0"))


_zeros = torch.zeros


def _cpu_zeros(*shape, **kw):
    kw.pop("device", None)
    return _zeros(*shape, **kw)


class KvRunner:
    """``runner_qualname`` for ATOM's ``Config``: one per TP rank."""

    def __init__(self, rank, config):
        stub.TP.rank_in_group, stub.TP.world_size = rank, config.tensor_parallel_size
        self.rank, self.config, self.world_size = rank, config, config.tensor_parallel_size
        self.block_size = config.kv_cache_block_size
        self.hf = getattr(config.hf_config, "text_config", None) or config.hf_config
        from kvlink.atom.layout import is_mla

        self.mla = is_mla(config.hf_config)
        # Models with per-request state: ATOM's own builder for them, and the forward that
        # keeps their state (DeepSeek-V4: dsv4; gated delta net hybrids: gdn).
        self.stateful = None
        if dsv4.is_dsv4(self.hf):
            self.stateful = dsv4.V4Cache(config)
        elif gdn.is_gdn(config.hf_config):
            self.stateful = gdn.GdnCache(config, rank, self.world_size)
        self.is_deepseek_v32 = False
        self.mod = kvmodel.modulus(config.kv_cache_dtype)
        self.errors = os.environ.get("KVLINK_ATOM_ERRORS")

    # -- what ATOM's EngineCore asks of a runner --------------------------------------------
    def get_num_blocks(self):
        from atom.model_engine.state_runtime import StateRuntime

        if self.stateful is not None:
            return self.stateful.num_blocks()
        return {"num_kvcache_blocks": NUM_BLOCKS, "pool_entries": {}, "pool_entries_per_req": {}, "state_runtime": StateRuntime().to_wire()}

    def is_mimo_v2(self):
        return False

    def is_qwen_next(self):
        return False

    def _get_total_num_layers(self):
        return self.hf.num_hidden_layers

    def allocate_kv_cache(self, num_blocks):
        """``ModelRunner.allocate_kv_cache``: the caches, then ATOM's ``set_kv_cache_data``
        (which builds the worker connector and registers them)."""
        from atom.utils.forward_context import set_kv_cache_data

        tensors = self.kv_tensors(num_blocks)
        set_kv_cache_data(self.layers, self.config, tensors, num_blocks=num_blocks)
        return True

    def kv_tensors(self, num_blocks):
        """``ModelRunner.allocate_kv_cache``'s steps with ATOM's builder for the model: the
        per-layer caches (``self.layers``) and the ``KVTransferTensors`` it returns."""
        import atom.model_ops.attentions.aiter_attention as mha
        import atom.model_ops.attentions.aiter_mla as mla

        if self.stateful is not None:
            self.layers, tensors = self.stateful.allocate(num_blocks)
            return tensors
        mod, cls = (mla, mla.AiterMLAMetadataBuilder) if self.mla else (mha, mha.AiterAttentionMetadataBuilder)
        b = object.__new__(cls)
        b.model_runner = self
        # The builders' own rule for their physical block (MHA: 16 tokens, MLA: 1).
        b.block_size = 1 if self.mla else (self.block_size if self.block_size in (256, 1024) else 16)
        b.block_ratio = self.block_size // b.block_size
        self.builder = b
        self.config.num_kvcache_blocks = num_blocks
        self.physical_block_size = b.block_size
        self.num_physical_kvcache_blocks = num_blocks * b.block_ratio
        total = self.hf.num_key_value_heads if not self.mla else 1
        self.num_kv_heads = max(total // self.world_size, 1)
        saved, mod.torch.zeros = mod.torch.zeros, _cpu_zeros
        try:
            for name, value in b.allocate_kv_cache_tensors(self.num_kv_heads, 0).items():
                setattr(self, name, value)
        finally:
            mod.torch.zeros = saved
        layers = [NS(base_attention=object(), use_mla=self.mla, k_scale=None, v_scale=None, indexer=None) for _ in range(self.hf.num_hidden_layers)]
        self.layers = {f"layer_{i}": b.build_kv_cache_tensor(i, m) for i, m in enumerate(layers)}
        return b.get_kv_transfer_tensors()

    def process_kvconnector_output(self, meta):
        from atom.utils.forward_context import get_kvconnector

        if meta is not None and get_kvconnector() is not None:
            get_kvconnector().start_load_kv(meta)

    def async_proc_aggregation(self):
        from atom.kv_transfer.disaggregation import KVConnectorOutput
        from atom.utils.forward_context import get_kvconnector

        c = get_kvconnector()
        if c is None:
            return KVConnectorOutput()
        f = c.get_finished()
        return f if isinstance(f, KVConnectorOutput) else KVConnectorOutput(finished_sending=f[0], finished_recving=f[1])

    def exit(self):
        return None

    def dummy_execution(self):
        """An idle DP rank's forward, in step with the busy ones (``ModelRunner``'s returns
        True after a forward that touches no request's KV)."""
        return True

    # -- the forward -----------------------------------------------------------------------
    def forward(self, batch):
        from atom.model_engine.scheduler import ScheduledBatchOutput

        prefill = batch.total_seqs_num_prefill > 0
        if STEP_DELAY:
            import time

            time.sleep(STEP_DELAY)
        toks, pos = [], 0
        for i, rid in enumerate(batch.req_ids):
            n = int(batch.num_scheduled_tokens[i])
            ctx = int(batch.num_cached_tokens[i]) + n if prefill else int(batch.context_lens[i])
            table = batch.block_tables[i]
            tok = torch.tensor(batch.scheduled_tokens[pos : pos + n], dtype=torch.int64)
            pos += n
            if self.stateful is not None:
                toks.append((self._v4_step(rid, table, batch.per_req_cache_groups[i], tok, ctx),))
                continue
            self._write(table, tok, torch.arange(ctx - n, ctx))
            toks.append((self._sample(rid, table, ctx),))
        return ScheduledBatchOutput(batch.req_ids, toks, None, None, None, is_deferred_out=False)

    def _slots(self, table, positions):
        """Physical block and row of each position (a scheduler block is ``block_ratio``
        physical blocks in a row)."""
        pbs, ratio = self.physical_block_size, self.builder.block_ratio
        blocks = torch.tensor([table[p // self.block_size] for p in positions.tolist()], dtype=torch.int64)
        inner = positions % self.block_size
        return blocks * ratio + inner // pbs, inner % pbs

    def _heads(self):
        return torch.arange(self.num_kv_heads, dtype=torch.int64) + self.rank * self.num_kv_heads

    def _write(self, table, tok, positions):
        pb, row = self._slots(table, positions)
        for layer, t in enumerate(self.layers.values()):
            if self.mla:
                v = kvmodel.encode(torch, tok, kvmodel.latent_offsets(torch, positions, layer, 576), self.mod)
                t.k_cache.view(-1, self.physical_block_size, 576)[pb, row] = v.to(t.k_cache.dtype)
                continue
            h = self._heads()
            x = t.k_cache.shape[-1]
            for kv, cache in ((0, t.k_cache), (1, t.v_cache)):
                v = kvmodel.encode(torch, tok, kvmodel.kv_offsets(torch, positions, layer, kv, h, self.hf.head_dim), self.mod).to(cache.dtype)
                if kv == 0:  # [blocks, H, D/x, rows, x]
                    cache[pb, :, :, row, :] = v.view(len(pb), len(h), -1, x)
                else:  # [blocks, H, rows/x, D, x]
                    cache[pb, :, row // x, :, row % x] = v
                self.kv_scale[kv, layer][pb, :, row] = kvmodel.scale_values(torch, tok, positions, layer, kv, h)

    def _read_tokens(self, table, ctx):
        """Every position's token, recovered from the cache and checked against every element."""
        positions = torch.arange(ctx)
        pb, row = self._slots(table, positions)
        first = self.layers["layer_0"]
        if self.mla:
            got = first.k_cache.view(-1, self.physical_block_size, 576)[pb, row, :2].to(torch.int64)
            off = kvmodel.latent_offsets(torch, positions, 0, 2)
        else:  # head 0's dims 0 and 1 (the K cache packs dims by x)
            got = first.k_cache[pb, 0, 0, row, :2].to(torch.int64)
            off = kvmodel.kv_offsets(torch, positions, 0, 0, self._heads()[:1], 2)[:, 0]
        tok = kvmodel.decode(got[:, 0], got[:, 1], off[:, 0], off[:, 1], self.mod)
        for layer, t in enumerate(self.layers.values()):
            if self.mla:
                want = kvmodel.encode(torch, tok, kvmodel.latent_offsets(torch, positions, layer, 576), self.mod)
                have = t.k_cache.view(-1, self.physical_block_size, 576)[pb, row].to(torch.int64)
                if not torch.equal(have, want):
                    return None, f"layer {layer} latent"
                continue
            h = self._heads()
            for kv, cache in ((0, t.k_cache), (1, t.v_cache)):
                want = kvmodel.encode(torch, tok, kvmodel.kv_offsets(torch, positions, layer, kv, h, self.hf.head_dim), self.mod)
                if kv == 0:
                    have = cache[pb, :, :, row, :].reshape(len(pb), len(h), -1)
                else:
                    have = cache[pb, :, row // cache.shape[-1], :, row % cache.shape[-1]]
                if not torch.equal(have.to(torch.int64), want):
                    return None, f"layer {layer} {'KV'[kv]}"
                if not torch.equal(self.kv_scale[kv, layer][pb, :, row], kvmodel.scale_values(torch, tok, positions, layer, kv, h)):
                    return None, f"layer {layer} {'KV'[kv]} scales"
        return tok.tolist(), None

    def _v4_step(self, rid, table, slot, tok, ctx):
        """The forward of ``tok`` (the last of ``ctx`` positions) in a model with per-request
        state: its KV, then the whole context checked, its state checked and moved on."""
        n = len(tok)
        self.stateful.write(table, tok, torch.arange(ctx - n, ctx))
        tokens, bad = self.stateful.read_tokens(table, ctx)
        if bad is None and ctx > n and not self.stateful.state_ok(slot, tokens[: ctx - n]):
            bad = f"the state of slot {slot}"
        if bad is None:
            self.stateful.write_state(slot, tokens)
        return self._token(rid, tokens, ctx, bad)

    def _sample(self, rid, table, ctx):
        tokens, bad = self._read_tokens(table, ctx)
        return self._token(rid, tokens, ctx, bad)

    def _token(self, rid, tokens, ctx, bad):
        if bad is None:
            return kvmodel.next_token(tokens)
        if self.errors:
            with open(os.path.join(self.errors, f"rank{self.rank}-{os.getpid()}.txt"), "a") as f:
                f.write(f"request {rid}: KV of {ctx} positions differs from what was written ({bad})\n")
        return kvmodel.POISON
