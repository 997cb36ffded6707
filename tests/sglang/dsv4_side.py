"""DeepSeek-V4's pools in the SGLang pair (``sglang_side``): SGLang's own memory for the model,
and a stand-in forward that writes every byte the transfer must move.

The pool is what SGLang builds for ``DeepseekV4ForCausalLM`` on this platform: its
``DSV4PoolConfigurator`` sizes it (a KV cache of ``FULL_TOKENS`` tokens, as its memory
budget would give), its ``KVCacheConfigurator._build_dsv4_kv_pool`` builds the
``DeepSeekV4TokenToKVPool`` (compressed MLA per 4 and per 128 tokens, the C4 indexer's keys,
the sliding-window caches, the compressors' states and the request-scoped C128 state), and
the allocator is the one its configurator picks for a paged sliding window
(``SWATokenToKVPoolAllocator``). Stubbed: the configurator's object (a namespace of the
fields those two methods read) and the model (no weights: SGLang builds no layer for a pool).

The buffers and the rows of a request come from SGLang too: the regions are the backend's
``KVArgs`` as SGLang's own ``setup_state_kv_args`` filled them (KV pages, then each state
component), and the rows are what SGLang's ``send_kv_chunk`` names to the sender on the
prefill and what ``DecodePreallocQueue`` names to the receiver on the decode. The prefill's
stand-in forward writes, just before SGLang hands a chunk to the backend, every byte of each
row it names: a function of (room, region, the row's place in the request, byte). The decode
checks every byte of each row it named. A region left out, a row shifted or a state component
dropped leaves bytes that do not match.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace as NS
from typing import Any, Dict, List, Sequence, Tuple

import torch

#: The test models (tests/vllm/models) whose pools this module builds.
MODELS = ("deepseek-v4-flash",)
#: SGLang requires 256-token pages for DeepSeek-V4's paged sliding window.
PAGE = 256
#: The KV cache's tokens (full attention), as a memory budget would size it; SGLang gives the
#: sliding window a tenth of them, enough for the harness's requests all prefilled at once.
FULL_TOKENS = 65536


def is_dsv4(config) -> bool:
    """Whether SGLang's ``ModelConfig`` is DeepSeek-V4's (compressed attention)."""
    archs = getattr(config.hf_config, "architectures", None) or []
    return any("DeepseekV4" in str(a) for a in archs)


def kv_pool(config, r2t, role: str):
    """SGLang's DeepSeek-V4 pool for ``config`` and its allocator, sized by SGLang."""
    from sglang.srt.mem_cache import kv_cache_configurator as K
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.model_executor.pool_configurator import DSV4PoolConfigurator
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    layers = NS(start_layer=0, end_layer=config.num_hidden_layers, num_effective_layers=config.num_hidden_layers)
    kvc = NS(kv_cache_dtype_str="auto", model_config=config, spec_algorithm=SpeculativeAlgorithm.from_string(None),
             layer_info=layers, pp_size=1, pp_group=None, sliding_window_size=config.window_size, page_size=PAGE,
             attn_dp_size=1, spec_aux_config=None)
    sizing = DSV4PoolConfigurator(kvc)
    cfg = sizing._to_config(sizing._compute_dsv4_sizes(FULL_TOKENS, PAGE))
    cfg.max_running_requests = r2t.req_to_token.shape[0] - 1
    cfg = sizing.finalize_with_max_running_requests(cfg)
    c4_dtype, c128_dtype = K._get_dsv4_compress_state_dtypes()
    # DeepSeek-V4 resolves --kv-cache-dtype auto to fp8_e4m3 (SGLang's model overrides).
    builder = NS(is_draft_worker=False, model_config=config, spec_algorithm=kvc.spec_algorithm,
                 pool_page_size=PAGE, kv_cache_dtype=torch.float8_e4m3fn, layer_info=layers, device="cpu")
    pool = K.KVCacheConfigurator._build_dsv4_kv_pool(
        builder, max_running_requests=cfg.max_running_requests,
        full_max_total_num_tokens=cfg.full_max_total_num_tokens,
        swa_max_total_num_tokens=cfg.swa_max_total_num_tokens,
        c4_max_total_num_tokens=cfg.c4_max_total_num_tokens,
        c128_max_total_num_tokens=cfg.c128_max_total_num_tokens, c4_state_pool_size=cfg.c4_state_pool_size,
        c128_state_pool_size=cfg.c128_state_pool_size, c4_state_dtype=c4_dtype, c128_state_dtype=c128_dtype,
        req_to_token_pool=r2t)
    assert pool.needs_paged_swa_allocator, "this harness drives DeepSeek-V4's paged sliding window"
    alloc = SWATokenToKVPoolAllocator(cfg.full_max_total_num_tokens, cfg.swa_max_total_num_tokens, page_size=PAGE,
                                      dtype=torch.float8_e4m3fn, device="cpu", kvcache=pool, need_sort=False,
                                      req_to_token_pool=r2t)
    return pool, alloc


