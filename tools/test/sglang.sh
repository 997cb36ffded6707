#!/usr/bin/env bash
# Test command part "sglang": SGLang's own queues (prefill bootstrap and inflight, decode
# prealloc and transfer) drive kvlink's backend (kvlink.sglang) in two processes, loaded by
# SGLang's plugin loader. SGLang's pinned wheel goes into .venv-vllm (the vllm32 part) without
# its dependencies.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
MIN_SGLANG=59

label="SGLang backend ($SGLANG_PIN, no deps, beside $VLLM_OLD_PIN)"
echo "test: the SGLang backend through SGLang's own queues ($SGLANG_PIN in .venv-vllm)"
sglang_installed() {
  .venv-vllm/bin/python -c "import sys; from importlib.metadata import version; sys.exit(version('sglang') != '${SGLANG_PIN#sglang==}')" 2>/dev/null
}
# shellcheck disable=SC2086 # the extras are several requirements
if old_vllm_ready && { sglang_installed \
    || PIP_NO_CACHE_DIR=1 .venv-vllm/bin/pip install -q --disable-pip-version-check --no-deps "$SGLANG_PIN"; } \
    && PIP_NO_CACHE_DIR=1 .venv-vllm/bin/pip install -q --disable-pip-version-check $SGLANG_EXTRAS; then
  pytest_part sglang "$label" "$MIN_SGLANG" sglang "$repo/.venv-vllm/bin/python" \
    -p no:cacheprovider -p no:warnings
else
  tally fail --part sglang --label "$label" \
    --why "$SGLANG_PIN could not be installed into .venv-vllm, or $VLLM_OLD_PIN is missing there (output above)"
fi
