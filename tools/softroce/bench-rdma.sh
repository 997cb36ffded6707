#!/usr/bin/env bash
# Runs INSIDE the SoftRoCE VM (tools/softroce/run.sh -- tools/softroce/bench-rdma.sh): measures
# kvlink-bench over RDMA against perftest's ib_read_bw on the same rxe device in the same run,
# at 64 KiB and 1 MiB messages and for the Llama-3-8B-like layout with random block ids, and
# prints the ratios. The VM is emulated: only the ratios mean anything.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
bench=${KVLINK_BENCH:-$repo/target/release/kvlink-bench}
dev=${KVLINK_RDMA_DEVICE:-rxe0}
[ -x "$bench" ] || { echo "bench-rdma: build it first: cargo build --release -p kvlink-bench" >&2; exit 2; }

gbps() { python3 -c 'import json,sys; print("%.4f" % json.load(sys.stdin)["gb_per_s"])'; }
ratio() { python3 -c "print('%.2f' % ($1 / $2))"; }

kvlink() { "$bench" --transport rdma --rdma-device "$dev" --json "$@" | gbps; }

row() {
  local name=$1 ref=$2 kv=$3
  printf '%-34s ib_read_bw %8s GB/s   kvlink %8s GB/s   ratio %sx\n' "$name" "$ref" "$kv" "$(ratio "$kv" "$ref")"
}

# 64 KiB messages: one tensor of 64 KiB blocks, random block ids (no two adjacent reads merge).
ref=$("$repo/tools/softroce/ib_read_bw.sh" 65536 2000 | sed -n 's/.*gbps=//p')
kv=$(kvlink --block-bytes 64K --tokens 256 --requests 8 --warmup 1 --concurrency 2)
row "64 KiB reads (4 QPs)" "$ref" "$kv"
# ib_read_bw uses one queue pair: the same for kvlink, for a like-for-like ratio.
kv=$(kvlink --block-bytes 64K --tokens 256 --requests 8 --warmup 1 --concurrency 2 --qps 1)
row "64 KiB reads (1 QP)" "$ref" "$kv"

# 1 MiB messages.
ref=$("$repo/tools/softroce/ib_read_bw.sh" 1048576 200 | sed -n 's/.*gbps=//p')
kv=$(kvlink --block-bytes 1M --tokens 32 --requests 6 --warmup 1 --concurrency 2)
row "1 MiB reads (4 QPs)" "$ref" "$kv"
kv=$(kvlink --block-bytes 1M --tokens 32 --requests 6 --warmup 1 --concurrency 2 --qps 1)
row "1 MiB reads (1 QP)" "$ref" "$kv"

# The Llama-3-8B-like layout (64 tensors of 32 KiB per block), 1,024-token requests, random ids;
# compared with ib_read_bw at the layout's 32 KiB piece size.
ref=$("$repo/tools/softroce/ib_read_bw.sh" 32768 4000 | sed -n 's/.*gbps=//p')
kv=$(kvlink --preset llama-3-8b --tokens 1024 --blocks 160 --requests 4 --warmup 1 --concurrency 1)
row "llama-3-8b 1024 tok (32 KiB)" "$ref" "$kv"
