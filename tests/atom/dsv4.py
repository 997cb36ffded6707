"""DeepSeek-V4's memory in the ATOM stand-in runner (``runner.KvRunner``): ATOM's own
``DeepseekV4AttentionMetadataBuilder`` builds it and describes it, the stand-in forward writes
and checks every byte the transfer must move.

The builder is ATOM's, built by its own ``__init__`` over a stand-in of the ``ModelRunner``
fields it reads (no model: DeepSeek-V4's builder asks the model's modules only for windows of a
dtype of their own, which this configuration has none of); the pools are sized by ATOM's
``sub_pool_specs`` and ``plan_pools`` (the PAGE class, 256-token blocks, and one STATE slot per
sequence), the state runtime is what ``ModelRunner.get_num_blocks`` builds from them, and
``allocate_kv_cache_tensors``, ``allocate_per_req_cache`` and ``get_kv_transfer_tensors`` are
the builder's. Stubbed: the CUDA device (its tensors land on the CPU) and the model.

The stand-in forward treats each PAGE unit (a block of every PAGE region) as ``rows x 256``
bytes, column ``j`` holding position ``j`` of the block: ``(token + 7 region + 13 byte) % 251``.
A request's SLOT unit (every SLOT region, at its ``per_req_cache_group``) holds a function of
every token the request has computed so far, as a compressor's and a window's state would: a
forward checks it is the state of the tokens before the ones it computes, then writes the state
after them. So a decode generates the prefill's tokens only when every PAGE byte and its whole
state arrived from the prefill; a state left behind (or another request's) poisons its tokens.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace as NS
from typing import List, Optional, Tuple

import numpy as np
import torch

import kvmodel

#: ATOM's DeepSeek-V4 blocks: 256 tokens (its builder's own block).
BLOCK_SIZE = 256
#: PAGE blocks the stand-in's budget holds beside a STATE slot per sequence.
PAGE_BLOCKS = 48


def is_dsv4(hf_config) -> bool:
    """Whether ATOM's ``hf_config`` is DeepSeek-V4's."""
    return getattr(hf_config, "model_type", None) == "deepseek_v4"


def _cpu(fn):
    def call(*a, **kw):
        kw.pop("device", None)
        kw.pop("pin_memory", None)
        return fn(*a, **kw)

    return call


class _OnCpu:
    """``torch.zeros`` / ``torch.empty`` on the CPU while ATOM's builder allocates."""

    def __enter__(self):
        self.saved = torch.zeros, torch.empty
        torch.zeros, torch.empty = _cpu(self.saved[0]), _cpu(self.saved[1])

    def __exit__(self, *exc):
        torch.zeros, torch.empty = self.saved


