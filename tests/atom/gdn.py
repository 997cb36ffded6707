"""A gated delta net hybrid's memory in the ATOM stand-in runner (``runner.KvRunner``): ATOM's
own ``GDNAttentionMetadataBuilder`` builds it, the stand-in forward writes and checks every
byte the transfer must move.

The builder is ATOM's, built as ``runner.KvRunner`` builds its MHA parent (whose ``__init__``
plans aiter's kernels) and initialised by its own ``_init_gdn_state``; the pools are sized by its ``sub_pool_specs`` and ATOM's ``plan_pools`` (a
PAGE pool of the full-attention layers' KV, one STATE slot per sequence), allocated by its
``allocate_kv_cache_tensors`` and ``allocate_per_req_cache``, and each layer's cache is its
``build_kv_cache_tensor`` for a module of the layer's kind (a linear-attention layer's: views
of its conv and temporal state, first axis the slots). Stubbed: the CUDA device and the model.

The stand-in forward writes each token's K and V in every full-attention layer as ``kvmodel``
does, for this builder's token-major blocks, and keeps in each linear-attention layer's slot
(conv and temporal state) a function of every token the request has computed so far: a forward
checks the slot holds the state of the tokens before the ones it computes, then writes the
state after them. A decode's tokens equal a single engine's only when the KV and the whole
state arrived.
"""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import List, Optional, Tuple

import numpy as np
import torch

import kvmodel
from dsv4 import _bytes, _OnCpu, pool_plan, state_bytes

def is_gdn(hf_config) -> bool:
    """Whether ATOM's ``hf_config`` is a gated delta net hybrid's (Kimi's KDA included)."""
    return getattr(hf_config, "model_type", None) in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear")


