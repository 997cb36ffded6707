#!/usr/bin/env bash
# The same-host path against one plain single-threaded copy of the same cache, measured by
# kvlink-bench in the same run (its "reference"), and against TCP loopback, alternating rounds
# so that noise from other tenants hits all three. Prints each round and the medians. Extra
# arguments go to kvlink-bench (for example `--memory emulated`, `--preset deepseek-v3-mla`).
#
#   ROUNDS=5 tools/bench-local.sh
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-3}
"$repo/tools/deps.sh"
cargo build --release -q -p kvlink-bench --manifest-path "$repo/Cargo.toml"
bench="$repo/target/release/kvlink-bench"

# Prints "gb_per_s reference_gb_per_s".
once() {
  "$bench" --preset llama-3-8b --tokens 4096 --pattern random --requests 32 --json "$@" |
    python3 -c 'import json,sys; d=json.load(sys.stdin); print("%.3f %s" % (d["gb_per_s"], d["reference_gb_per_s"]))'
}

median() { sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

loc=(); ref=(); tcp=()
for i in $(seq "$rounds"); do
  read -r l r < <(once --transport local "$@")
  read -r t _ < <(once --transport tcp "$@")
  echo "round $i: local $l GB/s, single-threaded copy $r GB/s, tcp $t GB/s"
  loc+=("$l"); ref+=("$r"); tcp+=("$t")
done
l=$(printf '%s\n' "${loc[@]}" | median)
r=$(printf '%s\n' "${ref[@]}" | median)
t=$(printf '%s\n' "${tcp[@]}" | median)
python3 - "$l" "$r" "$t" <<'PY'
import sys
l, r, t = map(float, sys.argv[1:])
print(f"medians: local {l:.2f} GB/s, copy {r:.2f} GB/s, tcp {t:.2f} GB/s")
print(f"local / single-threaded copy = {l / r:.2f}x (goal >= 0.7x); local / tcp = {l / t:.2f}x")
PY
