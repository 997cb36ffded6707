#!/usr/bin/env bash
# Test command part "engine-events": kvlink's KV events through the engines' own event structs,
# msgspec encoders and decoders: vLLM 0.32 and SGLang (in .venv-vllm) and vLLM 0.33, whose
# kv_events.py (from .venv-vllm33, or its wheel when that venv is missing) runs beside the
# installed vLLM 0.32.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
MIN_ENGINE_EVENTS=6

label="KV events against the engines' code (vLLM 0.33 and 0.32, SGLang)"
echo "test: KV events against vLLM 0.33, vLLM 0.32 and SGLang's own event code"
if ! prepared vllm-old || ! prepared kv-events || ! use_wheel .venv-vllm; then
  tally fail --part engine-events --label "$label" \
    --why "$VLLM_OLD_PIN or vLLM 0.33.0's kv_events.py is missing: $(prepared_why vllm-old); $(prepared_why kv-events)"
  exit 0
fi
export KVLINK_VLLM033_KV_EVENTS="$repo/.venv-vllm/vllm-0.33.0-kv_events.py"
pytest_part engine-events "$label" "$MIN_ENGINE_EVENTS" \
  engine_events "$repo/.venv-vllm/bin/python" -p no:cacheprovider -p no:warnings
