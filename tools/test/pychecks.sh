#!/usr/bin/env bash
# Test command part "pychecks": ruff's linter and its formatter check, and mypy, over the
# Python package (ffi/python/python/kvlink) and the Python tools (tools/, each folder of
# scripts on its own), with the settings in ffi/python/pyproject.toml. They run in .venv-vllm,
# where vLLM 0.32 and torch bring their types: the vLLM connector's base class is typed there,
# so a misspelt attribute on the connector fails (SGLang and ATOM bring none; their names are
# unchecked). Each check is one test: `check: PASS|FAIL NAME`, the tally names a failure with
# its findings.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
MIN_CHECKS=8
label="Python checks (ruff, mypy; $VLLM_OLD_PIN's types)"
echo "test: $label"
if ! prepared vllm-old; then
  tally fail --part pychecks --label "$label" --why ".venv-vllm could not be prepared: $(prepared_why vllm-old)"
  exit 0
fi
bin=$repo/.venv-vllm/bin
cfg=$repo/ffi/python/pyproject.toml
mypy_args=(--config-file "$cfg" --cache-dir "$repo/target/mypy" --ignore-missing-imports --follow-imports=silent)

# check NAME DIR COMMAND...: runs COMMAND in DIR and prints its verdict line.
check() {
  local name=$1 dir=$2
  shift 2
  if (cd "$dir" && "$@"); then echo "check: PASS $name"; else echo "check: FAIL $name"; fi
}

checks() {
  check "ruff check" "$repo" "$bin/ruff" check --config "$cfg" --output-format concise ffi/python/python/kvlink tools
  check "ruff format" "$repo" "$bin/ruff" format --config "$cfg" --check ffi/python/python/kvlink tools
  check "mypy kvlink" "$repo/ffi/python" "$bin/mypy" "${mypy_args[@]}" python/kvlink
  local dir
  for dir in tools tools/soak tools/test tools/bench-peers tools/examples; do
    check "mypy $dir" "$repo/$dir" "$bin/mypy" "${mypy_args[@]}" "$repo/$dir"/*.py
  done
}
logged_part check pychecks "$label" "$MIN_CHECKS" fail "" checks
