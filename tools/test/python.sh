#!/usr/bin/env bash
# Test command part "python": the Python bindings' wheel (maturin, abi3, manylinux_2_17) built
# into target/wheels and installed into .venv, then their tests.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
MIN_PYTHON=68

echo "test: Python bindings (maturin wheel into .venv, pytest)"
if ! prepared venv; then
  tally fail --part python --label python --why ".venv could not be prepared: $(prepared_why venv)"
  exit 0
fi
# The KV-event interop tests drive this tool against Python peers.
cargo build --workspace --bin kvlink-events --quiet
export KVLINK_EVENTS_BIN="$repo/target/debug/kvlink-events"
export CARGO_TARGET_DIR="$repo/target/python"
cargo fmt --manifest-path ffi/python/Cargo.toml -- --check
rm -rf target/wheels
# The wheel users install, as a release build makes it but for the optimisation (the dev
# profile: a release build took half again as long here, and the tests measure no speed): abi3,
# linked by zig against glibc 2.17 so that it passes maturin's manylinux_2_17 (manylinux2014)
# check, the oldest policy Rust's standard library supports. The extension's crate is linted as
# it is built (lib.sh), in place of a separate `cargo clippy` of ffi/python.
(cd ffi/python && PATH="$repo/.venv/bin:$PATH" ../../.venv/bin/maturin build --profile dev --quiet \
  --zig --compatibility manylinux_2_17 -o "$repo/target/wheels")
unset CARGO_TARGET_DIR
.venv/bin/pip install -q --disable-pip-version-check --force-reinstall target/wheels/kvlink-*.whl
pytest_part python python "$MIN_PYTHON" python "$repo/.venv/bin/python"
