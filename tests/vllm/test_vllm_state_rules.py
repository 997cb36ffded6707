"""The connector's rules for Mamba-kind state groups on vLLM's own objects, without engines:
which block holds a request's running state (against vLLM's ``clip_ssm_state_blocks``), how a
state group's read pairs, the prefill's one-token back-off on a real vLLM ``Request``, and how a
state page splits into TP-sharded pieces (on specs from vLLM's own state shape calculator). The
transfers themselves are in test_vllm_memory.py. And which KV cache kinds the connector
refuses at start, on the specs of vLLM's own layers."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from types import SimpleNamespace

# vLLM's CPU platform, as the engines of the other tests run under (harness.py).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvlink.vllm.scheduler import _group_specs, _pair_state, _running_state, _SchedulerSide  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "blocks, scratch",
    [
        ([7], 0),  # mode "none": the state block alone
        ([7, 8, 9], 2),  # mode "none" with two speculative scratch blocks after it
        ([0, 0, 12, 13, 14], 2),  # mode "align": nulls before the running state, scratch after
        ([0, 0, 12], 0),
        ([5], 2),  # scratch not allocated yet
        ([], 1),
    ],
)
def test_the_running_state_block_is_the_one_vllm_names(blocks, scratch):
    assert _running_state(blocks, scratch) == clip_ssm_state_blocks(list(blocks), scratch)


def test_a_state_group_reads_one_block_from_one_block():
    assert _pair_state([0, 3, 4], [0, 0, 9], 1) == ([3], [9])
    assert "needs one block on each side; the prefill sent 2" in _pair_state([3], [8, 9], 0)
    assert "this engine has []" in _pair_state([], [9], 0)


def _request(rid: str, params: dict | None) -> Request:
    r = Request(
        request_id=rid,
        prompt_token_ids=list(range(100, 110)),
        sampling_params=SamplingParams(max_tokens=5),
        pooling_params=None,
    )
    r.kv_transfer_params = params
    return r


def _side(backoff: int) -> _SchedulerSide:
    side = _SchedulerSide.__new__(_SchedulerSide)  # the rule reads only the back-off
    side.backoff = backoff
    return side


def test_a_prefill_for_a_remote_decode_stops_one_token_short_once():
    r = _request("p", {"do_remote_decode": True})
    side = _side(1)
    side.on_new_request(r)
    side.on_new_request(r)  # back again after a preemption: not cut twice
    assert r.num_prompt_tokens == 9 and r.prompt_token_ids == list(range(100, 109))
    assert list(r.all_token_ids) == list(range(100, 109)) and r.num_tokens == 9
    assert r.max_tokens == 1


@pytest.mark.parametrize(
    "params, backoff",
    [(None, 1), ({"do_remote_prefill": True}, 1), ({"do_remote_decode": True}, 0)],
    ids=["local", "decode", "no-state"],
)
def test_other_requests_keep_their_prompt(params, backoff):
    r = _request("x", params)
    _side(backoff).on_new_request(r)
    assert r.num_prompt_tokens == 10 and r.max_tokens == 5


def _spec(kind: str, tp: int):
    """A MambaSpec as vLLM's layers make it, from vLLM's own state shape calculator: Mamba-2
    as Granite 4.0-H Tiny has it (one B/C group), or a gated delta net as Qwen3-Next's."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Calc
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as Kind
    from vllm.v1.kv_cache_interface import MambaSpec

    if kind == "mamba1":
        shapes = Calc.mamba1_state_shape(tp, 8192, 16, 4)
        mamba_type = Kind.MAMBA1
    elif kind == "mamba2":
        shapes = Calc.mamba2_state_shape(tp, 3072, 1, 48, 64, 128, 4)
        mamba_type = Kind.MAMBA2
    else:
        shapes = Calc.gated_delta_net_state_shape(tp, 16, 32, 128, 128, 4)
        mamba_type = Kind.GDN_ATTN
    return MambaSpec(block_size=16, shapes=tuple(shapes), dtypes=(torch.bfloat16,) * 2, mamba_type=mamba_type)


