"""Progressive transfers through two real vLLM Schedulers (``engine_process``): the decode's
leg is admitted with the prefill's, before the prefill computed anything, and its worker reads
the prompt's blocks as the prefill's forward completes them (per chunk of a chunked prefill,
and per group of layers from vLLM's save hooks within a step); every byte is checked when the
decode first schedules the request. Also: the pure parts (``kvlink.vllm.progressive``), a
prefill preempted or aborted mid-prompt, a decode that cannot follow, and a decode's cached
prefix skipped."""

from __future__ import annotations

import os
import random
import secrets
import sys
import time
from typing import Any, Dict, List, Tuple

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import engine_process  # noqa: E402
from harness import Proc, assert_no_leak, close, step_until  # noqa: E402

from kvlink.vllm.progressive import Growing, LayerParts, _written, progressive_why, transfer_of  # noqa: E402
from kvlink.vllm.groups import _Group  # noqa: E402
from kvlink.vllm.params import _remote  # noqa: E402

BS = engine_process.BLOCK_SIZE


# -- the pure parts --


def test_a_step_makes_final_the_blocks_its_forward_completes_and_the_prompt_end_seals():
    g = Growing("t", 5)
    ids = [[11, 12, 13, 14, 15]]
    # A cached prefix of 2 blocks, then 40 tokens: the prefix is final before the forward,
    # the next two whole blocks after it, the partial fifth not yet.
    s = g.step(ids, [BS], 2 * BS, 40, 75)
    assert (s.now, s.after, s.seal) == ([[11, 12]], [[13, 14]], False)
    s = g.step(ids, [BS], 72, 3, 75)
    assert (s.now, s.after, s.seal) == ([[]], [[15]], True)
    assert g.step(ids, [BS], 75, 1, 75) is None  # sealed: no more
    dead = Growing("u", 6, dead=True)
    assert dead.step(ids, [BS], 0, 16, 75) is None


def test_layer_parts_are_given_in_order_once_every_layer_before_is_written():
    parts = LayerParts({f"l{i}": i for i in range(6)}, 6, 2)
    assert parts.layer("l1") is None  # l0 not written yet
    assert parts.layer("l0") == (0, 2)
    assert parts.layer("l2") is None
    assert parts.layer("x") is None  # a layer that owns no tensor (KV sharing)
    assert parts.layer("l3") == (2, 4)
    assert parts.layer("l4") is None
    assert parts.layer("l5") is None  # the last part waits for the step's end
    assert parts.rest() == (4, 6)
    parts.reset()
    assert parts.rest() is None  # no hook ran: the step's blocks go whole
    assert LayerParts({"a": 0, "b": 1}, 2, 0).layer("a") is None


def test_a_hold_grows_only_once_the_kernels_reached_its_event_and_gives_up_at_the_deadline():
    class Event:
        def __init__(self, ready_after: int):
            self.looks = 0
            self.ready_after = ready_after

        def query(self) -> bool:
            self.looks += 1
            return self.looks > self.ready_after

    late = Event(3)
    assert _written(late, time.monotonic() + 5) and late.looks == 4
    start = time.monotonic()
    assert not _written(Event(10**9), start + 0.05)
    assert time.monotonic() - start < 2


def test_transfer_params_and_kinds_are_checked():
    assert transfer_of({"do_remote_decode": True}) is None
    assert transfer_of({"transfer_id": "x", "transfer_hold": 3}) == ("x", 3)
    for bad in ({"transfer_id": "", "transfer_hold": 3}, {"transfer_id": "x", "transfer_hold": 0},
                {"transfer_id": "x", "transfer_hold": True}, {"transfer_id": 7, "transfer_hold": 3}):
        assert isinstance(transfer_of(bad), str), bad
    follow = {"progressive": True, "remote_addresses": ["h:1"], "remote_request_id": "t", "remote_block_sizes": [16]}
    r = _remote(follow, [16])
    assert not isinstance(r, str) and r.follow and r.blocks == [[]], r
    for sizes in ("abc", [0], [16] * 65, 16, None):
        assert isinstance(_remote(dict(follow, remote_block_sizes=sizes), [16]), str), sizes
    assert progressive_why([_Group(0, 16), _Group(0, 16)]) is None
    assert "sliding window" in progressive_why([_Group(0, 16), _Group(128, 16)])
    assert "state" in progressive_why([_Group(0, 16, state=True)])


# -- through two engines --


@pytest.fixture(scope="module")
def pair():
    prefill, decode = Proc("pprefill"), Proc("pdecode")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        close(prefill, decode)


def legs(prefill: Proc, tid: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The two legs' parameters for transfer ``tid``, as the proxy makes them."""
    hold = secrets.randbits(63) + 1
    p = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid, "transfer_hold": hold}
    d = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "progressive": True,
        "remote_addresses": prefill.ready["addresses"],
        "remote_request_id": tid,
        "remote_hold": hold,
        "remote_block_sizes": [BS],
        "tp_size": len(prefill.ready["addresses"]),
    }
    return p, d


