"""One ATOM engine for the tests: ATOM's ``CoreManager`` (its EngineCore process, real
``Scheduler`` and step loop, one worker process per TP rank running ``runner.KvRunner``) with
the kvlink backend, driven by JSON lines on stdin; events go to stdout as JSON lines.

    python engine.py ROLE MODEL_DIR TP PORT [--prefix-cache]

ROLE is ``kv_producer``, ``kv_consumer`` or ``none`` (no connector: the single-engine
reference). ``KVLINK_ATOM_KV_CONFIG`` (JSON) adds to the kv_transfer_config,
``KVLINK_ATOM_BLOCK_SIZE`` sets ATOM's block size (16), ``KVLINK_ATOM_DP`` its data-parallel
size (1), ``KVLINK_ATOM_KV_DTYPE`` its KV cache dtype (bf16). Commands: ``{"op": "add", "key", "prompt", "max_tokens", "params"}``,
``{"op": "abort", "key"}``, ``{"op": "metrics"}``, ``{"op": "quit"}``. Events: ``ready``,
``added`` (key, id), ``done`` (key, id, tokens, reason, params), ``metrics``.

This is the main module of every process ATOM spawns (spawn re-imports it as
``__mp_main__``), so the aiter stub and the kvlink backend are registered in each."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stub  # noqa: E402,F401  (before anything imports atom)

import kvlink.atom  # noqa: E402,F401  (registers "kvlink" with ATOM's factory)


def _emit(**event):
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _config(role, model, tp, port, prefix):
    from atom.config import Config

    kv = None
    if role != "none":
        kv = {"kv_connector": "kvlink", "kv_role": role, "handshake_port": port}
        kv.update(json.loads(os.environ.get("KVLINK_ATOM_KV_CONFIG", "{}")))
    from atom.config import ParallelConfig

    from ports import free_port

    dp_port = free_port()  # the DP engine cores' torch.distributed rendezvous
    cfg = Config(
        parallel_config=ParallelConfig(data_parallel_size=int(os.environ.get("KVLINK_ATOM_DP", "1")), data_parallel_master_port=dp_port),
        model=model,
        kv_cache_block_size=int(os.environ.get("KVLINK_ATOM_BLOCK_SIZE", "16")),
        kv_cache_dtype=os.environ.get("KVLINK_ATOM_KV_DTYPE", "bf16"),
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        enforce_eager=True,
        enable_prefix_caching=prefix,
        tensor_parallel_size=tp,
        runner_qualname="runner.KvRunner",
        kv_transfer_config=kv,
    )
    cfg.eos_token_id = 2
    return cfg


def _children(pid):
    """The process ids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _engine_cores_yield():
    """ATOM's EngineCore polls its queues without ever blocking while it has nothing to do
    (``EngineCore.busy_loop`` in engine_core.py): where it is deployed it has a core of its
    own. These tests start two to three of them on a machine of two cores, where their idle
    polling takes the CPU the TP workers, the drivers and the test need, and a test takes
    several times as long. Each EngineCore (found by the title ATOM gives it) is set to the
    lowest priority, nice 19, every thread: it still gets every cycle nobody else wants, and its
    code is untouched."""
    found, todo = 0, _children(os.getpid())
    while todo:
        pid = todo.pop()
        todo += _children(pid)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"ATOM::EngineCore"):
                    continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), 19)
            found += 1
        except OSError:
            continue
    if not found:
        print("engine.py: no process titled ATOM::EngineCore found to lower its priority", file=sys.stderr)


def main():
    role, model, tp, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    from atom.model_engine.engine_core_mgr import CoreManager
    from atom.model_engine.sequence import Sequence
    from atom.sampling_params import SamplingParams

    cfg = _config(role, model, tp, port, "--prefix-cache" in sys.argv)
    mgr_block_size, dp_size = cfg.kv_cache_block_size, cfg.parallel_config.data_parallel_size
    mgr = CoreManager(cfg)
    _engine_cores_yield()
    keys = {}
    from atom.model_engine.llm_engine import InputOutputProcessor

    per_req = cfg.hf_config.model_type in InputOutputProcessor._per_req_cache_model_types()

    def outputs():
        while True:
            seqs = mgr.outputs_queue.get()
            for s in seqs:
                _emit(
                    event="done",
                    key=keys.get(s.id),
                    id=s.id,
                    tokens=list(s.completion_token_ids),
                    reason=s.leave_reason,
                    params=getattr(s, "kv_transfer_params_output", None),
                )

    threading.Thread(target=outputs, daemon=True).start()
    _emit(event="ready", pid=os.getpid())
    ids = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "add":
            sp = SamplingParams(max_tokens=cmd["max_tokens"], ignore_eos=True)
            # As ATOM's InputOutputProcessor builds a request: a per-request state slot for the
            # model types it lists (DeepSeek-V4).
            seq = Sequence(cmd["prompt"], mgr_block_size, sp, kv_transfer_params=cmd.get("params"),
                           has_per_req_cache=per_req)
            if cmd.get("dp_rank") is not None:  # ATOM's routing hint
                seq.data_parallel_rank = cmd["dp_rank"]
            keys[seq.id], ids[cmd["key"]] = cmd["key"], seq.id
            mgr.add_request([seq])
            _emit(event="added", key=cmd["key"], id=seq.id)
        elif op == "abort":
            mgr.abort_request(ids[cmd["key"]])
        elif op == "metrics":
            # Each DP rank's next push (every 5 s), so that they postdate the call.
            before, deadline = dict(mgr.latest_metrics), time.monotonic() + 15
            while time.monotonic() < deadline and any(mgr.latest_metrics.get(r) is before.get(r) for r in range(dp_size)):
                time.sleep(0.1)
            _emit(event="metrics", metrics=[mgr.latest_metrics.get(r) for r in range(dp_size)], at=time.time())
        elif op == "quit":
            break
    mgr.close()
    _emit(event="closed")


if __name__ == "__main__":
    main()
