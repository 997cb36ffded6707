#!/usr/bin/env bash
# The project's test command (README, CI): format and lint checks, then every test.
# Runs on a fresh machine with a Rust toolchain; installs anything else it needs.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

if ! command -v cargo >/dev/null; then
  echo "test: cargo not found; install Rust (https://rustup.rs) and retry" >&2
  exit 1
fi

echo "test: cargo fmt --check"
cargo fmt --all -- --check
echo "test: cargo clippy -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "test: cargo test"
cargo test --workspace 2>&1 | tee /tmp/kvlink-test.log
# One summary line over all test binaries.
awk '/^test result:/ {p += $4; f += $6; i += $8} END {printf "tests: %d passed, %d failed, %d skipped\n", p, f, i}' /tmp/kvlink-test.log