def prompt(seed: int, n: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def start(prefill: Proc, decode: Proc, rid: str, tokens: List[int]) -> None:
    """Both legs at once, the decode's first: it follows before the prefill holds anything."""
    p, d = legs(prefill, "t-" + rid)
    decode.call("add", "d-" + rid, tokens, 2, d)
    decode.call("step")
    prefill.call("add", rid, tokens, 1, p)


def decoded(decode: Proc, prefill: Proc, rids: List[str], failures: int = 0) -> None:
    """Steps both until the decodes of ``rids`` finished, ``failures`` of their reads failed."""
    failed = stat(decode, "reads_failed")
    step_until([decode, prefill], lambda f: {"d-" + r for r in rids} <= {x["id"] for x in f if x["engine"] == decode.name},
               what="the decodes")
    assert stat(decode, "reads_failed") - failed == failures


def stat(proc: Proc, key: str) -> int:
    return proc.call("state")["engine_stats"][key]


def test_the_decode_reads_each_chunk_while_the_prefill_computes_the_next(pair):
    prefill, decode = pair
    tokens = prompt(1, 700)  # three chunks of at most 256 tokens
    served = stat(prefill, "bytes_served")
    start(prefill, decode, "c1", tokens)
    out = prefill.call("step")
    assert out["finished"] == [], out
    # The prompt is not done, and the decode reads its first chunk's blocks meanwhile.
    end = time.monotonic() + 20
    while stat(prefill, "bytes_served") == served:
        assert time.monotonic() < end, "nothing read while the prefill ran"
        decode.call("step")
        time.sleep(0.01)
    assert prefill.call("state")["requests"] == 1
    decoded(decode, prefill, ["c1"])
    s = decode.call("state")
    assert s["bad"] == [] and "d-c1" in s["verified"], s
    assert s["reads"]["d-c1"] == -(-700 // BS)
    assert_no_leak([prefill, decode])


def test_a_prompt_of_one_step_grows_by_groups_of_layers(pair):
    prefill, decode = pair
    before = prefill.call("state")["connector_stats"].get("Hold parts", 0)
    start(prefill, decode, "l1", prompt(2, 90))
    decoded(decode, prefill, ["l1"])
    s = decode.call("state")
    assert s["bad"] == [] and "d-l1" in s["verified"], s
    # Four layers, two per part: two parts of the one step.
    assert prefill.call("state")["connector_stats"].get("Hold parts", 0) - before == 2
    assert_no_leak([prefill, decode])


def test_a_prefix_the_decode_cached_is_skipped(pair):
    prefill, decode = pair
    shared = prompt(3, 3 * BS)
    start(prefill, decode, "h1", shared + prompt(4, 30))
    decoded(decode, prefill, ["h1"])
    start(prefill, decode, "h2", shared + prompt(5, 50))
    decoded(decode, prefill, ["h2"])
    s = decode.call("state")
    assert s["bad"] == [] and {"d-h1", "d-h2"} <= set(s["verified"]), s
    assert s["reads"]["d-h2"] == -(-(3 * BS + 50) // BS) - 3, s["reads"]
    assert_no_leak([prefill, decode])


def test_a_prefill_aborted_mid_prompt_fails_the_read_and_the_decode_recomputes(pair):
    prefill, decode = pair
    start(prefill, decode, "a1", prompt(6, 700))
    prefill.call("step")
    prefill.call("abort", ["a1"])
    decoded(decode, prefill, ["a1"], failures=1)
    assert_no_leak([prefill, decode])


def test_a_decode_aborted_before_the_prefill_holds_anything_frees_it_at_once(pair):
    """The client went away while the decode waited: its read is cancelled, and the prefill,
    told before it held the request, fails the hold as it opens it (its abort timeout is
    300 s: only that frees it in time)."""
    prefill, decode = pair
    tokens = prompt(8, 100)
    p, d = legs(prefill, "t-e1")
    decode.call("add", "d-e1", tokens, 2, d)
    for _ in range(5):
        decode.call("step")
        time.sleep(0.02)
    decode.call("abort", ["d-e1"])
    step_until([decode], lambda f: decode.call("state")["requests"] == 0, what="the decode's abort")
    time.sleep(0.2)
    prefill.call("add", "e1", tokens, 1, p)
    assert_no_leak([prefill, decode])
    assert "d-e1" not in decode.call("state")["verified"]


def test_a_decode_that_cannot_follow_computes_locally_and_frees_the_prefill(pair):
    prefill, decode = pair
    tokens = prompt(7, 100)
    p, d = legs(prefill, "t-n1")
    prefill.call("add", "n1", tokens, 1, p)
    # The prefill holds it (sealed: one step), then a decode of other block sizes is told.
    step_until([prefill], lambda f: any(x["id"] == "n1" for x in f), what="the prefill")
    decode.call("add", "d-n1", tokens, 2, dict(d, remote_block_sizes=[2 * BS]))
    decoded(decode, prefill, ["n1"])
    assert "d-n1" not in decode.call("state")["reads"]
    assert_no_leak([prefill, decode])
