#!/usr/bin/env bash
# kvlink against NIXL and Mooncake Transfer Engine on the same workload, each in two processes
# (kvlink-bench's loopback runs both of its engines in one), alternating round by round, with
# medians and ratios at the end: bandwidth (GB/s, CPU seconds per GB of both sides, p50/p99 per
# request) for kvlink-bench's default workload, and the latency of one read of 4 KiB, 64 KiB
# and 1 MiB. Every peer run checks the bytes it read (warm-up requests and the last ones).
#
#   tools/bench-peers.sh                    # TCP and the same-host path, on this machine
#   tools/bench-peers.sh --vm               # RDMA over SoftRoCE (rxe0) in the VM, then nothing else
#   tools/bench-peers.sh --rounds 3 --latency-sizes 4K   # options of tools/bench-peers/run.py
#
# The peers are installed on first use into a venv of their own (<repo>/target/bench-peers-venv,
# or $KVLINK_PEERS_VENV), never by the test command: nixl-cu12 1.5.1 and
# mooncake-transfer-engine-non-cuda 0.3.13.post1 from PyPI, without their dependencies (neither
# uses torch, aiohttp or requests on these paths; nixl-cu12 would pull 5 GB of CUDA wheels), and
# numpy. Mooncake needs libibverbs1 (installed with apt-get when missing). Every run's figures
# go to bench-peers.jsonl (or --out).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${KVLINK_PEERS_VENV:-$repo/target/bench-peers-venv}
NIXL=nixl-cu12==1.5.1
MOONCAKE=mooncake-transfer-engine-non-cuda==0.3.13.post1

vm=0
args=()
for a in "$@"; do
  if [[ $a == --vm ]]; then vm=1; else args+=("$a"); fi
done

"$repo/tools/deps.sh" libibverbs1
cargo build --release -q -p kvlink-bench --manifest-path "$repo/Cargo.toml"
if ! "$venv/bin/python" -c 'import numpy, nixl_cu12._api, mooncake.engine' 2>/dev/null; then
  echo "bench-peers: installing $NIXL and $MOONCAKE into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q numpy
  "$venv/bin/pip" install -q --no-deps "$NIXL" "$MOONCAKE"
fi

# NIXL's wheel bundles a libibverbs built for another distribution's paths. A verbs provider
# (rxe here, mlx5 on a real NIC) registers with the libibverbs it is linked against, so the
# bundled copy finds no device on Debian ("no userspace device-specific driver found for
# rxe0"); NIXL is pointed at the system's library instead, as a Debian user would have to.
if [[ $vm == 1 ]]; then
  for lib in "$venv"/lib/python3*/site-packages/nixl_cu12.libs/libibverbs-*.so.*; do
    [[ -L $lib || $lib == *.bundled ]] && continue
    mv "$lib" "$lib.bundled"
    ln -s /usr/lib/x86_64-linux-gnu/libibverbs.so.1 "$lib"
  done
fi

run=("$venv/bin/python" "$repo/tools/bench-peers/run.py" --bench "$repo/target/release/kvlink-bench")
if [[ $vm == 0 ]]; then
  exec "${run[@]}" "${args[@]}"
fi
# In the VM: RDMA only (its two emulated CPUs make TCP figures meaningless), the targets on
# rxe0's address. The caches (2 GiB a side, twice in kvlink's one process) need the memory.
export SOFTROCE_MEMORY=${SOFTROCE_MEMORY:-12G}
export SOFTROCE_RWDIRS="${SOFTROCE_RWDIRS:-} $repo"
# The VM moves about 0.1 GB/s: 1,024-token requests (128 MiB), 8 measured, 200 reads per
# latency size; the layout, the block pattern and the pieces are the default's.
exec "$repo/tools/softroce/run.sh" -- "${run[@]}" --paths rdma --host 10.200.0.1 \
  --workload "--tokens 1024 --requests 8" --latency-requests 200 \
  --out "$repo/bench-peers-rdma.jsonl" "${args[@]}"
