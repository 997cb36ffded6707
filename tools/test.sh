#!/usr/bin/env bash
# The project's test command (README, CI): format and lint checks, every Rust test on the host,
# the Python bindings' tests (wheel built with maturin into .venv), the vLLM connector through
# vLLM's own Scheduler (the same wheel installed into .venv-vllm beside a pinned vLLM), the
# SGLang backend through SGLang's own queues (a pinned SGLang wheel in the same venv), the ATOM
# connector through ATOM's own engine (its pinned snapshot, same venv), then the RDMA tests for
# real inside a SoftRoCE VM (tools/softroce/run.sh). Installs what it needs (tools/deps.sh,
# PyPI into .venv and .venv-vllm, the VM's packages).
#   KVLINK_SKIP_VM=1 tools/test.sh    # host only: the VM part is reported as skipped
#
# The closing lines say what ran, per part: passed, failed, and skipped with the reason. A test
# that returns early for lack of hardware says "<name>: skipped: <reason> (...)" on stderr and is
# counted as skipped, not passed. Helpers that tests spawn as child processes are #[ignore]d and
# counted nowhere. A part that ran fewer tests than its minimum fails the run (a build that
# produced no tests must not look green), and so does any skip inside the VM or in Python (the
# command installs everything those tests need).
set -euo pipefail

# Fewer tests than these, run for real (skips excluded), fail the part.
MIN_HOST=160
MIN_KEYED=29
MIN_PYTHON=49
MIN_VM=20
MIN_VLLM=42
MIN_SGLANG=59
MIN_ATOM=27
MIN_ENGINE_EVENTS=6
# The vLLM releases the connector is tested against: the newest (in .venv-vllm33) and the one
# before it (in .venv-vllm, where the SGLang backend's tests also run).
VLLM_PIN="vllm==0.33.0"
VLLM_OLD_PIN="vllm==0.32.0"
# The SGLang release the transfer backend is tested against. Its wheel goes into .venv-vllm
# without its dependencies (it pins another torch than vLLM 0.32), plus the few its
# disaggregation code imports that vLLM does not bring.
SGLANG_PIN="sglang==0.5.23"
SGLANG_EXTRAS="orjson==3.13.0 ipython==9.18.1 gguf==0.19.0"
# ATOM is not on PyPI: its tests run ATOM from the pinned snapshot (tests/atom/harness.py finds
# it beside the checkout, or at KVLINK_ATOM_SNAPSHOT) in .venv-vllm, plus the one module ATOM's
# engine imports that vLLM does not bring.
ATOM_EXTRAS="xxhash==4.1.0"

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
tools/deps.sh

# Sums the "test result:" lines of a cargo test log: "passed failed ignored".
cargo_counts() {
  awk '/^test result:/ {p += $4; f += $6; i += $8} END {print p + 0, f + 0, i + 0}' "$1"
}
# The skips a cargo test log reports, one "name<TAB>reason" per skipped test (the reason without
# its parenthesised detail), deduplicated.
cargo_skips() {
  grep -oE '[A-Za-z0-9_]+: skipped: [^(]*' "$1" | sed -E 's/: skipped: /\t/; s/ +$//' | sort -u || true
}
# "n reason, n reason" from cargo_skips output on stdin.
skip_reasons() {
  cut -f2 | sort | uniq -c | awk '{n = $1; $1 = ""; sub(/^ /, ""); printf "%s%d %s", (NR > 1 ? ", " : ""), n, $0}'
}

# Tallies one cargo test run (LOG, its exit status RC, the minimum MIN, a name WHAT) into
# part_passed, part_failed, part_skipped, part_ignored and part_why (" (n reason, ...)" or "").
# An exit without a reported failure (a build error) counts as a failure, and so does a run
# below its minimum.
tally_cargo() {
  local log=$1 rc=$2 min=$3 what=$4 ran skips
  read -r ran part_failed part_ignored < <(cargo_counts "$log")
  skips=$(cargo_skips "$log")
  part_skipped=0
  [ -n "$skips" ] && part_skipped=$(printf '%s\n' "$skips" | wc -l)
  part_passed=$((ran - part_skipped))
  part_why=""
  [ "$part_skipped" -gt 0 ] && part_why=" ($(printf '%s\n' "$skips" | skip_reasons))"
  if [ "$rc" -ne 0 ] && [ "$part_failed" -eq 0 ]; then
    echo "test: cargo test ($what) failed (exit $rc) before reporting failures (build error?)" >&2
    part_failed=1
  fi
  if [ "$part_passed" -lt "$min" ]; then
    echo "test: only $part_passed $what tests passed for real; at least $min expected" >&2
    part_failed=$((part_failed + 1))
  fi
}

