"""The connector's rules for Mamba-kind state groups on vLLM's own objects, without engines:
which block holds a request's running state (against vLLM's ``clip_ssm_state_blocks``), how a
state group's read pairs, and the prefill's one-token back-off on a real vLLM ``Request``. The
transfers themselves are in test_vllm_memory.py."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
from vllm.v1.request import Request

from kvlink.vllm.scheduler import _pair_state, _running_state, _SchedulerSide


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
