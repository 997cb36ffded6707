#!/usr/bin/env bash
# Side-by-side comparison, in one go on this machine: kvlink-bench against the references
# available here, each ratio measured in the same run.
#   1. TCP, Llama-3-8B-like layout, 4,096-token requests, random block ids vs single-stream iperf3
#   2. TCP at 16 KiB and 1 MiB messages vs ucx_perftest ucp_get over TCP (UCX's loopback TCP)
#   3. with --vm: RDMA in the SoftRoCE VM vs ib_read_bw on the same rxe device
# Installs iperf3 and ucx-utils when missing (Debian; root).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
vm=0
[ "${1:-}" = "--vm" ] && vm=1
rounds=${ROUNDS:-5}

tools/deps.sh iperf3 ucx-utils
cargo build --release -q -p kvlink-bench
bench=target/release/kvlink-bench

gbps() { python3 -c 'import json,sys; print("%.4f" % json.load(sys.stdin)["gb_per_s"])'; }
ratio() { python3 -c "import sys; a, b = sys.argv[1:]; print('%.2f' % (float(a) / float(b)) if a and b and float(b) > 0 else 'n/a')" "$1" "$2"; }
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

echo "== 1. TCP vs iperf3 (single stream), Llama-3-8B layout, 4096 tokens, random ids, $rounds rounds"
ROUNDS=$rounds tools/bench-vs-iperf3.sh | tail -n 2

# ucx_perftest: server and client on loopback over UCX's TCP transport; prints MB/s (2^20).
ucx_get() {
  local size=$1 iters=$2 port=$((13000 + RANDOM % 1000))
  UCX_TLS=tcp,self UCX_NET_DEVICES=lo timeout 120 ucx_perftest -p "$port" >/dev/null 2>&1 &
  local server=$!
  sleep 1
  UCX_TLS=tcp,self UCX_NET_DEVICES=lo timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t ucp_get \
    -s "$size" -n "$iters" -w $((iters / 20)) 2>/dev/null |
    awk '/^Final:/ {printf "%.4f\n", $7 * 1048576 / 1e9}'
  wait "$server" 2>/dev/null || true
}

echo "== 2. TCP vs ucx_perftest ucp_get over TCP (loopback)"
for spec in "16384 16K 4096 20000" "1048576 1M 64 1000"; do
  set -- $spec
  ref=$(ucx_get "$1" "$4")
  kv=$("$bench" --transport tcp --block-bytes "$2" --tokens "$3" --requests 8 --json | gbps)
  printf '%-8s ucx_perftest ucp_get %8s GB/s   kvlink tcp %8s GB/s   ratio %sx\n' "$2" "$ref" "$kv" "$(ratio "$kv" "$ref")"
done

if [ "$vm" = 1 ]; then
  echo "== 3. RDMA vs ib_read_bw inside the SoftRoCE VM"
  tools/softroce/run.sh -- tools/softroce/bench-rdma.sh | grep -E 'ratio|softroce: command'
fi
echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, kernel $(uname -r), $(date -u +%Y-%m-%dT%H:%MZ)"
