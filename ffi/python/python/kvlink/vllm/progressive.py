"""Progressive transfers through vLLM: the decode's leg starts with the prefill's, and its
worker reads the prompt's blocks as the prefill's forward makes them final.

The proxy (``kvlink.vllm.proxy``) sends both legs at once with a transfer id and a hold token.
The prefill holds its request under the transfer id before its first forward (a growing
hold), extends the hold after each step with the blocks that step completed, and, within a
step, a group of layers at a time as vLLM's save hooks report them written; it seals the hold
in the step that completes the prompt. The decode admits its request at once (its blocks
allocated, ``WAITING_FOR_REMOTE_KVS``) and follows the hold: each part is read as soon as it is
held, and the request is received once the hold is sealed, every part read and the prefill
confirmed it held them all until then.

This module is the pure part: which blocks a step makes final, which layers are written, and
the proxy's probe answer. Progressive transfers pair the two sides' blocks one to one in order:
KV cache groups of full attention or MLA only, equal TP sizes and block sizes; anything else
runs the sequential flow.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import core

#: The key of the proxy's probe in ``kv_transfer_params``: the request is computed as any other
#: and its response's ``kv_transfer_params`` hold ``{"kvlink": describe(...)}``.
PROBE = "kvlink_probe"


def progressive_why(kinds: Sequence[Any]) -> str | None:
    """Why an engine whose KV cache groups are ``kinds`` (``groups._Group``) cannot take
    part in a progressive transfer, or None. A sliding window's blocks are freed by vLLM while
    the prompt runs, a state's block holds the state after the whole prompt, an attention
    chunk's are dropped: only full attention and MLA blocks are final as soon as written and
    kept until the request ends."""
    for g, k in enumerate(kinds):
        if k.state:
            return f"KV cache group {g} holds per-request state"
        if k.window:
            return f"KV cache group {g} is a sliding window"
        if k.chunk:
            return f"KV cache group {g} is chunked local attention"
    return None


def transfer_of(params: dict[str, Any]) -> tuple[str, int] | str | None:
    """A prefill leg's progressive transfer: ``(transfer id, hold token)`` from
    ``transfer_id`` and ``transfer_hold``, None when the parameters ask for none, or why they
    are unusable (they come from a client)."""
    tid, hold = params.get("transfer_id"), params.get("transfer_hold")
    if tid is None and hold is None:
        return None
    if not isinstance(tid, str) or not 0 < len(tid) <= 128:
        return "transfer_id must be a string of 1 to 128 characters"
    token = core.hold_token(hold)
    if token is None:
        return "transfer_hold must be an integer from 1 to 2^64-1"
    return tid, token


@dataclass
class Growth:
    """What one step makes final of a request's growing hold, per KV cache group."""

    now: list[list[int]]
    """Blocks final before the step's forward (a prefix the prefill had cached)."""
    after: list[list[int]]
    """Blocks the step's forward completes."""
    seal: bool
    """The step completes the prompt: the hold is sealed after ``after``."""


