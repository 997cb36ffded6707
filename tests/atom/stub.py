"""What the ATOM tests stub: ``aiter``, AMD's ROCm kernel library, which has no CPU build.

ATOM's scheduler, engine core and connector factory run unchanged; of ``aiter`` they use at run
time only the message queue between the engine core and its workers (here: spawn queues), the
parallel groups (here: one TP group per worker process, DP 1) and ``dtypes`` (here: torch's).
Every other ``aiter`` name is a ``MagicMock`` nothing on the tested path calls. Importing this
module installs the stub; spawned children import it again through the test's main module."""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import multiprocessing
import sys
import types
from unittest.mock import MagicMock


class MessageQueue:
    """``aiter.dist.shm_broadcast.MessageQueue``: one writer, ``n_reader`` readers."""

    def __init__(self, n_reader, n_local_reader=None, max_chunk_bytes=None, **_kw):
        ctx = multiprocessing.get_context("spawn")
        self._queues = [ctx.Queue() for _ in range(n_reader)]

    def export_handle(self):
        return self._queues

    @classmethod
    def create_from_handle(cls, handle, rank):
        q = cls.__new__(cls)
        q._queue = handle[rank]
        return q

    def enqueue(self, obj):
        for q in self._queues:
            q.put(obj)

    def dequeue(self):
        return self._queue.get()


class Group:
    """A parallel group as ``aiter.dist.parallel_state`` describes it."""

    def __init__(self):
        self.rank_in_group = 0
        self.world_size = 1


TP, DP = Group(), Group()


def _dtypes():
    import torch

    m = types.ModuleType("aiter.dtypes")
    m.d_dtypes = {"bf16": torch.bfloat16, "auto": torch.bfloat16, "fp8": torch.float8_e4m3fnuz}
    m.fp32, m.bf16, m.fp8 = torch.float32, torch.bfloat16, torch.float8_e4m3fnuz
    return m


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        if spec.name == "aiter.dtypes":
            return _dtypes()
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = lambda a, n=spec.name: MagicMock(name=f"{n}.{a}")
        if spec.name == "aiter.jit.utils.torch_guard":
            # A decorator factory that registers a kernel as a torch custom op; the kernels
            # (DeepSeek-V4's) are imported, never called, on this path: leave them as they are.
            m.torch_compile_guard = lambda *a, **k: (lambda f: f)
        if spec.name == "aiter":
            # Pickled across processes inside ATOM's config: a real enum.
            m.QuantType = enum.IntEnum("QuantType", "No per_Tensor per_Token per_1x32 per_1x128 per_128x128", module="aiter")
            m.dtypes = _dtypes()
        if spec.name == "aiter.dist.shm_broadcast":
            m.MessageQueue = MessageQueue
        if spec.name == "aiter.dist.parallel_state":
            m.get_tp_group = lambda: TP
            m.get_dp_group = lambda: DP
        return m

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "aiter" or name.startswith("aiter."):
            return importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)
        return None


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
