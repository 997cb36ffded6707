#!/usr/bin/env bash
# The KV-event transport decision (issue #17, docs/benchmarks.md): the pure-Rust `zeromq` crate
# against the libzmq-backed `zmq` crate (libzmq 4.3, what pyzmq wraps), on tcp loopback, each
# library talking to itself, alternating, in the same run:
#  - rate: a PUB sends COUNT messages `[topic, seq, payload]` of SIZE bytes (30 KB is one
#    scheduler step of 256 one-page events) as fast as it can; a SUB in another process takes
#    them all. Messages per second, and CPU microseconds per message on each side (whole
#    process, user + sys).
#  - slow subscriber: the SUB sleeps DELAY_US per message; how many arrive, and the
#    publisher's peak memory (a PUB must bound what it queues for a slow peer).
#
#   tools/zmq-compare.sh
#   ROUNDS=5 COUNT=40000 SIZE=30000 tools/zmq-compare.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-3}
count=${COUNT:-20000}
size=${SIZE:-30000}
slow_count=${SLOW_COUNT:-20000}
delay_us=${DELAY_US:-200}
port=${PORT:-5411}
export CARGO_TARGET_DIR="$repo/target/zmq-compare"
cargo build --release --quiet --manifest-path "$repo/tools/zmq-compare/Cargo.toml"
bin="$CARGO_TARGET_DIR/release/zmq-compare"

pair() { # lib count size delay
  local s; s=$(mktemp)
  "$bin" sub "$1" "tcp://127.0.0.1:$port" "$2" "$4" >"$s" &
  local sub=$!
  local p; p=$("$bin" pub "$1" "tcp://127.0.0.1:$port" "$2" "$3")
  wait "$sub"
  echo "$p $(cat "$s")"
  rm -f "$s"
}

python3 - "$rounds" "$count" "$size" "$slow_count" "$delay_us" <<'PY' > /tmp/zmq-compare-plan
import sys
rounds = int(sys.argv[1])
for r in range(rounds):
    for lib in ("zeromq", "libzmq"):
        print("rate", lib, sys.argv[2], sys.argv[3], 0)
for lib in ("zeromq", "libzmq"):
    print("slow", lib, sys.argv[4], sys.argv[3], sys.argv[5])
PY
results=$(mktemp)
while read -r kind lib n sz d; do
  line=$(pair "$lib" "$n" "$sz" "$d")
  echo "$kind $line" | tee -a "$results"
done < /tmp/zmq-compare-plan
python3 - "$results" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    kind, rest = line.split(" ", 1)
    p, s = rest.strip().split("} {")
    p, s = json.loads(p + "}"), json.loads("{" + s)
    rows.setdefault((kind, p["lib"]), []).append((p, s))
for lib in ("zeromq", "libzmq"):
    runs = rows.get(("rate", lib), [])
    if not runs:
        continue
    rate = statistics.median(s["messages"] / max(s["secs"], 1e-9) for p, s in runs)
    pcpu = statistics.median(p["cpu_s"] / p["messages"] * 1e6 for p, s in runs)
    scpu = statistics.median(s["cpu_s"] / max(s["messages"], 1) * 1e6 for p, s in runs)
    lost = max(p["messages"] - s["messages"] for p, s in runs)
    print(f"rate {lib:7s}: {rate:9.0f} msg/s received (median of {len(runs)}), "
          f"publisher {pcpu:6.2f} us CPU/msg, subscriber {scpu:6.2f} us CPU/msg, most lost in a run {lost}")
for lib in ("zeromq", "libzmq"):
    for p, s in rows.get(("slow", lib), []):
        print(f"slow subscriber {lib:7s}: {s['messages']} of {p['messages']} received, "
              f"publisher peak RSS {p['max_rss_kb'] / 1024:.0f} MiB, subscriber {s['max_rss_kb'] / 1024:.0f} MiB")
PY
rm -f "$results"