# Tallies one pytest run (LOG, exit status RC, minimum MIN, name WHAT) into part_passed,
# part_failed, part_skipped and part_why. A skip counts as a failure (the test command installs
# everything these tests need), and so does an exit without a reported failure or a run below
# its minimum.
tally_pytest() {
  local log=$1 rc=$2 min=$3 what=$4 summary
  # pytest's closing line, e.g. "20 passed, 1 skipped in 2.0s" or "=== 1 failed, 3 passed in 2.0s ===".
  summary=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)\b.* in [0-9.]+s' "$log" | tail -n 1 || true)
  py_count() { { echo "$summary" | grep -oE "[0-9]+ ($1)\b" || true; } | awk '{n += $1} END {print n + 0}'; }
  part_passed=$(py_count passed)
  part_failed=$(py_count 'failed|errors?')
  part_skipped=$(py_count skipped)
  part_why=""
  if [ "$part_skipped" -gt 0 ]; then
    part_why=" ($({ grep -oE '^SKIPPED \[[0-9]+\] [^:]+:[0-9]+: .*' "$log" || true; } | sed -E 's/^SKIPPED \[([0-9]+)\] [^:]+:[0-9]+: /\1\t/' | awk -F'\t' '{printf "%s%d %s", (NR > 1 ? ", " : ""), $1, $2}'))"
    echo "test: $part_skipped $what tests skipped$part_why; this command installs what they need, so a skip is a failure" >&2
    part_failed=$((part_failed + part_skipped))
  fi
  if [ "$rc" -ne 0 ] && [ "$part_failed" -eq 0 ]; then
    echo "test: pytest ($what) failed (exit $rc) before reporting failures" >&2
    part_failed=1
  fi
  if [ "$part_passed" -lt "$min" ]; then
    echo "test: only $part_passed $what tests passed; at least $min expected" >&2
    part_failed=$((part_failed + 1))
  fi
}

echo "test: layers and cycles (no module imports from a layer above it, no two files import each other)"
python3 tools/check_layers.py
python3 tools/check_cycles.py
# A router depends on the events crate alone: none of the transfer engine may come with it.
events_tree=$(cargo tree -p kvlink-events -e normal --prefix none --quiet)
if engine_deps=$(grep -E '^(kvlink|sideway|rdma-mummy-sys|cudarc|libloading) ' <<<"$events_tree"); then
  echo "test: kvlink-events depends on the transfer engine: $engine_deps" >&2
  exit 1
fi
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
tally_cargo "$log" "$host_rc" "$MIN_HOST" host
host_passed=$part_passed host_failed=$part_failed host_skipped=$part_skipped
host_helpers=$part_ignored host_why=$part_why

# The transfer suites again with every engine keyed: the legitimate path with authentication
# on (the suites that play peers without a key or speak the wire by hand, auth, faults and
# grants, are left out; grants runs its own keyed engines).
echo "test: cargo test with a deployment key (KVLINK_AUTH_KEY; transfer suites)"
klog=$(mktemp)
set +e
KVLINK_AUTH_KEY=test-suite-deployment-key-0123456789 cargo test -p kvlink --no-fail-fast \
  --test e2e_tcp --test two_process --test gpu --test hetero_tp --test local 2>&1 | tee "$klog"
key_rc=${PIPESTATUS[0]}
set -e
tally_cargo "$klog" "$key_rc" "$MIN_KEYED" "keyed host"
key_passed=$part_passed key_failed=$part_failed key_skipped=$part_skipped key_why=$part_why

echo "test: Python bindings (maturin wheel into .venv, pytest)"
if [ ! -x .venv/bin/pip ]; then
  rm -rf .venv
  if ! python3 -m venv .venv; then
    rm -rf .venv
    tools/deps.sh python3-venv
    python3 -m venv .venv
  fi
