"""The ATOM connector's pieces in this process, against ATOM's own code: its factory, its
attention builders' KV transfer regions (allocated on the CPU by ``runner.KvRunner``), its port
layout, and what the connector refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest

import kvlink.atom
from harness import HERE, MODELS, snapshot_root
from kvlink.atom.layout import describe
from kvlink.atom.params import Refused, prefill_output, read_for
from kvlink import core
from kvlink.atom.settings import Settings


def atom_config(model, tp=1, block_size=16, kv=None, dtype="bf16", **extra):
    from atom.config import Config

    return Config(
        kv_cache_dtype=dtype,
        model=os.path.join(MODELS, model),
        kv_cache_block_size=block_size,
        tensor_parallel_size=tp,
        enforce_eager=True,
        kv_transfer_config=kv if kv is not None else {"kv_connector": "kvlink", "kv_role": "kv_consumer", "handshake_port": 7000},
        **extra,
    )


def test_registered_with_atoms_factory_without_pd_staging():
    from atom.kv_transfer.disaggregation.factory import KVConnectorFactory

    kvlink.atom.register()  # idempotent
    assert KVConnectorFactory.canonical_name("KVLink") == "kvlink"
    assert KVConnectorFactory.topology_uses_pd_staging({"kv_connector": "kvlink", "kv_role": "kv_producer"}) is False


@pytest.mark.parametrize("tp,block_size,dtype", [(1, 16, "bf16"), (2, 64, "bf16"), (2, 32, "fp8")])
def test_mha_regions_from_atoms_builder(tp, block_size, dtype):
    from runner import KvRunner

    cfg = atom_config("llama-3.1-8b", tp, block_size, dtype=dtype)
    r = KvRunner(0, cfg)
    tensors = r.kv_tensors(12)
    regions = describe(cfg, tensors, 12, tp)
    ratio, heads = block_size // 16, 8 // tp
    assert len(regions) == 4 * 4  # K, V per layer, then their scales
    k, scale = regions[0], regions[8]
    assert k.block_bytes == ratio * heads * 128 * 16 * (1 if dtype == "fp8" else 2) and k.heads == (8, heads, ratio)
    assert scale.block_bytes == ratio * heads * 16 * 4 and scale.heads == (8, heads, ratio)
    # Scheduler block b is physical blocks b*ratio .. b*ratio+ratio-1 of ATOM's own cache view.
    layer0 = r.layers["layer_0"]
    for b in (0, 5, 11):
        assert layer0.k_cache[b * ratio].data_ptr() == k.base_addr + b * k.block_bytes
        assert r.kv_scale[0, 0][b * ratio].data_ptr() == scale.base_addr + b * scale.block_bytes


def test_mla_regions_are_whole_on_every_rank():
    from runner import KvRunner

    cfg = atom_config("deepseek-v2-lite", 2, 16)
    r = KvRunner(1, cfg)
    regions = describe(cfg, r.kv_tensors(10), 10, 2)
    assert len(regions) == 4 and all(x.heads is None for x in regions)
    assert regions[0].block_bytes == 16 * 576 * 2


def test_partial_slot_state_and_pipeline_parallelism_refused():
    from atom.kv_transfer.disaggregation.types import KVTransferRegion, KVTransferTensors

    cfg = atom_config("llama-3.1-8b")
    region = KVTransferRegion(base_addr=4096, total_bytes=1 << 20, unit_bytes=1 << 16)
    slots = KVTransferTensors(block_regions=[region], slot_regions=[region], num_blocks=16, num_slots=4)
    with pytest.raises(ValueError, match="partial slot regions"):
        describe(cfg, slots, 16, 1)
    full = KVTransferTensors(block_regions=[region], slot_regions=[], swa_block_regions=[region], num_blocks=16,
                             num_slots=16, expected_full_slot_region_count=2)
    with pytest.raises(ValueError, match="expects 2 full SLOT regions and exported 1"):
        describe(cfg, full, 16, 1)
    pp = NS(kv_transfer_config={}, pipeline_parallel_size=2, hf_config=NS(architectures=[]))
    with pytest.raises(ValueError, match="pipeline parallelism"):
        Settings.from_config(pp)


def test_deepseek_v4_slot_regions_are_a_block_group_numbered_from_the_end():
    """DeepSeek-V4's memory from ATOM's own builder (``dsv4``): its PAGE regions are group 0,
    whole on every rank; its full SLOT region is group 1, one block a request's slot, the
    slot's state where ATOM's own ``unit_addr`` puts it (the region numbers from its end)."""
    from kvlink.atom.layout import slot_block
    from runner import KvRunner

    cfg = atom_config("deepseek-v4-flash", 2, 256, kv={"kv_connector": "kvlink", "kv_role": "kv_producer"},
                      max_num_seqs=8, max_num_batched_tokens=1024)
    r = KvRunner(0, cfg)
    n = r.get_num_blocks()["num_kvcache_blocks"]
    tensors = r.kv_tensors(n)
    regions = describe(cfg, tensors, n, 2)
    pages = [x for x in regions if x.group == 0]
    (state,) = [x for x in regions if x.group == 1]
    assert len(pages) == len(tensors.block_regions) == 2 and all(x.heads is None for x in regions)
    (unit,) = tensors.swa_block_regions
    assert state.num_blocks == tensors.num_slots == cfg.max_num_seqs and state.block_bytes == unit.unit_bytes
    for slot in range(tensors.num_slots):
        assert state.base_addr + slot_block(state, slot) * state.block_bytes == unit.unit_addr(slot)
    with pytest.raises(ValueError, match="outside"):
        slot_block(state, tensors.num_slots)
    Settings.from_config(cfg)  # its state is exported whole: not refused


def test_state_of_atoms_stateful_models_is_taken_and_of_others_refused(monkeypatch):
    """ATOM's own list of models with per-request state: kvlink moves the state of every type
    on the snapshot's list (Qwen3-Coder-Next read by ATOM's own Config; Kimi-Linear); a type a
    later ATOM adds to it is refused at start by its type, rather than its paged KV sent alone
    (the decode would continue from a wrong state)."""
    from atom.model_engine.llm_engine import InputOutputProcessor

    for model in ("qwen3-coder-next", "kimi-linear"):
        cfg = atom_config(model, kv={"kv_connector": "kvlink", "kv_role": "kv_producer"})
        assert cfg.hf_config.model_type in InputOutputProcessor._per_req_cache_model_types()
        Settings.from_config(cfg)
    listed = InputOutputProcessor._per_req_cache_model_types()
    monkeypatch.setattr(InputOutputProcessor, "_per_req_cache_model_types", staticmethod(lambda: listed | {"new_hybrid"}))
    later = NS(kv_transfer_config={"kv_role": "kv_producer"}, pipeline_parallel_size=1,
               hf_config=NS(architectures=["NewHybridForCausalLM"], model_type="new_hybrid"))
    with pytest.raises(ValueError, match="model type new_hybrid keeps per-request recurrent state"):
        Settings.from_config(later)


def test_settings_from_atoms_config_key_included(tmp_path):
    key = tmp_path / "key"
    key.write_bytes(b"a-deployment-key-of-32-bytes-000\n")
    kv = {
        "kv_connector": "kvlink",
        "kv_role": "kv_producer",
        "handshake_port": 7100,
        "kvlink_host": "10.1.2.3",
        "kvlink_transport": "tcp",
        "kvlink_request_timeout": 7,
        "kvlink_auth_key_file": str(key),
        "ib_device": "rxe0",
    }
    s = Settings.from_config(atom_config("llama-3.1-8b", kv=kv))
    assert (s.producer, s.handshake_port, s.block_size) == (True, 7100, 16)
    link = s.link
    assert (link.host, link.port, link.transport, link.request_timeout) == ("10.1.2.3", 7100, "tcp", 7.0)
    assert (link.auth_key, link.rdma_device, link.lease) == (b"a-deployment-key-of-32-bytes-000", "rxe0", None)
    # What the engine is given: only what was set (its own defaults for the rest).
    assert link.engine_options() == {
        "transport": "tcp",
        "request_timeout": 7.0,
        "auth_key": b"a-deployment-key-of-32-bytes-000",
        "rdma_device": "rxe0",
    }
    with pytest.raises(ValueError, match="kvlink_lease in kv_transfer_config must be"):
        Settings.from_config(atom_config("llama-3.1-8b", kv=dict(kv, kvlink_lease="soon")))
    with pytest.raises(ValueError, match="unknown kv_transfer_config keys"):
        Settings.from_config(atom_config("llama-3.1-8b", kv=dict(kv, kvlink_leese=5)))


def _settings(**kw):
    link = core.Settings(host="127.0.0.1", port=7000, transport="tcp", request_timeout=5.0, abort_timeout=5.0, lease=5.0)
    base = dict(producer=False, handshake_port=7000, link=link, block_size=16, tp_size=1, dp_size=1, dp_rank=0)
    base.update(kw)
    return Settings(**base)


def test_read_addresses_follow_atoms_port_layout_and_skip_cached_blocks():
    from atom.kv_transfer.disaggregation.port_offset import side_channel_port_offset

    seq = NS(id=3, num_prompt_tokens=40, block_table=[7, 8, 9], num_cached_tokens=16)
    params = {"remote_host": "10.0.0.5", "remote_handshake_port": 7000, "remote_tp_size": 4, "remote_dp_size": 4, "remote_dp_rank": 2,
              "remote_block_ids": [1, 2, 3], "transfer_id": 11, "kvlink_hold": 99}
    read = read_for(seq, params, _settings())
    assert read.addresses == [f"10.0.0.5:{7000 + side_channel_port_offset(2, r, 4, 0, 1, 4)}" for r in range(4)]
    assert read.addresses[0] == "10.0.0.5:7008"
    assert (read.local_blocks, read.remote_blocks, read.remote_id, read.hold, read.cached) == ([8, 9], [2, 3], "11", 99, 1)
    # ATOM's router renames the prefill's dp_rank to remote_dp_rank; either is read.
    params.pop("remote_dp_rank")
    params["dp_rank"] = 1
    assert read_for(seq, params, _settings()).addresses[0] == "10.0.0.5:7004"


@pytest.mark.parametrize("change,reason", [
    ({"kvlink_hold": None}, "kvlink_hold"),
    ({"remote_block_ids": [1, -2, 3]}, "remote_block_ids"),
    ({"remote_block_ids": [1, 2]}, "need 3 blocks; the prefill holds 2"),
    ({"remote_pp_size": 2}, "pipeline parallelism"),
    ({"remote_handshake_port": 65535, "remote_tp_size": 2}, "port range"),
    ({"remote_host": ""}, "remote_host"),
])
def test_unusable_parameters_are_refused_with_the_reason(change, reason):
    seq = NS(id=3, num_prompt_tokens=40, block_table=[7, 8, 9], num_cached_tokens=0)
    params = {"remote_host": "h", "remote_handshake_port": 7000, "tp_size": 1, "remote_block_ids": [1, 2, 3], "transfer_id": 11, "kvlink_hold": 99}
    params.update(change)
    if change.get("kvlink_hold", 0) is None:
        del params["kvlink_hold"]
    with pytest.raises(Refused, match=reason):
        read_for(seq, params, _settings())


def test_state_slots_pair_or_the_request_is_refused():
    """A model with per-request state: the decode reads the prefill's slot into its own; a slot
    on one side only (or a slot that is not one) is refused with the reason."""
    params = {"remote_host": "h", "remote_handshake_port": 7000, "tp_size": 1, "remote_block_ids": [1, 2, 3],
              "transfer_id": 11, "kvlink_hold": 99, "kvlink_slot": 5}
    stateful = NS(id=3, num_prompt_tokens=40, block_table=[7, 8, 9], num_cached_tokens=0, has_per_req_cache=True,
                  per_req_cache_group=2)
    read = read_for(stateful, params, _settings())
    assert (read.local_slot, read.remote_slot) == (2, 5)
    stateless = NS(id=3, num_prompt_tokens=40, block_table=[7, 8, 9], num_cached_tokens=0)
    with pytest.raises(Refused, match="state slot 5, this decode has None"):
        read_for(stateless, params, _settings())
    with pytest.raises(Refused, match="state slot None, this decode has 2"):
        read_for(stateful, dict(params, kvlink_slot=None), _settings())
    with pytest.raises(Refused, match="kvlink_slot=-1"):
        read_for(stateful, dict(params, kvlink_slot=-1), _settings())
    out = prefill_output(NS(id=5, output_tokens=[42]), _settings(producer=True), "10.0.0.1", [4, 5], 77, 3)
    assert out["kvlink_slot"] == 3


def test_prefill_parameters_carry_atoms_keys_and_the_hold():
    seq = NS(id=5, output_tokens=[42], spec_token_ids=[6, 7], prefix_cache_hit_tokens=16)
    out = prefill_output(seq, _settings(producer=True, tp_size=2, dp_rank=1, dp_size=2), "10.0.0.1", [4, 5], 77)
    mooncake = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_host", "remote_port",
                "remote_handshake_port", "tp_size", "dp_rank", "remote_pp_size", "transfer_id", "first_token_id", "draft_token_ids",
                "prefix_cache_hit_tokens"}
    assert mooncake <= set(out)
    assert (out["first_token_id"], out["draft_token_ids"], out["transfer_id"], out["kvlink_hold"]) == (42, [6, 7], 5, 77)
    assert (out["tp_size"], out["dp_rank"], out["remote_block_ids"]) == (2, 1, [4, 5])


def test_serve_runs_atoms_server_entry_point():
    """``python -m kvlink.atom.serve`` is ATOM's OpenAI server (its argument parser answers)."""
    code = "import stub, runpy, sys; sys.argv = ['kvlink.atom.serve', '--help']; runpy.run_module('kvlink.atom.serve', run_name='__main__')"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([snapshot_root(), HERE]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--kv-transfer-config" in out.stdout and "kvlink.atom.serve" in out.stdout


def test_decode_scheduler_gives_back_the_blocks_of_failed_and_aborted_reads():
    """ATOM's real Scheduler in this process, building the kvlink decode connector: a failed
    read falls back to a local prefill without a second allocation on top of the first (ATOM
    alone asserts there); a request aborted after its read failed, and one aborted while its
    read runs, give their blocks back (ATOM alone frees neither)."""
    from atom.kv_transfer.disaggregation.types import KVConnectorOutput
    from atom.model_engine.scheduler import Scheduler
    from atom.model_engine.sequence import Sequence, SequenceStatus
    from atom.sampling_params import SamplingParams

    cfg = atom_config("llama-3.1-8b")
    cfg.num_kvcache_blocks, cfg.eos_token_id = 16, 2
    s = Scheduler(cfg)
    free = lambda: s.block_manager.kv.num_free  # noqa: E731
    total = free()

    def parked(n):
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_handshake_port": 7000, "tp_size": 1,
                  "remote_block_ids": list(range(4)), "transfer_id": n, "kvlink_hold": 5}
        seq = Sequence(list(range(10, 50)), 16, SamplingParams(max_tokens=4, ignore_eos=True), kv_transfer_params=params)
        s.add(seq)
        assert list(s.schedule()[0].connector_meta_output.reads) == [seq.id]
        assert seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS and len(seq.block_table) == 3
        return seq

    a = parked(1)
    s._update_from_kv_xfer_finished(KVConnectorOutput(failed_recving={a.id}))
    batch, seqs = s.schedule()
    assert list(seqs) == [a.id] and a.status == SequenceStatus.RUNNING
    assert free() == total - len(a.block_table) == total - 3

    b = parked(2)
    s._update_from_kv_xfer_finished(KVConnectorOutput(failed_recving={b.id}))
    b.status = SequenceStatus.ABORTED  # what ATOM's abort_request does
    s.schedule()
    assert free() == total - 3

    c = parked(3)
    c.status = SequenceStatus.ABORTED
    batch, _ = s.schedule()
    assert batch.connector_meta_output.cancels == [c.id]
    assert free() == total - 6  # the read may still be writing into its blocks
    out = s.kv_connector.process_completions(KVConnectorOutput(failed_recving={c.id}))
    assert out.failed_recving == set() and free() == total - 3
    assert not any(s.kv_connector.get_statistics()["kvlink_pending"].values())
