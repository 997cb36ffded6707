#!/usr/bin/env bash
# Runs INSIDE the SoftRoCE VM (tools/softroce/run.sh -- tools/softroce/bench-rails.sh): reads
# over two rxe devices (rxe0 and rxe1, striped) against one (rxe0), alternating rounds in the
# same run, with kvlink-bench's loopback, and prints the ratio of medians. The VM is emulated
# (both devices are the guest's CPUs): only the ratio means anything. Extra arguments go to
# kvlink-bench.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
bench=${KVLINK_BENCH:-$repo/target/release/kvlink-bench}
rounds=${ROUNDS:-3}
[ -x "$bench" ] || { echo "bench-rails: build it first: cargo build --release -p kvlink-bench" >&2; exit 2; }
[ -n "${KVLINK_RDMA_DEVICES:-}" ] || { echo "bench-rails: the VM has one device only (see run.sh's log)" >&2; exit 2; }

gbps() { python3 -c 'import json,sys; print("%.4f" % json.load(sys.stdin)["gb_per_s"])'; }
once() {
  "$bench" --transport rdma --preset deepseek-v3-mla --tokens 1024 --requests 8 --warmup 1 \
    --concurrency 2 --json "$@" | gbps
}
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

one=(); two=()
for i in $(seq "$rounds"); do
  a=$(once --rdma-device rxe0 "$@")
  b=$(once --rdma-device rxe0 --rdma-device rxe1 "$@")
  echo "round $i: one device $a GB/s, two devices $b GB/s"
  one+=("$a"); two+=("$b")
done
a=$(printf '%s\n' "${one[@]}" | median)
b=$(printf '%s\n' "${two[@]}" | median)
python3 -c "print('medians: one device %s GB/s, two devices %s GB/s, two / one = %.2fx' % ('$a', '$b', $b / $a))"
