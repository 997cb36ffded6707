#!/usr/bin/env bash
# Test command part "checks": layers and cycles, the tally's own tests, the events crate's
# dependencies, format and lint. Any failure stops the whole command.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

echo "test: layers and cycles (no module imports from a layer above it, no two files import each other)"
python3 tools/check_layers.py
python3 tools/check_cycles.py
echo "test: no compiled Python committed"
if pyc=$(git ls-files -- '*.pyc' '*.pyo' 2>/dev/null | grep .); then
  echo "test: compiled Python is committed (git rm --cached them): $pyc" >&2
  exit 1
fi
echo "test: the test command's tally and the soak's checks (tools/test, tools/soak)"
python3 -m unittest discover -q -s tools/test
python3 -m unittest discover -q -s tools/soak
# A router depends on the events crate alone: none of the transfer engine may come with it.
events_tree=$(cargo tree -p kvlink-events -e normal --prefix none --quiet)
if engine_deps=$(grep -E '^(kvlink|sideway|rdma-mummy-sys|cudarc|libloading) ' <<<"$events_tree"); then
  echo "test: kvlink-events depends on the transfer engine: $engine_deps" >&2
  exit 1
fi
echo "test: cargo fmt --check"
cargo fmt --all -- --check
# Clippy lints every crate as it is built (lib.sh: the host part's build is the lint); here,
# that a lint fails such a build.
echo "test: clippy lints the builds (-D warnings; a crate with a lint is refused)"
lint_probe
