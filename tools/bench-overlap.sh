#!/usr/bin/env bash
# How much of a request's KV transfer kvlink's progressive reads hide behind the prefill's
# compute (tools/bench-overlap.py: the whole flow against the progressive one, per model, prompt
# length and concurrency, exposed time p50 and p99, and the share hidden).
#
#   tools/bench-overlap.sh                                  # Llama 3 8B and 70B, 256 to 32K
#                                                           # tokens, 1 and 8 at once, over TCP
#   tools/bench-overlap.sh --transport auto --lengths 4K    # options of tools/bench-overlap.py
#
# The Python bindings are built (release) into a venv of their own (target/bench-overlap-venv,
# or $KVLINK_BENCH_VENV), with numpy and maturin, on first use.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${KVLINK_BENCH_VENV:-$repo/target/bench-overlap-venv}
if [ ! -x "$venv/bin/maturin" ]; then
  echo "bench-overlap: installing numpy and maturin into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check numpy maturin
fi
(cd "$repo/ffi/python" &&
  VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" CARGO_TARGET_DIR="$repo/target/bench-overlap" \
    maturin develop --release --quiet)
exec "$venv/bin/python" "$repo/tools/bench-overlap.py" "$@"
