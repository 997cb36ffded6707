#!/usr/bin/env bash
# Test command part "atom": ATOM's own engine (CoreManager, EngineCore with its Scheduler, TP
# workers), from its pinned snapshot, drives kvlink.atom in two processes, in .venv-vllm.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
MIN_ATOM=39

label="ATOM connector (ATOM snapshot ffdf3bb5, beside $VLLM_OLD_PIN)"
echo "test: the ATOM connector through ATOM's own engine (pinned snapshot, in .venv-vllm)"
if prepared vllm-old && use_wheel .venv-vllm; then
  pytest_part atom "$label" "$MIN_ATOM" atom "$repo/.venv-vllm/bin/python" \
    -p no:cacheprovider -p no:warnings
else
  tally fail --part atom --label "$label" \
    --why "$ATOM_EXTRAS or $VLLM_OLD_PIN could not be installed into .venv-vllm: $(prepared_why vllm-old)"
fi