fi
.venv/bin/pip install -q --disable-pip-version-check "maturin>=1.5,<2" ziglang numpy pytest pyzmq msgpack msgspec
# The KV-event interop tests drive this tool against Python peers.
cargo build -p kvlink-events-cli --quiet
export KVLINK_EVENTS_BIN="$repo/target/debug/kvlink-events"
export CARGO_TARGET_DIR="$repo/target/python"
cargo fmt --manifest-path ffi/python/Cargo.toml -- --check
cargo clippy --manifest-path ffi/python/Cargo.toml --quiet -- -D warnings
rm -rf target/wheels
# The wheel users install: abi3, linked by zig against glibc 2.17 so that it passes maturin's
# manylinux_2_17 (manylinux2014) check, the oldest policy Rust's standard library supports.
(cd ffi/python && PATH="$repo/.venv/bin:$PATH" ../../.venv/bin/maturin build --release --quiet \
  --zig --compatibility manylinux_2_17 -o "$repo/target/wheels")
unset CARGO_TARGET_DIR
.venv/bin/pip install -q --disable-pip-version-check --force-reinstall target/wheels/kvlink-*.whl
pylog=$(mktemp)
set +e
# -rs lists each skip with its reason.
(cd tests/python && ../../.venv/bin/python -m pytest -q -rs) 2>&1 | tee "$pylog"
py_rc=${PIPESTATUS[0]}
set -e
tally_pytest "$pylog" "$py_rc" "$MIN_PYTHON" Python
py_passed=$part_passed py_failed=$part_failed py_skipped=$part_skipped py_why=$part_why

# vLLM's own Scheduler drives kvlink's connector (kvlink.vllm) in two processes, against each
# supported vLLM release. vLLM and torch (about 8 GB) go into a venv per release; the kvlink
# wheel built above is installed into it as a user would, without Rust.
# vllm_venv: one venv per vLLM release, the newest layered on the one before.
source tools/vllm-venv.sh
# Runs the connector suite in venv $1 (vLLM pin $2, layered on venv $3 if given); sets
# vl_passed/failed/skipped/why.
vllm_suite() {
  local venv=$1 pin=$2 base=${3:-}
  echo "test: the vLLM connector through vLLM's real Scheduler ($pin in $venv)"
  vl_passed=0; vl_failed=0; vl_skipped=0; vl_why=""
  if ! vllm_venv "$venv" "$pin" "$base"; then
    vl_failed=1
    return 1
  fi
  "$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps target/wheels/kvlink-*.whl
  local vllog vl_rc
  vllog=$(mktemp)
  set +e
  (cd tests/vllm && "../../$venv/bin/python" -m pytest -q -rs -p no:cacheprovider) 2>&1 | tee "$vllog"
  vl_rc=${PIPESTATUS[0]}
  set -e
  tally_pytest "$vllog" "$vl_rc" "$MIN_VLLM" "vLLM ($pin)"
  vl_passed=$part_passed vl_failed=$part_failed vl_skipped=$part_skipped vl_why=$part_why
}
vllm_ready=1
set +e
vllm_suite .venv-vllm "$VLLM_OLD_PIN" || vllm_ready=0
set -e

# SGLang's own queues (prefill bootstrap and inflight, decode prealloc and transfer) drive
# kvlink's backend (kvlink.sglang) in two processes, loaded by SGLang's plugin loader.
echo "test: the SGLang backend through SGLang's own queues ($SGLANG_PIN in .venv-vllm)"
sg_passed=0; sg_failed=0; sg_skipped=0; sg_why=""
if [ "$vllm_ready" = 1 ] && { .venv-vllm/bin/python -c "import sys; from importlib.metadata import version; sys.exit(version('sglang') != '${SGLANG_PIN#sglang==}')" 2>/dev/null \
    || PIP_NO_CACHE_DIR=1 .venv-vllm/bin/pip install -q --disable-pip-version-check --no-deps "$SGLANG_PIN"; } \
    && PIP_NO_CACHE_DIR=1 .venv-vllm/bin/pip install -q --disable-pip-version-check $SGLANG_EXTRAS; then
  sglog=$(mktemp)
  set +e
  (cd tests/sglang && ../../.venv-vllm/bin/python -m pytest -q -rs -p no:cacheprovider -p no:warnings) 2>&1 | tee "$sglog"
  sg_rc=${PIPESTATUS[0]}
  set -e
  tally_pytest "$sglog" "$sg_rc" "$MIN_SGLANG" SGLang
  sg_passed=$part_passed sg_failed=$part_failed sg_skipped=$part_skipped sg_why=$part_why