class GdnCache:
    """One rank's gated delta net hybrid memory, as ATOM's builder makes it, and the forward."""

    def __init__(self, config, rank: int, world: int):
        from atom.config import set_current_atom_config
        from atom.model_ops.attentions.gdn_attn import GDNAttentionMetadataBuilder
        from atom.model_ops.attentions.kimi_mla_gdn_attn import KimiAiterMLAGDNMetadataBuilder

        set_current_atom_config(config)
        self.config, self.rank = config, rank
        self.hf = config.hf_config
        # Kimi's full-attention layers are MLA (one latent per token, whole on every rank).
        self.mla = self.hf.model_type == "kimi_linear"
        total = self.hf.num_key_value_heads
        self.heads = max(total // world, 1)
        self.runner = NS(config=config, block_size=config.kv_cache_block_size, kv_cache_dtype=config.kv_cache_dtype,
                         device="cpu", max_bs=config.max_num_seqs, model=None, num_spec_tokens=0,
                         max_num_batched_tokens=config.max_num_batched_tokens, forward_vars={},
                         _get_num_kv_heads=lambda: self.heads, num_kv_heads=self.heads,
                         _get_total_num_layers=lambda: self.hf.num_hidden_layers,
                         is_qwen_next=lambda: True, is_mimo_v2=lambda: False,
                         mtp_start_layer_idx=self.hf.num_hidden_layers)
        # Built as runner.KvRunner builds ATOM's MHA and MLA builders (their __init__ plans
        # aiter's kernels), then the builder's own GDN initialisation (which names the layers)
        # and, for Kimi, its own layer-to-row maps.
        b = object.__new__(KimiAiterMLAGDNMetadataBuilder if self.mla else GDNAttentionMetadataBuilder)
        b.model_runner = self.runner
        bs = config.kv_cache_block_size
        b.block_size = 1 if self.mla else (bs if bs in (256, 1024) else 16)
        b.block_ratio = bs // b.block_size
        b.max_bs, b.device = config.max_num_seqs, "cpu"
        with _OnCpu():
            b._init_gdn_state(self.runner)
        r = self.runner
        if self.mla:
            self.full, self.linear = list(r.full_attention_layers), list(r.kda_attention_layers)
            b.mla_idx_by_layer = {layer: i for i, layer in enumerate(self.full)}
            b.kda_idx_by_layer = {layer: i for i, layer in enumerate(self.linear)}
        else:
            interval = r.full_attention_interval
            self.full = [i for i in range(self.hf.num_hidden_layers) if i % interval == interval - 1]
            self.linear = [i for i in range(self.hf.num_hidden_layers) if i % interval != interval - 1]
        self.builder = b
        r.physical_block_size = b.block_size

    def num_blocks(self) -> dict:
        """``ModelRunner.get_num_blocks``'s answer (``dsv4.pool_plan``)."""
        return pool_plan(self.builder, self.runner, self.config)

    def allocate(self, num_blocks: int):
        """``ModelRunner.allocate_kv_cache``'s pools and each layer's cache, by ATOM's builder;
        returns (the layers' caches, the transfer tensors)."""
        r, b = self.runner, self.builder
        r.num_physical_kvcache_blocks = num_blocks * b.block_ratio
        with _OnCpu():
            for name, value in b.allocate_kv_cache_tensors(self.heads, 0).items():
                setattr(r, name, value)
            for name, value in b.allocate_per_req_cache(r.pool_plan.entries).items():
                setattr(r, name, value)
        layers = {}
        for i in range(self.hf.num_hidden_layers):
            if i in self.linear:
                module = NS(base_linear_attention=object())
            else:
                module = NS(base_attention=object(), use_mla=self.mla, k_scale=None, v_scale=None, indexer=None)
            layers[f"layer_{i}"] = b.build_kv_cache_tensor(i, module)
        self.layers = layers
        return layers, b.get_kv_transfer_tensors()

    # -- the stand-in forward ---------------------------------------------------------------
    def _slots(self, table, positions):
        pbs, ratio, bs = self.builder.block_size, self.builder.block_ratio, self.config.kv_cache_block_size
        blocks = torch.tensor([table[p // bs] for p in positions.tolist()], dtype=torch.int64)
        inner = positions % bs
        return blocks * ratio + inner // pbs, inner % pbs

    def _global_heads(self):
        return torch.arange(self.heads, dtype=torch.int64) + self.rank * self.heads

    def _latents(self, layer: int):
        t = self.layers[f"layer_{layer}"].k_cache
        return t.view(-1, self.builder.block_size, t.shape[-1])

    def write(self, table: List[int], tok: torch.Tensor, positions: torch.Tensor) -> None:
        """K and V of these tokens in every full-attention layer (the builder's views: K
        ``[blocks, H, D/x, rows, x]``, V ``[blocks, H, rows/x, D, x]``; Kimi's, a latent per
        token)."""
        pb, row = self._slots(table, positions)
        if self.mla:
            for layer in self.full:
                cache = self._latents(layer)
                v = kvmodel.encode(torch, tok, kvmodel.latent_offsets(torch, positions, layer, cache.shape[-1]), kvmodel.MOD)
                cache[pb, row] = v.to(cache.dtype)
            return
        h, dim = self._global_heads(), self.hf.head_dim
        for layer in self.full:
            t = self.layers[f"layer_{layer}"]
            x = t.k_cache.shape[-1]
            for kv, cache in ((0, t.k_cache), (1, t.v_cache)):
                v = kvmodel.encode(torch, tok, kvmodel.kv_offsets(torch, positions, layer, kv, h, dim), kvmodel.MOD)
                v = v.to(cache.dtype)
                if kv == 0:
                    cache[pb, :, :, row, :] = v.view(len(pb), len(h), -1, x)
                else:
                    cache[pb, :, row // x, :, row % x] = v

    def read_tokens(self, table: List[int], ctx: int) -> Tuple[Optional[List[int]], Optional[str]]:
        """The context's tokens, from the first full layer's K, every K and V element checked."""
        positions = torch.arange(ctx)
        pb, row = self._slots(table, positions)
        if self.mla:
            return self._read_latents(pb, row, positions)
        h, dim = self._global_heads(), self.hf.head_dim
        first = self.layers[f"layer_{self.full[0]}"].k_cache
        got = first[pb, 0, 0, row, :2].to(torch.int64)
        off = kvmodel.kv_offsets(torch, positions, self.full[0], 0, h[:1], 2)[:, 0]
        tok = kvmodel.decode(got[:, 0], got[:, 1], off[:, 0], off[:, 1], kvmodel.MOD)
        for layer in self.full:
            t = self.layers[f"layer_{layer}"]
            for kv, cache in ((0, t.k_cache), (1, t.v_cache)):
                want = kvmodel.encode(torch, tok, kvmodel.kv_offsets(torch, positions, layer, kv, h, dim), kvmodel.MOD)
                if kv == 0:
                    have = cache[pb, :, :, row, :].reshape(len(pb), len(h), -1)
                else:
                    have = cache[pb, :, row // cache.shape[-1], :, row % cache.shape[-1]]
                if not torch.equal(have.to(torch.int64), want):
                    return None, f"layer {layer} {'KV'[kv]}"
        return tok.tolist(), None

    def _read_latents(self, pb, row, positions) -> Tuple[Optional[List[int]], Optional[str]]:
        """The context's tokens from the first full layer's latents, every latent checked."""
        first = self._latents(self.full[0])
        got = first[pb, row, :2].to(torch.int64)
        off = kvmodel.latent_offsets(torch, positions, self.full[0], 2)
        tok = kvmodel.decode(got[:, 0], got[:, 1], off[:, 0], off[:, 1], kvmodel.MOD)
        for layer in self.full:
            cache = self._latents(layer)
            want = kvmodel.encode(torch, tok, kvmodel.latent_offsets(torch, positions, layer, cache.shape[-1]), kvmodel.MOD)
            if not torch.equal(cache[pb, row].to(torch.int64), want):
                return None, f"layer {layer} latent"
        return tok.tolist(), None

    def _state_views(self, slot: int):
        for n, layer in enumerate(self.linear):
            t = self.layers[f"layer_{layer}"]
            for k, part in enumerate((t.k_cache, t.v_cache)):
                unit = part[0].numel() * part.element_size()
                yield 2 * n + k, _bytes(part.data_ptr() + slot * unit, unit)

    def state_ok(self, slot: int, tokens: List[int]) -> bool:
        """Whether every linear layer's conv and temporal state is the one after ``tokens``."""
        return all(np.array_equal(v, state_bytes(tokens, k, len(v))) for k, v in self._state_views(slot))

    def write_state(self, slot: int, tokens: List[int]) -> None:
        """The state after ``tokens``, into every linear layer's conv and temporal state."""
        for k, v in self._state_views(slot):
            v[:] = state_bytes(tokens, k, len(v))
