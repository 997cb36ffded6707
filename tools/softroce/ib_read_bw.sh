#!/usr/bin/env bash
# Reference RDMA READ bandwidth on the SoftRoCE device, for comparison with kvlink.
#
# Usage (inside the VM that tools/softroce/run.sh boots):
#   tools/softroce/run.sh -- tools/softroce/ib_read_bw.sh SIZE ITERS
#
# Runs a perftest ib_read_bw server and client on the same device (loopback through the
# dummy netdev) and prints one line on stdout:
#   ib_read_bw size=<bytes> gbps=<GB/s>
# where GB/s is 10^9 bytes per second (as kvlink-bench reports). perftest's own output goes
# to stderr only when something fails.
#
# Environment: KVLINK_RDMA_DEVICE (default rxe0), SOFTROCE_GID_INDEX (default 1),
# SOFTROCE_ADDR (default 10.200.0.1), SOFTROCE_PERF_PORT (default 18515),
# SOFTROCE_PERF_TIMEOUT (seconds per side, default 600).
set -euo pipefail

log() { echo "softroce: $*" >&2; }
die() { log "ib_read_bw: $*"; exit 1; }

[[ $# == 2 && $1 =~ ^[0-9]+$ && $2 =~ ^[0-9]+$ ]] || { echo "usage: $0 SIZE ITERS" >&2; exit 2; }
SIZE=$1
ITERS=$2
DEVICE=${KVLINK_RDMA_DEVICE:-rxe0}
GID_INDEX=${SOFTROCE_GID_INDEX:-1}
ADDR=${SOFTROCE_ADDR:-10.200.0.1}
PORT=${SOFTROCE_PERF_PORT:-18515}
LIMIT=${SOFTROCE_PERF_TIMEOUT:-600}

[[ -e /sys/class/infiniband/$DEVICE ]] \
    || die "no verbs device $DEVICE here (run this inside tools/softroce/run.sh)"
command -v ib_read_bw >/dev/null || die "ib_read_bw not found (Debian package perftest)"

WORK=$(mktemp -d)
SERVER_PID=""
cleanup() {
    [[ -n $SERVER_PID ]] && kill "$SERVER_PID" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

# -F: do not refuse to run when the CPU frequency is not pinned (it never is in the VM).
PERF_ARGS=(-d "$DEVICE" -x "$GID_INDEX" -s "$SIZE" -n "$ITERS" -p "$PORT" -F)

show_logs() {
    local f
    for f in server client; do
        [[ -f $WORK/$f.log ]] && { echo "--- ib_read_bw $f ---"; cat "$WORK/$f.log"; } >&2
    done
    return 0
}

# Server first; the client may connect once its TCP port listens.
timeout "$LIMIT" ib_read_bw "${PERF_ARGS[@]}" >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
for ((i = 0; i < 100; i++)); do
    [[ -n $(ss -Hltn "sport = :$PORT" 2>/dev/null) ]] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { show_logs; die "server exited early"; }
    sleep 0.1
done

client_rc=0
timeout "$LIMIT" ib_read_bw "${PERF_ARGS[@]}" "$ADDR" >"$WORK/client.log" 2>&1 || client_rc=$?
server_rc=0
wait "$SERVER_PID" || server_rc=$?
SERVER_PID=""
if [[ $client_rc != 0 || $server_rc != 0 ]]; then
    show_logs
    die "client exited with $client_rc, server with $server_rc"
fi

# The result row follows the header; without --report_gbits perftest reports MiB/s.
#  #bytes  #iterations  BW peak[MB/sec]  BW average[MB/sec]  MsgRate[Mpps]
#  65536   2000         52.71            21.10               0.000338
avg_mib=$(awk -v size="$SIZE" '
    /#bytes/ && /BW average\[MB\/sec\]/ { header = 1; next }
    header && $1 == size { print $4; exit }
' "$WORK/client.log")
[[ $avg_mib =~ ^[0-9]+(\.[0-9]+)?$ ]] || { show_logs; die "cannot find the bandwidth in the client output"; }

awk -v size="$SIZE" -v mib="$avg_mib" \
    'BEGIN { printf "ib_read_bw size=%d gbps=%.6f\n", size, mib * 1048576 / 1e9 }'
