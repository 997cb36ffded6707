# Sourced by each part of the test command (tools/test.sh): the pinned releases, and the
# helpers that run a suite and record it in the one tally (tally.py, file $KVLINK_TALLY).

# The vLLM releases the connector is tested against: the newest (in .venv-vllm33) and the one
# before it (in .venv-vllm, where the SGLang backend's and ATOM connector's tests also run).
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
# The Python checks (pychecks.sh): ruff and mypy, into .venv-vllm beside vLLM's types.
PY_CHECKERS="ruff==0.17.6 mypy==2.4.1"

# vLLM's kernel library, humming, starts two interpreters in the background from every process
# that imports it (``build_humming_launcher_in_bg``, ``nvrtc``) to pre-build its CUDA launcher;
# on a machine without CUDA they import torch and fail, and the vLLM tests start dozens of such
# processes. Its own switch turns the pre-build off; a kernel still builds when first used.
export HUMMING_DISABLE_PARALLEL_BUILD=1

# Lint as the code is built: clippy-driver compiles every crate of the workspace being built
# (rustc with clippy's lints; dependencies get plain rustc), and CLIPPY_ARGS (what `cargo clippy
# -- -D warnings` hands it) makes any lint an error. One compile of the workspace gives both the
# test binaries and `cargo clippy --all-targets -D warnings`, where a separate `cargo clippy`
# type-checked every crate and dependency a second time (about 85 s of 2 cores on a clean
# checkout, and as much for the Python extension). Every cargo command of the test command runs
# with these (they are part of what cargo fingerprints), so none rebuilds another's crates; the
# checks part proves that a lint still fails the build (lint_probe).
if clippy_driver=$(command -v clippy-driver); then
  export RUSTC_WORKSPACE_WRAPPER=$clippy_driver
  export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
else
  echo "test: clippy-driver not found (rustup component add clippy)" >&2
  exit 1
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
export KVLINK_TALLY=${KVLINK_TALLY:-$repo/target/test-tally.jsonl}

tally() { python3 "$repo/tools/test/tally.py" "$@"; }

# logged_part KIND PART LABEL MIN SKIPS NOTE COMMAND...: runs COMMAND, its output shown and
# kept, and records it as a run of KIND (cargo: a cargo test run; soak: tools/soak.sh). SKIPS
# is "count" (a skip is reported) or "fail" (a skip fails).
logged_part() {
  local kind=$1 part=$2 label=$3 min=$4 skips=$5 note=$6 log rc
  shift 6
  log=$(mktemp)
  set +e
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  tally add --part "$part" --label "$label" --kind "$kind" --log "$log" --rc "$rc" \
    --min "$min" --skips "$skips" --note "$note"
}

# cargo_part PART LABEL MIN SKIPS NOTE COMMAND...: a cargo test run (logged_part cargo).
cargo_part() {
  logged_part cargo "$@"
}

# pytest_part PART LABEL MIN DIR PYTHON [PYTEST ARGS...]: runs pytest on tests/DIR with the
# interpreter PYTHON and records its JUnit report. A skip fails: the test command installs
# everything these suites need. -rs still lists each skip with its reason for people.
pytest_part() {
  local part=$1 label=$2 min=$3 dir=$4 python=$5 junit rc
  shift 5
  junit=$(mktemp -u --suffix=.xml)
  set +e
  (cd "tests/$dir" && "$python" -m pytest -q -rs --junitxml="$junit" "$@")
  rc=$?
  set -e
  tally add --part "$part" --label "$label" --kind pytest --junit "$junit" --rc "$rc" \
    --min "$min" --skips fail
}

# prepared STAGE: waits for the mark of STAGE of the background installs (prepare.sh, started
# by tools/test.sh) and succeeds when it says ok; otherwise prints why and the end of the
# stage's log, and fails. Without a background run (a part run on its own) it runs the stage
# itself. The installs have deadlines of their own (pip's, apt's); this wait has one more.
prepared() {
  local name=$1 mark=target/prepare/$1 end=$((SECONDS + ${KVLINK_PREPARE_WAIT:-3600}))
  if [ ! -f "$mark" ] && { [ -z "${KVLINK_PREPARE_PID:-}" ] || ! kill -0 "$KVLINK_PREPARE_PID" 2>/dev/null; }; then
    bash "$repo/tools/test/prepare.sh" "$name"
  fi
  while [ ! -f "$mark" ]; do
    if [ $SECONDS -ge $end ]; then
      echo "test: the installs for $name did not end within ${KVLINK_PREPARE_WAIT:-3600} s" >&2
      return 1
    fi
    # The mark looked at again: the installs may have written it and ended since the loop's test.
    if [ -n "${KVLINK_PREPARE_PID:-}" ] && ! kill -0 "$KVLINK_PREPARE_PID" 2>/dev/null && [ ! -f "$mark" ]; then
      echo "test: the background installs ended without preparing $name" >&2
      return 1
    fi
    sleep 2
  done
  if [ "$(head -n 1 "$mark")" != ok ]; then
    echo "test: preparing $name failed: $(head -n 1 "$mark") (log target/prepare/$name.log):" >&2
    tail -n 20 "target/prepare/$name.log" >&2
    return 1
  fi
}

# prepared_why STAGE: the first line of STAGE's mark, for a part's failure record.
prepared_why() {
  head -n 1 "target/prepare/$1" 2>/dev/null || echo "its installs did not end"
}

# The wheel the python part built: the engine parts install it as a user would, without Rust.
built_wheel() {
  local w
  for w in target/wheels/kvlink-*.whl; do
    [ -f "$w" ] && { echo "$w"; return 0; }
  done
  echo "test: no kvlink wheel in target/wheels (the python part builds it)" >&2
  return 1
}

# use_wheel VENV: installs the built wheel into VENV (without its dependencies, as a user
# would), unless that very wheel is installed there already; one pip at a time per venv.
use_wheel() {
  local venv=$1 wheel sum
  wheel=$(built_wheel) || return 1
  sum=$(sha256sum "$wheel" | cut -c1-16)
  (
    flock 9
    [ "$(cat "$venv/kvlink-wheel" 2>/dev/null)" = "$sum" ] && exit 0
    "$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel" \
      && echo "$sum" >"$venv/kvlink-wheel"
  ) 9>"$venv/.kvlink-wheel.lock"
}

# lint_probe: builds a one-function crate with an unneeded `return` under the test command's
# compiler settings, and fails unless clippy refused it: the builds really lint.
lint_probe() {
  local dir out
  dir=$(mktemp -d)
  mkdir -p "$dir/src"
  printf '[package]\nname = "lint-probe"\nversion = "0.0.0"\nedition = "2021"\n[workspace]\n' >"$dir/Cargo.toml"
  printf 'pub fn probe() -> u32 {\n    return 1;\n}\n' >"$dir/src/lib.rs"
  if out=$(CARGO_TARGET_DIR="$dir/target" cargo build --quiet --manifest-path "$dir/Cargo.toml" 2>&1); then
    rm -rf "$dir"
    echo "test: a crate with a clippy lint built without error: the test command's builds do not lint" >&2
    return 1
  fi
  rm -rf "$dir"
  if ! grep -q "needless_return\|unneeded \`return\`" <<<"$out"; then
    echo "test: the lint probe failed for another reason than its lint:" >&2
    echo "$out" >&2
    return 1
  fi
}
