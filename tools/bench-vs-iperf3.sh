#!/usr/bin/env bash
# Measures kvlink-bench (TCP, loopback) against a single-stream iperf3 on the same machine, in
# the same run, alternating the two so that noise from other tenants hits both. Prints each
# measurement and the ratio of medians. Extra arguments go to kvlink-bench.
#
#   tools/bench-vs-iperf3.sh                      # Llama-3-8B layout, 4096 tokens, random ids
#   tools/bench-vs-iperf3.sh --preset deepseek-v3-mla
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-3}
port=${IPERF_PORT:-5299}

# Build dependencies and iperf3 (Debian), when missing.
"$repo/tools/deps.sh" iperf3
cargo build --release -q -p kvlink-bench --manifest-path "$repo/Cargo.toml"
bench="$repo/target/release/kvlink-bench"

iperf_once() {
  iperf3 -s -1 -B 127.0.0.1 -p "$port" >/dev/null 2>&1 &
  local server=$!
  sleep 0.5
  iperf3 -c 127.0.0.1 -p "$port" -t 5 -J |
    python3 -c 'import json,sys; print("%.3f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"] / 8e9))'
  wait "$server" 2>/dev/null || true
}

kvlink_once() {
  "$bench" --transport tcp --preset llama-3-8b --tokens 4096 --pattern random --json "$@" |
    python3 -c 'import json,sys; print("%.3f" % json.load(sys.stdin)["gb_per_s"])'
}

median() { sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

ip=(); kv=()
for i in $(seq "$rounds"); do
  a=$(iperf_once); b=$(kvlink_once "$@")
  echo "round $i: iperf3 single stream $a GB/s, kvlink tcp $b GB/s"
  ip+=("$a"); kv+=("$b")
done
mi=$(printf '%s\n' "${ip[@]}" | median)
mk=$(printf '%s\n' "${kv[@]}" | median)
echo "median: iperf3 $mi GB/s, kvlink $mk GB/s, ratio $(python3 -c "print('%.2f' % ($mk / $mi))")x"
echo "machine: $(nproc) cores, $(uname -r), $(date -u +%Y-%m-%d)"