else
  echo "test: $SGLANG_PIN could not be installed into .venv-vllm (output above): the SGLang backend tests cannot run" >&2
  sg_failed=1
fi

# ATOM's own engine (CoreManager, EngineCore with its Scheduler, TP workers) drives kvlink.atom
# in two processes.
echo "test: the ATOM connector through ATOM's own engine (pinned snapshot, in .venv-vllm)"
at_passed=0; at_failed=0; at_skipped=0; at_why=""
if [ "$vllm_ready" = 1 ] && PIP_NO_CACHE_DIR=1 .venv-vllm/bin/pip install -q --disable-pip-version-check $ATOM_EXTRAS; then
  atlog=$(mktemp)
  set +e
  (cd tests/atom && ../../.venv-vllm/bin/python -m pytest -q -rs -p no:cacheprovider -p no:warnings) 2>&1 | tee "$atlog"
  at_rc=${PIPESTATUS[0]}
  set -e
  tally_pytest "$atlog" "$at_rc" "$MIN_ATOM" ATOM
  at_passed=$part_passed at_failed=$part_failed at_skipped=$part_skipped at_why=$part_why
else
  echo "test: $ATOM_EXTRAS could not be installed into .venv-vllm, or vLLM is missing (output above): the ATOM connector tests cannot run" >&2
  at_failed=1
fi

# The newest vLLM release, in a venv layered on .venv-vllm (SGLang and ATOM's extras included,
# so that what the layer sees stays the same from run to run).
set +e
vllm_suite .venv-vllm33 "$VLLM_PIN" .venv-vllm
set -e
v33_passed=$vl_passed v33_failed=$vl_failed v33_skipped=$vl_skipped v33_why=$vl_why

# kvlink's KV events through the engines' own event structs, msgspec encoders and decoders:
# vLLM 0.32 and SGLang (installed above) and vLLM 0.33, whose kv_events.py (from its venv, or
# its wheel when that venv is missing) runs beside the installed vLLM 0.32.
echo "test: KV events against vLLM 0.33, vLLM 0.32 and SGLang's own event code"
ee_passed=0; ee_failed=0; ee_skipped=0; ee_why=""
v33=.venv-vllm/vllm-0.33.0-kv_events.py
for f in .venv-vllm33/lib/python3*/site-packages/vllm/distributed/kv_events.py; do
  if [ "$vllm_ready" = 1 ] && [ -s "$f" ]; then cp "$f" "$v33"; fi
done
if [ "$vllm_ready" = 1 ] && [ ! -s "$v33" ]; then
  v33dir=$(mktemp -d)
  if .venv-vllm/bin/pip download -q --disable-pip-version-check --no-deps vllm==0.33.0 -d "$v33dir"; then
    .venv-vllm/bin/python - "$v33dir" "$v33" <<'PY'
import glob, sys, zipfile
(wheel,) = glob.glob(sys.argv[1] + "/vllm-0.33.0-*.whl")
with zipfile.ZipFile(wheel) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("vllm/distributed/kv_events.py"))
PY
  fi
  rm -rf "$v33dir"
fi
if [ "$vllm_ready" = 1 ] && [ -s "$v33" ]; then
  eelog=$(mktemp)
  set +e
  (cd tests/engine_events && KVLINK_VLLM033_KV_EVENTS="$repo/$v33" ../../.venv-vllm/bin/python -m pytest -q -rs -p no:cacheprovider -p no:warnings) 2>&1 | tee "$eelog"
  ee_rc=${PIPESTATUS[0]}
  set -e
  tally_pytest "$eelog" "$ee_rc" "$MIN_ENGINE_EVENTS" "engine events"
  ee_passed=$part_passed ee_failed=$part_failed ee_skipped=$part_skipped ee_why=$part_why
else
  echo "test: vLLM 0.33.0's kv_events.py could not be fetched, or vLLM is missing (output above): the engine event tests cannot run" >&2
  ee_failed=1
fi

vm_passed=0; vm_failed=0; vm_skipped=0
if [ "${KVLINK_SKIP_VM:-0}" = 1 ]; then
  vm_line="SoftRoCE VM: skipped (KVLINK_SKIP_VM=1; the RDMA tests did not run for real)"