@pytest.fixture
def conv_layout(monkeypatch):
    """Sets VLLM_SSM_CONV_STATE_LAYOUT for one test (vLLM caches what it read)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    def set_to(value: str) -> None:
        monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", value)
        get_conv_state_layout.cache_clear()

    yield set_to
    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
    get_conv_state_layout.cache_clear()


@pytest.mark.parametrize("kind", ["mamba1", "mamba2", "gdn"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_state_parts_tile_the_page_and_halve_with_tp(conv_layout, kind, tp):
    """In the DS layout a state page splits into pieces that tile it exactly (no byte sent
    twice or left out), each declaring heads whose share per rank is what TP leaves it: the
    same totals at every TP size, the local counts divided by it (Mamba-2's one B/C group
    whole on every rank)."""
    from kvlink.vllm.layout import state_parts

    conv_layout("DS")
    hf = SimpleNamespace(n_groups=1)
    parts, why = state_parts(_spec(kind, tp), tp, hf)
    one, _ = state_parts(_spec(kind, 1), 1, hf)
    assert why is None and parts is not None and one is not None
    at = 0
    for offset, size, _ in parts:
        assert offset == at
        at += size
    assert at == _spec(kind, tp).state_content_size_bytes
    for (_, size, (total, local)), (_, whole, (total1, local1)) in zip(parts, one):
        assert total == total1
        replicated = kind == "mamba2" and total == 1
        assert (local, size) == ((1, whole) if replicated else (local1 // tp, whole // tp))


def test_state_that_cannot_be_split_says_why(conv_layout):
    from kvlink.vllm.layout import state_parts

    conv_layout("SD")
    parts, why = state_parts(_spec("gdn", 2), 2, None)
    assert parts is None and why is not None and "VLLM_SSM_CONV_STATE_LAYOUT=DS" in why
    conv_layout("DS")
    # A model config whose B/C groups do not match the page's (3 groups, the page holds 1).
    parts, why = state_parts(_spec("mamba2", 1), 1, SimpleNamespace(n_groups=3))
    assert parts is None and why is not None and "not split evenly or replicated whole" in why
    whole = replace(_spec("gdn", 2), tp_replicated=True)
    assert state_parts(whole, 2, None) == ([(0, whole.state_content_size_bytes, None)], None)


def test_compressed_attention_layers_are_attention_read_whole():
    """DeepSeek-V4 Flash (``models/deepseek-v4-flash``): its compressed attention layers keep
    one latent per 4 or 128 tokens (``tokens_per_state``) in blocks still counted in tokens. On
    the specs vLLM's own layers make (the model built on the meta device), each layer in a group
    of its own, every group is taken as attention (the compressors' state caches as sliding
    windows), and exactly the compressed layers are the ones whose blocks are read whole
    (``compressed_layers``: no token runs, so engines of other block sizes are refused rather
    than cut a block of states by tokens). The transfer itself: test_vllm_memory.py."""
    from model_specs import model_dir, model_specs
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvlink.vllm.layout import compressed_layers

    mc = ModelConfig(model=model_dir("deepseek-v4-flash"), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048)
    config = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=16), device_config=DeviceConfig("cpu"))
    specs, _ = model_specs(config, 1)
    groups = [KVCacheGroupSpec([name], spec) for name, spec in specs.items()]
    kv_cache_config = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=groups)
    want = {name for name, spec in specs.items() if getattr(spec, "tokens_per_state", 1) > 1}
    assert want, "DeepSeek-V4's layers made no compressed attention spec"
    assert compressed_layers(kv_cache_config) == want
    kinds = _group_specs(kv_cache_config, 16)
    assert [k.block_size for k in kinds] == [spec.block_size for spec in specs.values()]
    for (name, spec), kind in zip(specs.items(), kinds):
        assert kind.window == (getattr(spec, "sliding_window", None) or 0), (name, kind)
        assert not kind.state and not kind.chunk, (name, kind)
