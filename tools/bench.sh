#!/usr/bin/env bash
# The README's main job: installs build dependencies when missing, then runs kvlink-bench
# (by default a loopback transfer of 4,096-token requests of a Llama-3-8B-like layout with random
# block ids). Arguments go to kvlink-bench; see `tools/bench.sh --help`.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
"$repo/tools/deps.sh"
exec cargo run --quiet --release --manifest-path "$repo/Cargo.toml" -p kvlink-bench -- "$@"