else
  echo "test: RDMA tests inside the SoftRoCE VM"
  # The one-device tests, the holds' (confirmations, leases) and the two-device (striping,
  # failover) tests, in one VM boot.
  bins=$(cargo test --test rdma --test rdma_holds --test rdma_rails --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    if d.get("reason") == "compiler-artifact" and d.get("executable") and d["target"]["name"] in ("rdma", "rdma_holds", "rdma_rails"):
        print(d["executable"])')
  [ "$(printf '%s\n' "$bins" | grep -c .)" = 3 ] || { echo "test: could not build the rdma test binaries" >&2; exit 1; }
  vmlog=$(mktemp)
  vmcmd=$(mktemp -p target vm-rdma.XXXXXX.sh)
  { echo 'rc=0'; for b in $bins; do echo "\"$b\" --test-threads=1 || rc=1"; done; echo 'exit $rc'; } >"$vmcmd"
  set +e
  tools/softroce/run.sh -- bash "$vmcmd" 2>&1 | tee "$vmlog"
  vm_rc=${PIPESTATUS[0]}
  set -e
  read -r vm_ran vm_failed _ < <(cargo_counts "$vmlog")
  vm_skips=$(cargo_skips "$vmlog")
  [ -n "$vm_skips" ] && vm_skipped=$(printf '%s\n' "$vm_skips" | wc -l)
  vm_passed=$((vm_ran - vm_skipped))
  if [ "$vm_rc" -ne 0 ] && [ "$vm_failed" -eq 0 ]; then
    echo "test: the SoftRoCE VM run failed (exit $vm_rc) before reporting results" >&2
    vm_failed=1
  fi
  if [ "$vm_skipped" -gt 0 ]; then
    echo "test: $vm_skipped RDMA tests skipped inside the VM, which has a device: failures" >&2
    vm_failed=$((vm_failed + vm_skipped))
  fi
  if [ "$vm_passed" -lt "$MIN_VM" ]; then
    echo "test: only $vm_passed RDMA tests passed inside the VM; at least $MIN_VM expected" >&2
    vm_failed=$((vm_failed + 1))
  fi
  vm_line="SoftRoCE VM: $vm_passed RDMA tests passed, $vm_failed failed"
fi

echo "test summary:"
echo "  host: $host_passed passed, $host_failed failed, $host_skipped skipped$host_why; $host_helpers ignored (child-process helpers of the two-process tests, and the fuzz seed writer), not counted"
echo "  host, every engine keyed: $key_passed passed, $key_failed failed, $key_skipped skipped$key_why"
echo "  python: $py_passed passed, $py_failed failed, $py_skipped skipped$py_why"
echo "  vLLM connector ($VLLM_PIN): $v33_passed passed, $v33_failed failed, $v33_skipped skipped$v33_why"
echo "  vLLM connector ($VLLM_OLD_PIN): $vl_passed passed, $vl_failed failed, $vl_skipped skipped$vl_why"
echo "  SGLang backend ($SGLANG_PIN, no deps, beside $VLLM_OLD_PIN): $sg_passed passed, $sg_failed failed, $sg_skipped skipped$sg_why"
echo "  ATOM connector (ATOM snapshot ffdf3bb5, beside $VLLM_OLD_PIN): $at_passed passed, $at_failed failed, $at_skipped skipped$at_why"
echo "  KV events against the engines' code (vLLM 0.33 and 0.32, SGLang): $ee_passed passed, $ee_failed failed, $ee_skipped skipped$ee_why"
echo "  $vm_line"
echo "tests: $((host_passed + key_passed + py_passed + v33_passed + vl_passed + sg_passed + at_passed + ee_passed + vm_passed)) passed, $((host_failed + key_failed + py_failed + v33_failed + vl_failed + sg_failed + at_failed + ee_failed + vm_failed)) failed, $((host_skipped + key_skipped + py_skipped + v33_skipped + vl_skipped + sg_skipped + at_skipped + ee_skipped + vm_skipped)) skipped"
[ "$host_failed" -eq 0 ] && [ "$key_failed" -eq 0 ] && [ "$py_failed" -eq 0 ] && [ "$v33_failed" -eq 0 ] && [ "$vl_failed" -eq 0 ] && [ "$sg_failed" -eq 0 ] && [ "$at_failed" -eq 0 ] && [ "$ee_failed" -eq 0 ] && [ "$vm_failed" -eq 0 ]
