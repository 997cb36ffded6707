#!/usr/bin/env bash
# Heterogeneous TP and block groups against same-TP reads of the same bytes, in one run:
# kvlink-bench loopback with every rank of both sides in one process, over the configurations
# below, alternating, ROUNDS times; prints the median GB/s of each (the bytes all decode ranks
# moved) and its ratio to the same-TP run (1 -> 1) measured in the same rounds.
#
#   tools/bench-tp.sh                                  # TCP on this host
#   ROUNDS=3 tools/bench-tp.sh --transport tcp --tokens 2048
#   tools/softroce/run.sh -- tools/bench-tp.sh --transport rdma --rdma-device rxe0 \
#       --tokens 256 --requests 4      # RDMA inside the SoftRoCE VM (ratios only)
#
# Extra arguments go to every kvlink-bench run. Every run also checks every byte it moved
# with VERIFY=1 (slower; off by default so the figures measure transfers alone).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bench=${KVLINK_BENCH:-$repo/target/release/kvlink-bench}
if [ ! -x "$bench" ]; then
  "$repo/tools/deps.sh"
  cargo build --quiet --release --manifest-path "$repo/Cargo.toml" -p kvlink-bench
fi
rounds=${ROUNDS:-3}
verify=()
[ "${VERIFY:-0}" = 1 ] && verify=(--verify)

# name | kvlink-bench arguments
configs=(
  "1 -> 1|--prefill-tp 1 --decode-tp 1 --groups 1"
  "2 -> 2|--prefill-tp 2 --decode-tp 2"
  "1 -> 2 hnd|--prefill-tp 1 --decode-tp 2 --head-layout hnd"
  "1 -> 4 hnd|--prefill-tp 1 --decode-tp 4 --head-layout hnd"
  "2 -> 1 hnd|--prefill-tp 2 --decode-tp 1 --head-layout hnd"
  "4 -> 1 hnd|--prefill-tp 4 --decode-tp 1 --head-layout hnd"
  "1 -> 2 nhd|--prefill-tp 1 --decode-tp 2 --head-layout nhd"
  "2 -> 1 nhd|--prefill-tp 2 --decode-tp 1 --head-layout nhd"
  "mla 1 -> 2|--preset deepseek-v3-mla --prefill-tp 1 --decode-tp 2"
  "mla 2 -> 1|--preset deepseek-v3-mla --prefill-tp 2 --decode-tp 1"
  "mla 1 -> 1|--preset deepseek-v3-mla --prefill-tp 1 --decode-tp 1 --groups 1"
  "1 -> 1, 2 groups|--groups 2"
)

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for r in $(seq 1 "$rounds"); do
  for i in "${!configs[@]}"; do
    args=${configs[$i]#*|}
    # Naming the TP sizes (even 1 -> 1) takes kvlink-bench's multi-rank driver: the same-TP
    # reference runs the same code as the others.
    # shellcheck disable=SC2086
    if ! "$bench" --json "${verify[@]}" $args "$@" >"$out/run.json" 2>"$out/run.err"; then
      echo "bench-tp: ${configs[$i]%%|*} failed:" >&2
      cat "$out/run.err" >&2
      exit 1
    fi
    python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["gb_per_s"])' "$out/run.json" >>"$out/$i"
  done
  echo "bench-tp: round $r of $rounds done" >&2
done

python3 - "$out" "${configs[@]}" <<'PY'
import statistics, sys
out, configs = sys.argv[1], sys.argv[2:]
med = []
for i, c in enumerate(configs):
    vals = [float(x) for x in open(f"{out}/{i}").read().split()]
    med.append((c.split("|")[0], statistics.median(vals), vals))
ref = {"": med[0][1], "mla": next(m for n, m, _ in med if n == "mla 1 -> 1")}
print("| prefill -> decode | GB/s (median) | vs same TP (1 -> 1, same model) | rounds |")
print("|---|---|---|---|")
for name, m, vals in med:
    base = ref["mla"] if name.startswith("mla") else ref[""]
    print(f"| {name} | {m:.3g} | {m / base:.2f}x | {', '.join(f'{v:.3g}' for v in vals)} |")
PY
