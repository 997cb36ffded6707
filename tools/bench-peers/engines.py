"""The two peers behind one small interface, used by peer_read.py.

    serve(cache) -> info        target: register the cache, say what a reader needs (JSON)
    connect(cache, info) -> a   initiator: register its cache, reach the target; its address
    start(local, remote, lens)  one READ of all the pieces (uint64 arrays); a handle
    wait(handle)                until that READ is done, or raise (deadline, failure)

Settings are each engine's defaults unless written here with the reason.
"""

import base64
import time

import numpy as np


class Nixl:
    """NIXL 1.5.1 with its UCX backend (`nixl_cu12._api`, the Python API its docs describe)."""

    def __init__(self, role, a):
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        # The target keeps NIXL's progress thread: UCX over TCP emulates a GET with active
        # messages, so the target's worker must be progressed to answer. The initiator polls
        # its transfers itself; its own progress thread only competes for the two cores
        # (measured: 0.9 against 0.63 GB/s), so it is off (`enable_prog_thread`, documented).
        thread = role == "target" or a.nixl_initiator_thread
        self.agent = nixl_agent(role, nixl_agent_config(enable_prog_thread=bool(thread), backends=["UCX"]))
        self.deadline = a.deadline
        self.remote = None

    def _register(self, cache):
        self.reg = self.agent.register_memory([(cache.ctypes.data, cache.nbytes, 0, "")], "DRAM")

    def serve(self, cache):
        self._register(cache)
        md = self.agent.get_agent_metadata()
        return {"addr": cache.ctypes.data, "md": base64.b64encode(md).decode()}

    def connect(self, cache, info):
        self._register(cache)
        self.remote = self.agent.add_remote_agent(base64.b64decode(info["md"]))
        self.agent.make_connection(self.remote)
        return cache.ctypes.data

    def _descs(self, addrs, lens):
        rows = np.stack([addrs, lens, np.zeros_like(lens)], axis=1).astype(np.uint64)
        return self.agent.get_xfer_descs(rows, "DRAM")

    def start(self, local, remote, lens):
        h = self.agent.initialize_xfer("READ", self._descs(local, lens), self._descs(remote, lens), self.remote)
        if self.agent.transfer(h) == "ERR":
            raise RuntimeError("nixl: transfer() returned ERR")
        return h

    def wait(self, h):
        end = time.monotonic() + self.deadline
        while True:  # NIXL offers no blocking wait: poll, as its examples do
            st = self.agent.check_xfer_state(h)
            if st == "DONE":
                self.agent.release_xfer_handle(h)
                return
            if st == "ERR" or time.monotonic() > end:
                raise RuntimeError(f"nixl: transfer {st} after {self.deadline} s")

    def close(self):
        if self.remote is not None:
            self.agent.remove_remote_agent(self.remote)
        self.agent.deregister_memory(self.reg)


class Mooncake:
    """Mooncake Transfer Engine 0.3.13 (`mooncake.engine.TransferEngine`), P2P handshake: each
    engine serves its segment descriptor on an RPC port of its own, so no metadata server."""

    def __init__(self, role, a):
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        self.host = a.host if role == "target" else a.local_host
        rc = self.te.initialize(self.host, "P2PHANDSHAKE", a.protocol, a.device)
        if rc != 0:
            raise RuntimeError(f"mooncake: initialize({a.protocol}, {a.device!r}) returned {rc}")
        self.seg = None

    def _register(self, cache):
        if self.te.register_memory(cache.ctypes.data, cache.nbytes) != 0:
            raise RuntimeError("mooncake: register_memory failed")
        self.cache = cache

    def serve(self, cache):
        self._register(cache)
        return {"addr": cache.ctypes.data, "segment": f"{self.host}:{self.te.get_rpc_port()}"}

    def connect(self, cache, info):
        self._register(cache)
        self.seg = info["segment"]
        return cache.ctypes.data

    def start(self, local, remote, lens):
        bid = self.te.batch_transfer_async_read(self.seg, local.tolist(), remote.tolist(), lens.tolist())
        if bid <= 0:
            raise RuntimeError(f"mooncake: batch_transfer_async_read returned {bid}")
        return bid

    def wait(self, bid):
        # Blocks until the batch ends; Mooncake's own deadline (MC_TRANSFER_TIMEOUT, 30 s by
        # default, plus 1 ns per byte) makes it return an error instead of hanging.
        rc = self.te.get_batch_transfer_status([bid])
        if rc != 0:
            raise RuntimeError(f"mooncake: batch ended with {rc}")

    def close(self):
        self.te.unregister_memory(self.cache.ctypes.data)


def make_engine(name, role, a):
    return {"nixl": Nixl, "mooncake": Mooncake}[name](role, a)
