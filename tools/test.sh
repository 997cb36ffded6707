#!/usr/bin/env bash
# The project's test command (README, CI): format and lint checks, every Rust test on the host,
# the Python bindings' tests (wheel built with maturin into .venv), then the RDMA tests for real
# inside a SoftRoCE VM (tools/softroce/run.sh). Installs what it needs.
#   KVLINK_SKIP_VM=1 tools/test.sh    # host only (the RDMA tests then report themselves skipped)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
tools/deps.sh

echo "test: cargo fmt --check"
cargo fmt --all -- --check
echo "test: cargo clippy -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "test: cargo test (host)"
log=$(mktemp)
set +e
cargo test --workspace --no-fail-fast 2>&1 | tee "$log"
host_rc=${PIPESTATUS[0]}
set -e
host_passed=$(awk '/^test result:/ {p += $4} END {print p + 0}' "$log")
host_failed=$(awk '/^test result:/ {f += $6} END {print f + 0}' "$log")
if [ "$host_rc" -ne 0 ] && [ "$host_failed" -eq 0 ]; then
  echo "test: cargo test failed (exit $host_rc) before reporting failures (build error?)" >&2
  host_failed=1
fi
skipped=$(grep -c ': skipped: no RDMA device' "$log" || true)

echo "test: Python bindings (maturin wheel into .venv, pytest)"
if [ ! -x .venv/bin/pip ]; then
  rm -rf .venv
  if ! python3 -m venv .venv; then
    rm -rf .venv
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv .venv
  fi
fi
.venv/bin/pip install -q --disable-pip-version-check "maturin>=1.5,<2" numpy pytest pyzmq msgpack msgspec
# The KV-event interop tests drive this tool against Python peers.
cargo build -p kvlink-events --quiet
export KVLINK_EVENTS_BIN="$repo/target/debug/kvlink-events"
export CARGO_TARGET_DIR="$repo/target/python"
cargo fmt --manifest-path ffi/python/Cargo.toml -- --check
cargo clippy --manifest-path ffi/python/Cargo.toml --quiet -- -D warnings
rm -rf target/wheels
(cd ffi/python && ../../.venv/bin/maturin build --release --quiet -o "$repo/target/wheels")
unset CARGO_TARGET_DIR
.venv/bin/pip install -q --disable-pip-version-check --force-reinstall target/wheels/kvlink-*.whl
pylog=$(mktemp)
set +e
(cd tests/python && ../../.venv/bin/python -m pytest -q) 2>&1 | tee "$pylog"
py_rc=${PIPESTATUS[0]}
set -e
# pytest's closing line only, e.g. "3 passed, 1 failed in 2.0s" or "=== 1 failed, 3 passed in 2.0s ===".
py_summary=$(grep -E '(passed|failed|error).* in [0-9.]+s' "$pylog" | tail -n 1 || true)
py_passed=$(echo "$py_summary" | awk '{for (i = 1; i < NF; i++) if ($(i + 1) ~ /^passed/) p = $i} END {print p + 0}')
py_failed=$(echo "$py_summary" | awk '{for (i = 1; i < NF; i++) if ($(i + 1) ~ /^(failed|errors?)/) f += $i} END {print f + 0}')
if [ "$py_rc" -ne 0 ] && [ "$py_failed" -eq 0 ]; then py_failed=1; fi

vm_passed=0; vm_failed=0
if [ "${KVLINK_SKIP_VM:-0}" = 1 ]; then
  echo "test: SoftRoCE VM skipped (KVLINK_SKIP_VM=1): the RDMA tests above did not run for real"
else
  echo "test: RDMA tests inside the SoftRoCE VM"
  bin=$(cargo test --test rdma --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    if d.get("reason") == "compiler-artifact" and d.get("executable") and d["target"]["name"] == "rdma":
        print(d["executable"])')
  vmlog=$(mktemp)
  set +e
  tools/softroce/run.sh -- "$bin" --test-threads=1 2>&1 | tee "$vmlog"
  vm_rc=${PIPESTATUS[0]}
  set -e
  vm_passed=$(awk '/^test result:/ {p += $4} END {print p + 0}' "$vmlog")
  vm_failed=$(awk '/^test result:/ {f += $6} END {print f + 0}' "$vmlog")
  if [ "$vm_rc" -ne 0 ] && [ "$vm_failed" -eq 0 ]; then
    echo "test: the SoftRoCE VM run failed (exit $vm_rc) before reporting results" >&2
    vm_failed=1
  fi
  if grep -q ': skipped: no RDMA device' "$vmlog"; then
    echo "test: an RDMA test skipped inside the VM" >&2
    vm_failed=$((vm_failed + 1))
  fi
fi

echo "test summary: host $host_passed passed, $host_failed failed ($skipped RDMA tests skipped on the host: no RDMA device); python $py_passed passed, $py_failed failed; SoftRoCE VM: $vm_passed RDMA tests passed, $vm_failed failed"
echo "tests: $((host_passed + py_passed + vm_passed)) passed, $((host_failed + py_failed + vm_failed)) failed"
[ "$host_failed" -eq 0 ] && [ "$py_failed" -eq 0 ] && [ "$vm_failed" -eq 0 ]