@dataclass
class Growing:
    """The scheduler's record of a prefill request held progressively."""

    transfer_id: str
    hold: int
    started: bool = False
    """Its hold was asked of the workers."""
    announced: list[int] = field(default_factory=list)
    """Per KV cache group, the blocks asked to be held so far."""
    sealed: bool = False
    dead: bool = False
    """Released (preempted): it grows no more, and the decode recomputes."""

    def step(
        self, ids: Sequence[Sequence[int]], sizes: Sequence[int], done: int, scheduled: int, prompt: int
    ) -> Growth | None:
        """The growth of a step that computes ``scheduled`` tokens after ``done`` of a prompt
        of ``prompt`` tokens, its blocks per group ``ids``, their tokens per block ``sizes``;
        None once sealed or released."""
        if self.sealed or self.dead:
            return None
        if not self.announced:
            self.announced = [0] * len(sizes)
        complete = done + scheduled >= prompt
        before = [min(done // s, len(g)) for g, s in zip(ids, sizes)]
        upto = [min(math.ceil(prompt / s) if complete else (done + scheduled) // s, len(g)) for g, s in zip(ids, sizes)]
        now = [list(g[a:b]) for g, a, b in zip(ids, self.announced, before)]
        after = [list(g[max(a, b) : e]) for g, a, b, e in zip(ids, self.announced, before, upto)]
        self.announced = [max(a, e) for a, e in zip(self.announced, upto)]
        self.sealed = complete
        return Growth(now, after, complete)


class LayerParts:
    """A prefill worker's layers within a step: which of the layout's tensors vLLM's save hooks
    reported written, as ranges to extend a hold by, ``per_part`` layers at a time. Only where
    the layout's tensors are the layers in forward order, one each (one KV cache group);
    a range is given only once every tensor before its end is written."""

    def __init__(self, tensor_of: dict[str, int], tensors: int, per_part: int):
        self.tensor_of = tensor_of
        self.tensors = tensors
        self.per_part = per_part
        self.seen: set[int] = set()
        self.done = 0
        self.written = 0

    def reset(self) -> None:
        """A new step: nothing of it written yet."""
        self.seen.clear()
        self.done = self.written = 0

    def layer(self, name: str) -> tuple[int, int] | None:
        """Layer ``name`` is written: the tensors ``(start, end)`` to extend by now, if a part
        is complete."""
        t = self.tensor_of.get(name)
        if t is None or self.per_part <= 0:
            return None
        self.seen.add(t)
        while self.written in self.seen:
            self.written += 1
        if self.written - self.done < self.per_part or self.written >= self.tensors:
            return None  # the last part waits for the step's end (and its seal)
        out = (self.done, self.written)
        self.done = self.written
        return out

    def rest(self) -> tuple[int, int] | None:
        """The step's forward is done: the tensors not extended by yet, None when a part of
        layers was extended (the step's blocks go whole otherwise)."""
        if self.done == 0:
            return None
        out = (self.done, self.tensors)
        self.done = self.tensors
        return out


#: How long a hold's extension waits for the kernels queued before it (a GPU that takes
#: longer is taken as hung: the hold grows no more and its reader recomputes).
KERNEL_DEADLINE = 60.0


def _written(event: Any, deadline: float) -> bool:
    """Whether the device reached ``event`` before ``deadline``: polled, sleeping 50 us to 2 ms
    between looks (a forward's layer takes about as long)."""
    pause = 50e-6
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    return True


class AfterKernels:
    """Runs actions once the device work queued before them is done: at once on the CPU; on a
    GPU after a CUDA event recorded on the current stream, in order, on a thread of its own
    (a hold must not grow by blocks the kernels have not written yet)."""

    def __init__(self, device: Any, on_error: Callable[[str, BaseException], None]):
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self.on_error = on_error
        self.jobs: queue.Queue[tuple[Any, str, Callable[[], Any]] | None] = queue.Queue()
        self.thread: threading.Thread | None = None

    def run(self, what: str, action: Callable[[], Any]) -> None:
        if not self.cuda:
            self._call(what, action)
            return
        import torch

        event = torch.cuda.Event()
        event.record()
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="kvlink-holds", daemon=True)
            self.thread.start()
        self.jobs.put((event, what, action))

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            event, what, action = job
            if _written(event, time.monotonic() + KERNEL_DEADLINE):
                self._call(what, action)
            else:
                self.on_error(what, TimeoutError(f"the forward's kernels did not finish within {KERNEL_DEADLINE} s"))

    def _call(self, what: str, action: Callable[[], Any]) -> None:
        try:
            action()
        except Exception as e:  # noqa: BLE001 - a worker step must not die of one request
            self.on_error(what, e)

    def close(self, timeout: float = 5.0) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join(timeout)


def describe(
    addresses: list[str] | None, tp_size: int, block_sizes: list[int], why: str | None, engine_id: str | None
) -> dict[str, Any]:
    """The probe's answer: what a proxy needs to pick the flow for a pair of engines."""
    return {
        "addresses": list(addresses or []),
        "tp_size": tp_size,
        "block_sizes": list(block_sizes),
        "progressive": why is None,
        "why_not_progressive": why,
        "engine_id": engine_id,
    }
