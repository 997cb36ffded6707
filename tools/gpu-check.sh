#!/usr/bin/env bash
# kvlink on a GPU in one command, each figure printed with its reference:
#   1. references: a device-to-device copy and a pinned device-to-host copy (PyTorch, 1 GiB);
#   2. the same-host GPU path (kvlink-bench --transport local --memory cuda: CUDA IPC) against
#      the device-to-device copy (goal: at least 0.5x);
#   3. TCP between GPUs through pinned staging (--transport tcp --memory cuda) against the
#      pinned device-to-host copy (goal: at least 0.8x);
#   4. a real model's KV cache through kvlink (tools/gpu_model_check.py, same host and TCP):
#      greedy tokens equal to one process's, the time to first token split.
# Speed ratios are reported, never a verdict; the verdict is 4's (tokens and bytes equal) and
# every step having run. Exit status 0 only when every step passed.
#
#   tools/gpu-check.sh --pack       on the CPU machine: builds the release kvlink-bench and the
#                                   wheel into .gpu/ (git-ignored) for a bare GPU machine
#   tools/gpu-check.sh              on the GPU machine (carry .gpu): no Rust, no network there;
#                                   python3 must hold torch and transformers (it installs the
#                                   wheel from .gpu/ into a folder of its own)
#   tools/gpu-check.sh --cpu-only   the same steps without a GPU (the test command runs it):
#                                   kvlink-bench on emulated device memory (host memory taking
#                                   the GPU staging and IPC paths), the model on the CPU (host
#                                   memory, over TCP only)
#
# Environment: KVLINK_GPU_PYTHON (python3), KVLINK_GPU_BENCH (the kvlink-bench binary:
# .gpu/kvlink-bench, else target/release/kvlink-bench, else target/debug/kvlink-bench).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
mode=gpu
case ${1:-} in
  --pack) mode=pack ;;
  --cpu-only) mode=cpu ;;
  "") ;;
  *) echo "usage: tools/gpu-check.sh [--pack | --cpu-only]" >&2; exit 2 ;;
esac

if [ "$mode" = pack ]; then
  cargo build --release -q -p kvlink-bench
  rm -rf .gpu && mkdir -p .gpu
  cp target/release/kvlink-bench .gpu/
  strip .gpu/kvlink-bench 2>/dev/null || true  # its line tables are a third of what travels
  (cd ffi/python && CARGO_TARGET_DIR="$repo/target/python" PATH="$repo/.venv/bin:$PATH" \
    ../../.venv/bin/maturin build --release --quiet --zig --compatibility manylinux_2_17 -o "$repo/.gpu")
  du -sh .gpu
  echo "gpu-check: .gpu/ holds kvlink-bench and the wheel; carry .gpu and run tools/gpu-check.sh"
  exit 0
fi

py=${KVLINK_GPU_PYTHON:-python3}
bench=${KVLINK_GPU_BENCH:-}
for b in .gpu/kvlink-bench target/release/kvlink-bench target/debug/kvlink-bench; do
  if [ -z "$bench" ] && [ -x "$b" ]; then bench=$b; fi
done
[ -n "$bench" ] || { echo "gpu-check: no kvlink-bench (tools/gpu-check.sh --pack, or cargo build)" >&2; exit 2; }
if compgen -G ".gpu/kvlink-*.whl" >/dev/null && ! "$py" -c 'import kvlink' 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvlink-site .gpu/kvlink-*.whl
  export PYTHONPATH=/tmp/kvlink-site${PYTHONPATH:+:$PYTHONPATH}
fi
failed=0
step() { echo; echo "== $*"; }
# One step's verdict, as the test command's tally reads it (`check: PASS|FAIL NAME`).
verdict() {
  echo "check: $1 $2"
  if [ "$1" != PASS ]; then failed=1; fi
}

bench_args=()
model_transports=(local tcp)
if [ "$mode" = gpu ]; then
  memory=cuda device=cuda
  step "references (PyTorch, 1 GiB, median of 10)"
  refs=$("$py" - <<'EOF'
import statistics, torch
n = 1 << 30
src = torch.empty(n, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
def rate(copy):
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); copy(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return n / statistics.median(times[2:]) / 1e9
print(f"{rate(lambda: dst.copy_(src)):.2f} {rate(lambda: host.copy_(src, non_blocking=True)):.2f} {torch.cuda.get_device_name()}")
EOF
)
  read -r d2d d2h card <<<"$refs"
  echo "card: $card; device-to-device copy $d2d GB/s (bytes copied per second); pinned device-to-host $d2h GB/s"
else
  memory=emulated device=cpu
  d2d="" d2h=""
  # Smaller requests: emulated device memory is host memory, copied by memcpy.
  bench_args=(--tokens 1024 --requests 4 --warmup 1)
  # Host memory a tensor owns cannot be shared with another process (the same-host path needs
  # GPU memory or kvlink's own allocation): the model goes over TCP; kvlink-bench's run above
  # covers the same-host path on emulated device memory.
  model_transports=(tcp)
  echo "gpu-check: CPU-only: emulated device memory for kvlink-bench, the model on the CPU"
fi

# One kvlink-bench run: prints its figure against the reference (its own plain copy when none).
bench_run() {
  local what=$1 transport=$2 ref=$3 goal=$4 out
  step "$what (kvlink-bench --transport $transport --memory $memory)"
  if ! out=$("$bench" loopback --transport "$transport" --memory "$memory" "${bench_args[@]}" \
    --verify --json 2>&1 | tail -n 1); then
    echo "kvlink-bench failed: $out"; verdict FAIL "$what"; return
  fi
  if "$py" - "$out" "$ref" "$goal" <<'EOF'; then verdict PASS "$what"; else verdict FAIL "$what"; fi
import json, sys
r, ref, goal = json.loads(sys.argv[1]), sys.argv[2], float(sys.argv[3])
ref = float(ref) if ref else r["reference_gb_per_s"]
lat = r["latency_ms"]
ok = r["verified_bytes"] == r["bytes"]
print(f"{r['gb_per_s']:.2f} GB/s ({r['bytes'] / r['requests'] / 2**20:.0f} MiB a request, p50 {lat['p50']:.2f} ms, "
      f"p99 {lat['p99']:.2f} ms); reference {ref:.2f} GB/s: {r['gb_per_s'] / ref:.2f}x (goal {goal}x); "
      f"bytes verified: {'all' if ok else 'NOT all'}")
sys.exit(0 if ok else 1)
EOF
}
bench_run "same-host path" local "$d2d" 0.5
bench_run "TCP through staging" tcp "$d2h" 0.8

for transport in "${model_transports[@]}"; do
  step "model: prefill, transfer, decode ($transport)"
  if "$py" tools/gpu_model_check.py --device "$device" --transport "$transport"; then
    verdict PASS "model ($transport)"
  else
    verdict FAIL "model ($transport)"
  fi
done
echo
if [ "$failed" = 0 ]; then echo "gpu-check: PASS ($mode)"; else echo "gpu-check: FAIL ($mode)"; fi
exit "$failed"