Region = Tuple[int, int, int]  # (address, bytes, bytes per row)


def regions(kv_args) -> List[List[Region]]:
    """The backend's buffers as SGLang described them: the KV pages' regions, then each state
    component's (in ``kv_args.state_types`` order)."""
    out = [list(zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens))]
    for ptrs, lens, items in zip(kv_args.state_data_ptrs, kv_args.state_data_lens, kv_args.state_item_lens):
        out.append(list(zip(ptrs, lens, items)))
    return out


def _pattern(room: int, component: int, region: int, place: int, n: int) -> bytes:
    """The ``n`` bytes of one row: a function of the request, the region and the row's place."""
    base = (room % 97) * 31 + component * 53 + region * 17 + place * 7
    return ((torch.arange(n, dtype=torch.int64) + base) % 251).to(torch.uint8).numpy().tobytes()


def _row(reg: Region, row: int) -> int:
    addr, size, item = reg
    if not 0 <= row < size // item:
        raise IndexError(f"row {row} outside a region of {size // item} rows")
    return addr + row * item


def _write(reg: Region, row: int, data: bytes) -> None:
    # The region is memory SGLang's pool owns on the CPU; the row is inside it (checked).
    ctypes.memmove(_row(reg, row), data, len(data))


def _read(reg: Region, row: int) -> bytes:
    return ctypes.string_at(_row(reg, row), reg[2])


def _indices(x: Any) -> List[int]:
    return [] if x is None else [int(v) for v in torch.as_tensor(x).reshape(-1).tolist()]


def forward_on_send(sender, room: int, space: List[List[Region]]) -> None:
    """Wraps the request's sender: each chunk SGLang hands it has its rows written first, KV
    pages by their place in the request, state rows by their place in the payload."""
    send, sent = sender.send, [0]

    def writing_send(kv_indices, state_indices=None, *args: Any, **kw: Any):
        pages = _indices(kv_indices)
        for k, reg in enumerate(space[0]):
            for i, page in enumerate(pages):
                _write(reg, page, _pattern(room, 0, k, sent[0] + i, reg[2]))
        sent[0] += len(pages)
        for c, rows in enumerate(state_indices or []):
            for k, reg in enumerate(space[1 + c]):
                for i, row in enumerate(_indices(rows)):
                    _write(reg, row, _pattern(room, 1 + c, k, i, reg[2]))
        return send(kv_indices, state_indices, *args, **kw)

    sender.send = writing_send


def record_rows(receiver, into: Dict[str, Any]) -> None:
    """Wraps the request's receiver: the rows SGLang names for it are kept in ``into``."""
    send_metadata = receiver.send_metadata

    def recording(kv_indices, aux_index=None, state_indices=None, *args: Any, **kw: Any):
        into["pages"] = _indices(kv_indices)
        into["states"] = [_indices(s) for s in (state_indices or [])]
        return send_metadata(kv_indices, aux_index, state_indices, *args, **kw)

    receiver.send_metadata = recording


def wrong_rows(space: List[List[Region]], room: int, rows: Dict[str, Any], types: Sequence[Any]) -> List[str]:
    """What of the request's rows on this decode is not what the prefill wrote: one entry per
    region with a wrong or missing row."""
    if "pages" not in rows:
        return ["the receiver was never given its rows"]
    bad = []
    lists = [rows["pages"]] + list(rows["states"])
    names = ["KV"] + [str(getattr(t, "value", t)) for t in types]
    if not rows["pages"]:
        bad.append("KV: no pages named")
    # A state component may name no rows (the C128 state of a prompt that ends on a group of
    # 128 tokens keeps none): its rows are checked where SGLang named some.
    for c, listed in enumerate(lists):
        for k, reg in enumerate(space[c] if c < len(space) else []):
            for i, row in enumerate(listed):
                if _read(reg, row) != _pattern(room, c, k, i, reg[2]):
                    bad.append(f"{names[c]} region {k} row {i} (of {len(listed)})")
                    break
    return bad
