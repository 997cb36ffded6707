#!/usr/bin/env bash
# Test command part "sglang": SGLang's own queues (prefill bootstrap and inflight, decode
# prealloc and transfer) drive kvlink's backend (kvlink.sglang) in two processes, loaded by
# SGLang's plugin loader. SGLang's pinned wheel goes into .venv-vllm without its dependencies
# (prepare.sh, stage vllm-old).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
MIN_SGLANG=74

label="SGLang backend ($SGLANG_PIN, no deps, beside $VLLM_OLD_PIN)"
echo "test: the SGLang backend through SGLang's own queues ($SGLANG_PIN in .venv-vllm)"
if prepared vllm-old && use_wheel .venv-vllm; then
  pytest_part sglang "$label" "$MIN_SGLANG" sglang "$repo/.venv-vllm/bin/python" \
    -p no:cacheprovider -p no:warnings
else
  tally fail --part sglang --label "$label" \
    --why "$SGLANG_PIN or $VLLM_OLD_PIN could not be installed into .venv-vllm: $(prepared_why vllm-old)"
fi