def _bytes(addr: int, size: int) -> np.ndarray:
    """A writable view of ``size`` bytes ATOM's pool owns at ``addr`` (alive as long as it)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))


def state_bytes(tokens: List[int], k: int, n: int) -> np.ndarray:
    """The ``n`` bytes of state part ``k`` after ``tokens``: a function of every one of them."""
    s = kvmodel.next_token(tokens) if tokens else 0
    return ((s + 11 * k + 3 * np.arange(n)) % 251).astype(np.uint8)


def pool_plan(builder, runner, config) -> dict:
    """``ModelRunner.get_num_blocks``'s answer for ``builder``: ATOM's pool plan for a budget of
    ``PAGE_BLOCKS`` blocks beside a STATE slot per sequence, and the state runtime it builds
    from the builder's state transfer (with the PAGE-copy checkpoint spec where it copies).
    Leaves the plan and the runtime on ``runner``, as ``ModelRunner`` keeps them."""
    from atom.model_engine.kv_block import STATE_SLOT_CLASS
    from atom.model_engine.page_unit_checkpoint import PagedStateCheckpointSpec
    from atom.model_engine.state_runtime import StateRuntime
    from atom.model_ops.attentions.sub_pool_spec import Pool, plan_pools

    specs = builder.sub_pool_specs()
    seqs = config.max_num_seqs
    budget = sum(s.entry_bytes * (seqs if s.pool is Pool.STATE else PAGE_BLOCKS) for s in specs)
    plan = plan_pools(specs, budget, seqs)
    transfer = builder.state_transfer()
    spec = None
    if transfer.copies:
        slot_bytes = int(plan.entry_bytes[STATE_SLOT_CLASS])
        narrowed = builder.checkpoint_image_bytes()
        spec = PagedStateCheckpointSpec(page_unit_bytes=int(plan.entry_bytes[plan.paged_class]), slot_bytes=slot_bytes,
                                        image_bytes=slot_bytes if narrowed is None else int(narrowed),
                                        layout_id=transfer.paged_layout_id)
    runner.pool_plan = plan
    runner.state_runtime = StateRuntime(transfer=transfer, checkpoint_spec=spec)
    config.pool_entries = dict(plan.entries)
    config.pool_entries_per_req = dict(plan.entries_per_req)
    return {"num_kvcache_blocks": plan.paged_entries, "pool_entries": dict(plan.entries),
            "pool_entries_per_req": dict(plan.entries_per_req), "state_runtime": runner.state_runtime.to_wire()}


class V4Cache:
    """One rank's DeepSeek-V4 memory, as ATOM's builder makes it, and the stand-in forward."""

    def __init__(self, config):
        from atom.config import set_current_atom_config
        from atom.model_ops.attentions.deepseek_v4_attn import DeepseekV4AttentionMetadataBuilder

        set_current_atom_config(config)
        self.config = config
        self.runner = NS(config=config, block_size=config.kv_cache_block_size, kv_cache_dtype=config.kv_cache_dtype,
                         device="cpu", max_bs=config.max_num_seqs, model=None,
                         max_num_batched_tokens=config.max_num_batched_tokens, forward_vars={})
        with _OnCpu():
            self.builder = DeepseekV4AttentionMetadataBuilder(self.runner)
        self.pages: List[np.ndarray] = []
        self.slots: List[Tuple[int, int, int, bool]] = []

    def num_blocks(self) -> dict:
        """``ModelRunner.get_num_blocks``'s answer (``pool_plan``)."""
        return pool_plan(self.builder, self.runner, self.config)

    def allocate(self, num_blocks: int):
        """``ModelRunner.allocate_kv_cache``'s pools, by ATOM's builder; returns (the layers'
        caches: none, the layers bind views of the pools nothing here reads; the transfer
        tensors)."""
        r, b = self.runner, self.builder
        r.num_physical_kvcache_blocks = num_blocks * b.block_ratio
        with _OnCpu():
            for name, value in b.allocate_kv_cache_tensors(1, 0).items():
                setattr(r, name, value)
            for name, value in b.allocate_per_req_cache(r.pool_plan.entries).items():
                setattr(r, name, value)
        tensors = b.get_kv_transfer_tensors()
        self.pages = [_bytes(g.base_addr, g.total_bytes).reshape(num_blocks, g.unit_bytes // BLOCK_SIZE, BLOCK_SIZE)
                      for g in tensors.block_regions]
        self.slots = [(g.base_addr, g.total_bytes, g.unit_bytes, g.reverse_indexed) for g in tensors.swa_block_regions]
        self.num_slots = tensors.num_slots
        return {}, tensors

    # -- the stand-in forward ---------------------------------------------------------------
    def write(self, table: List[int], tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Every PAGE byte of these positions (every region, every row of their columns)."""
        for k, pages in enumerate(self.pages):
            rows = pages.shape[1]
            for t, p in zip(tokens.tolist(), positions.tolist()):
                j = p % BLOCK_SIZE
                idx = np.arange(rows) * BLOCK_SIZE + j
                pages[table[p // BLOCK_SIZE], :, j] = (t + 7 * k + 13 * idx) % 251

    def read_tokens(self, table: List[int], ctx: int) -> Tuple[Optional[List[int]], Optional[str]]:
        """The ``ctx`` positions' tokens, from region 0's first row, every PAGE byte checked."""
        pos = np.arange(ctx)
        blocks = np.array([table[p // BLOCK_SIZE] for p in pos])
        cols = pos % BLOCK_SIZE
        tok = (self.pages[0][blocks, 0, cols].astype(np.int64) - 13 * cols) % 251
        for k, pages in enumerate(self.pages):
            rows = pages.shape[1]
            idx = np.arange(rows)[None, :] * BLOCK_SIZE + cols[:, None]
            want = (tok[:, None] + 7 * k + 13 * idx) % 251
            if not np.array_equal(pages[blocks, :, cols].astype(np.int64), want):
                return None, f"PAGE region {k}"
        return tok.tolist(), None

    def _slot(self, region: Tuple[int, int, int, bool], slot: int) -> np.ndarray:
        addr, size, unit, reverse = region
        unit_index = self.num_slots - 1 - slot if reverse else slot
        return _bytes(addr + unit_index * unit, unit)

    def state_ok(self, slot: int, tokens: List[int]) -> bool:
        """Whether the slot holds the state after ``tokens`` in every SLOT region."""
        return all(np.array_equal(self._slot(g, slot), state_bytes(tokens, k, g[2])) for k, g in enumerate(self.slots))

    def write_state(self, slot: int, tokens: List[int]) -> None:
        """The state after ``tokens``, into the slot of every SLOT region."""
        for k, g in enumerate(self.slots):
            self._slot(g, slot)[:] = state_bytes(tokens, k, g[2])
