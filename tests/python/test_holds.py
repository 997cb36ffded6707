"""Holds on the prefill side as a reader sees them: a reader gone for its whole lease frees its
prefill's blocks, and a read made for an earlier hold of a reused request id is never
confirmed (hold tokens)."""

import time

import pytest

import kvlink
from kv_layout import make_caches
from test_kvlink import _pair, _until


def test_a_gone_readers_hold_ends_after_its_lease():
    prefill = kvlink.Engine(lease=0.5)
    prefill.register_kv_caches(make_caches(2, 8, 256, 9), 16, "bf16")
    decode = kvlink.Engine()
    decode.register_kv_caches(make_caches(2, 8, 256, 0), 16, "bf16")
    prefill.hold_blocks("first", [1])
    prefill.hold_blocks("second", [2, 3], reader=decode.engine_id)
    decode.read_blocks(prefill.handshake_address, "first", [0], [1])
    _until(decode, lambda f: f.receiving)
    _until(prefill, lambda f: f.sending)
    # The decode goes away before reading the second request: its control connection closes.
    decode.close()
    gone = time.monotonic()
    f, _ = _until(prefill, lambda f: f.failed, limit=10.0)
    took = time.monotonic() - gone
    (failure,) = f.failures
    assert failure["id"] == "second" and failure["cause"] == "expired", failure
    assert "lease" in failure["reason"] and decode.engine_id in failure["reason"], failure
    assert 0.4 < took < 5.0, took
    s = prefill.stats()
    assert (s["sends_expired"], s["sends_lease_expired"]) == (1, 1), s
    with pytest.raises(kvlink.InvalidArgument, match="lease"):
        kvlink.Engine(lease=0.0)


def test_a_reused_request_id_never_confirms_a_read_of_its_earlier_hold():
    prefill, decode = _pair()
    first = prefill.hold_blocks("reused", [2])
    assert isinstance(first, int) and first != 0
    assert prefill.release("reused")
    second = prefill.hold_blocks("reused", [2], token=first + 100)
    assert second == first + 100
    # A read made for the first hold: its bytes are served (the id is held again, over the same
    # blocks), but only the hold it names could confirm it, and that one ended.
    decode.read_blocks(prefill.handshake_address, "reused", [0], [2], hold=first)
    f, _ = _until(decode, lambda f: f.receiving or f.failed)
    assert not f.receiving, f
    assert f.failures[0]["cause"] == "unconfirmed" and "another hold" in f.failures[0]["reason"], f.failures
    assert prefill.in_flight() == (0, 1), "the new hold is untouched"
    decode.read_blocks(prefill.handshake_address, "reused", [0], [2], hold=second)
    f, _ = _until(decode, lambda f: f.receiving or f.failed)
    assert f.receiving == ["reused"], f.failures
    with pytest.raises(kvlink.InvalidArgument, match="never 0"):
        prefill.hold_blocks("zero", [3], token=0)


def _pair_with_caches():
    """A prefill and a decode of two layers, 8 blocks, with the arrays they registered."""
    p_caches, d_caches = make_caches(2, 8, 256, 9), make_caches(2, 8, 256, 0)
    prefill, decode = kvlink.Engine(), kvlink.Engine()
    prefill.register_kv_caches(p_caches, 16, "bf16")
    decode.register_kv_caches(d_caches, 16, "bf16")
    return prefill, decode, p_caches, d_caches


def test_a_progressive_read_follows_a_growing_hold_from_python():
    prefill, decode, p_caches, d_caches = _pair_with_caches()
    # The decode follows before the prefill holds anything; each part is read as it is held.
    decode.follow_blocks(prefill.handshake_address, "grow", [0, 1, 2], part_timeout=10.0)
    token = prefill.hold_growing("grow", [5])
    prefill.extend_hold("grow", [3])
    deadline = time.monotonic() + 10.0
    while not all((d[1] == p[3]).all() for d, p in zip(d_caches, p_caches)):
        assert time.monotonic() < deadline, "the second part was never read"
        time.sleep(0.01)
    assert not decode.wait_finished(0.2).receiving, "received before the seal"
    prefill.extend_hold("grow", [7])
    with pytest.raises(kvlink.InvalidArgument, match="already"):
        prefill.extend_hold("grow", [7])
    prefill.seal_hold("grow")
    f, _ = _until(decode, lambda f: f.receiving or f.failed)
    assert f.receiving == ["grow"], f.failures
    for d, p in zip(d_caches, p_caches):
        assert (d[[0, 1, 2]] == p[[5, 3, 7]]).all()
    _until(prefill, lambda f: f.sending == ["grow"])
    assert token != 0
    # A part that never comes fails the read at its timeout.
    decode.follow_blocks(prefill.handshake_address, "late", [4], first_part_timeout=0.3)
    f, _ = _until(decode, lambda f: f.failed)
    assert f.failures[0]["cause"] == "expired" and "first part" in f.failures[0]["reason"], f.failures


def test_a_growing_hold_made_final_a_group_of_layers_at_a_time_from_python():
    prefill, decode, p_caches, d_caches = _pair_with_caches()
    decode.follow_blocks(prefill.handshake_address, "layers", [0, 1])
    prefill.hold_growing("layers", [])
    # Four tensors (two layers, K and V): the first layer's final, then the second's.
    prefill.extend_hold("layers", [6, 2], tensors=(0, 2))
    deadline = time.monotonic() + 10.0
    while not all((d_caches[t][[0, 1]] == p_caches[t][[6, 2]]).all() for t in (0, 1)):
        assert time.monotonic() < deadline, "the first layer was never read"
        time.sleep(0.01)
    assert all((d_caches[t][[0, 1]] == 0).all() for t in (2, 3)), "read before it was final"
    with pytest.raises(kvlink.InvalidArgument, match="to come"):
        prefill.seal_hold("layers")
    prefill.extend_hold("layers", [], tensors=(2, 4))
    prefill.seal_hold("layers")
    f, _ = _until(decode, lambda f: f.receiving or f.failed)
    assert f.receiving == ["layers"], f.failures
    for d, p in zip(d_caches, p_caches):
        assert (d[[0, 1]] == p[[6, 2]]).all()
