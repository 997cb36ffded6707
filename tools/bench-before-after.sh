#!/usr/bin/env bash
# A change against the commit before it, in one run on this machine: kvlink-bench over TCP and
# the same-host path (Llama-3-8B-like layout, 4,096-token requests, random block ids; GB/s and
# p50 / p99 request latency), and the KV-event stream (`kvlink-events publish --synthetic` read by
# `kvlink-events tail`: block entries per second received, CPU per entry on each side), the two
# builds alternating round by round, which runs first alternating too, so that the machine's
# noise falls on both. Builds REV in a
# worktree under target/before/ (its own target dir, kept for the next run). Prints each round,
# the medians and after / before ratios; the tools' own output goes to target/before/bench.log.
#
#   tools/bench-before-after.sh REV            # REV: a commit, tag or branch
#   ROUNDS=7 tools/bench-before-after.sh c87615f
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
rev=${1:?"usage: tools/bench-before-after.sh REV"}
rounds=${ROUNDS:-5}
port=${EVENTS_PORT:-5321}
sha=$(git rev-parse --short "$rev^{commit}")
tools/deps.sh
# The tools' own progress lines go here, not between the rounds.
log=target/before/bench.log
mkdir -p target/before
: >"$log"

before=target/before/$sha
if [ ! -d "$before/src" ]; then
  git worktree add -q --detach "$before/src" "$sha"
fi
echo "bench: building $sha (before) and the working tree (after), release"
CARGO_TARGET_DIR="$repo/$before/target" cargo build --release -q \
  --manifest-path "$before/src/Cargo.toml" -p kvlink-bench -p kvlink-events-cli
cargo build --release -q -p kvlink-bench -p kvlink-events-cli

# bench BIN_DIR TRANSPORT: "GB/s p50_ms p99_ms".
bench() {
  "$1/kvlink-bench" --preset llama-3-8b --tokens 4096 --pattern random --requests 32 \
    --transport "$2" --json 2>>"$log" |
    python3 -c 'import json,sys; d=json.load(sys.stdin); l=d["latency_ms"]; print("%.3f %.3f %.3f" % (d["gb_per_s"], l["p50"], l["p99"]))'
}

# events BIN_DIR: "received_entries_per_s publisher_cpu_ns_per_entry receiver_cpu_ns_per_entry".
events() {
  local out
  out=$(mktemp)
  "$1/kvlink-events" tail --endpoint "tcp://127.0.0.1:$port" --quiet --idle-exit 3 >"$out" 2>>"$log" &
  local tail=$!
  sleep 0.3
  local pub
  pub=$("$1/kvlink-events" publish --endpoint "tcp://*:$port" --synthetic 4000 \
    --events-per-batch 256 --hashes-per-event 1 --linger-ms 3000 --subscriber-hwm-mib 65536 2>>"$log" | tail -n 1)
  wait "$tail"
  python3 - "$pub" "$(cat "$out")" <<'PY'
import json, sys
p, g = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert g["batches"] == 4000, f"the subscriber got {g['batches']} of 4000 batches"
print(f"{g['entries_per_s']:.0f} {p['cpu_s'] / p['entries'] * 1e9:.1f} {g['cpu_s'] / g['entries'] * 1e9:.1f}")
PY
  rm -f "$out"
}

declare -A col
add() { col[$1]="${col[$1]:-} $2"; }
for r in $(seq "$rounds"); do
  # The order alternates: whichever build runs second in a round runs on a warmer, busier
  # machine (the untouched events stream read 0.89x for the second one, 2026-12-03).
  order="before after"
  [ $((r % 2)) = 0 ] && order="after before"
  for side in $order; do
    dir=target/release
    [ "$side" = before ] && dir=$before/target/release
    read -r tg tp50 tp99 < <(bench "$dir" tcp)
    read -r lg lp50 lp99 < <(bench "$dir" local)
    read -r er epc erc < <(events "$dir")
    for k in tg tp50 tp99 lg lp50 lp99 er epc erc; do add "$side.$k" "${!k}"; done
    printf 'round %d %-6s: tcp %s GB/s (p50 %s ms, p99 %s ms); local %s GB/s (p50 %s, p99 %s); events %s entries/s received (CPU ns/entry: publisher %s, receiver %s)\n' \
      "$r" "$side" "$tg" "$tp50" "$tp99" "$lg" "$lp50" "$lp99" "$er" "$epc" "$erc"
  done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
echo "medians over $rounds rounds, $sha (before) and the working tree (after):"
for k in "tg:tcp GB/s" "tp50:tcp p50 ms" "tp99:tcp p99 ms" "lg:local GB/s" "lp50:local p50 ms" \
  "lp99:local p99 ms" "er:events entries/s received" "epc:events publisher CPU ns/entry" \
  "erc:events receiver CPU ns/entry"; do
  b=$(echo "${col[before.${k%%:*}]}" | median)
  a=$(echo "${col[after.${k%%:*}]}" | median)
  python3 -c "import sys; n,b,a=sys.argv[1:]; print('  %-34s before %12s  after %12s  after/before %.3f' % (n, b, a, float(a)/float(b)))" "${k#*:}" "$b" "$a"
done
