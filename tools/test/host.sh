#!/usr/bin/env bash
# Test command part "host": every Rust test of the workspace on this machine, then the
# transfer suites again with every engine keyed. Tests that need a device this machine lacks
# (RDMA, CUDA) report a skip (tests/common's `skip`) and are counted as skipped.
#
# Every cargo command of the test command names --workspace: cargo resolves features over the
# packages it is asked for, so `-p kvlink` or `-p kvlink-soak` would build kvlink, tokio and
# the rest a second time with other features (minutes here). With --workspace each later part
# finds its binaries built by this one.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
MIN_HOST=160
MIN_KEYED=29

echo "test: cargo test (host)"
cargo_part host host "$MIN_HOST" count \
  "the ignored ones are the two-process tests' child helpers and the fuzz seed writer" \
  cargo test --workspace --no-fail-fast

# The legitimate path with authentication on (the suites that play peers without a key or
# speak the wire by hand, auth, faults and grants, are left out; grants runs its own keyed
# engines).
echo "test: cargo test with a deployment key (KVLINK_AUTH_KEY; transfer suites)"
cargo_part keyed "host, every engine keyed" "$MIN_KEYED" count "" \
  env KVLINK_AUTH_KEY=test-suite-deployment-key-0123456789 cargo test --workspace --no-fail-fast \
  --test e2e_tcp --test two_process --test gpu --test hetero_tp --test local

# The benchmarks are not run here, but built (and so linted: lib.sh) as `clippy --all-targets`
# would check them; then the programs the parts after this one run.
echo "test: the benchmarks built (not run), and the workspace's programs (kvlink-soak, kvlink-bench, kvlink-events) for the parts after this one"
cargo test --workspace --benches --no-run --quiet
cargo build --workspace --bins --quiet
