#!/usr/bin/env bash
# KV events end to end on tcp loopback: kvlink's publisher against a vLLM-style Python publisher
# (msgspec structs and encoder, pyzmq PUB: tools/events-reference-publisher.py), both read by the same
# kvlink subscriber (`kvlink-events tail --quiet`), alternating, in the same run. Same workload
# on both sides: events built per batch from hashes and token ids made beforehand.
# Prints each run (publisher-side and receiver-side block entries per second, and the CPU time
# per block entry of the publishing process and of the receiving one, every thread counted) and
# ratios of medians. Shapes: "EVENTS_PER_BATCH HASHES_PER_EVENT"; the default 256 x 1 is one event per
# 16-token page (what the page splitter emits), 32 x 16 is one event per request step.
#
#   tools/bench-events-vs-python.sh
#   ROUNDS=5 BATCHES=8000 tools/bench-events-vs-python.sh
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-3}
batches=${BATCHES:-4000}
port=${EVENTS_PORT:-5311}
shapes=${SHAPES:-"256x1 32x16"}
py="$repo/.venv/bin/python"

if ! "$py" -c 'import zmq, msgspec' 2>/dev/null; then
  [ -x "$repo/.venv/bin/pip" ] || python3 -m venv "$repo/.venv"
  "$repo/.venv/bin/pip" install -q --disable-pip-version-check pyzmq msgspec msgpack
fi
cargo build --release -q -p kvlink-events-cli --manifest-path "$repo/Cargo.toml"
tool="$repo/target/release/kvlink-events"
field() { python3 -c "import json,sys; print('%.0f' % json.loads(sys.argv[1])['$1'])" "$2"; }

# Runs one publisher command against a fresh tail; prints "PUBLISHER_RATE RECEIVED_RATE".
once() {
  local out err
  out=$(mktemp); err=$(mktemp)
  "$tool" tail --endpoint "tcp://127.0.0.1:$port" --quiet --idle-exit 3 >"$out" 2>"$err" &
  local tail=$!
  sleep 0.3
  local pub
  pub=$("$@" 2>>"$err" | tail -n 1)
  wait "$tail"
  local got
  got=$(cat "$out")
  if [ "$(field batches "$got")" != "$batches" ]; then
    echo "bench: the subscriber got $(field batches "$got") of $batches batches" >&2
    cat "$err" >&2
    exit 1
  fi
  # Rates, then CPU nanoseconds per block entry of the publishing and the receiving process.
  python3 - "$pub" "$got" <<'PY'
import json, sys
p, g = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"{p['entries_per_s']:.0f} {g['entries_per_s']:.0f} "
      f"{p['cpu_s'] / p['entries'] * 1e9:.1f} {g['cpu_s'] / g['entries'] * 1e9:.1f}")
PY
  rm -f "$out" "$err"
}

median() { sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }

for shape in $shapes; do
  epb=${shape%x*}; hpe=${shape#*x}
  py_pub=(); py_e2e=(); kv_pub=(); kv_e2e=(); py_cpu=(); py_rcpu=(); kv_cpu=(); kv_rcpu=()
  for r in $(seq "$rounds"); do
    read -r a b ac bc < <(once "$py" "$repo/tools/events-reference-publisher.py" --endpoint "tcp://127.0.0.1:$port" \
      --batches "$batches" --events-per-batch "$epb" --hashes-per-event "$hpe")
    py_pub+=("$a"); py_e2e+=("$b"); py_cpu+=("$ac"); py_rcpu+=("$bc")
    # The subscriber's queue at the publisher bounded by messages only, as libzmq's (pyzmq's)
    # high-water mark is: the run is as long as BATCHES makes it, and nothing may be lost.
    read -r c d cc dc < <(once "$tool" publish --endpoint "tcp://*:$port" --synthetic "$batches" \
      --events-per-batch "$epb" --hashes-per-event "$hpe" --linger-ms 3000 --subscriber-hwm-mib 65536)
    kv_pub+=("$c"); kv_e2e+=("$d"); kv_cpu+=("$cc"); kv_rcpu+=("$dc")
    printf 'shape %-6s round %d: python publisher %9s entries/s (received %9s; CPU ns/entry: publisher %6s, receiver %6s); kvlink publisher %9s (received %9s; CPU %6s, %6s)\n' \
      "$shape" "$r" "$a" "$b" "$ac" "$bc" "$c" "$d" "$cc" "$dc"
  done
  m() { printf '%s\n' "$@" | median; }
  python3 - "$shape" "$(m "${py_pub[@]}")" "$(m "${py_e2e[@]}")" "$(m "${kv_pub[@]}")" "$(m "${kv_e2e[@]}")" \
    "$(m "${py_cpu[@]}")" "$(m "${py_rcpu[@]}")" "$(m "${kv_cpu[@]}")" "$(m "${kv_rcpu[@]}")" <<'PY'
import sys
shape = sys.argv[1]
pp, pe, kp, ke, pc, prc, kc, krc = map(float, sys.argv[2:])
print(f"shape {shape} medians (M block entries/s): python publisher {pp/1e6:.2f}, received {pe/1e6:.2f}; "
      f"kvlink publisher {kp/1e6:.2f}, received {ke/1e6:.2f}")
print(f"shape {shape} CPU ns per entry: python publisher {pc:.0f}, kvlink publisher {kc:.0f} "
      f"({kc/pc:.2f}x); receiver fed by python {prc:.0f}, fed by kvlink {krc:.0f}")
print(f"shape {shape} kvlink end to end / python end to end: {ke/pe:.2f}x; "
      f"publisher / publisher: {kp/pp:.2f}x")
PY
done
