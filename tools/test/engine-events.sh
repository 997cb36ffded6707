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
if ! old_vllm_ready; then
  tally fail --part engine-events --label "$label" --why "$VLLM_OLD_PIN is missing from .venv-vllm (the vllm32 part installs it)"
  exit 0
fi
v33=.venv-vllm/vllm-0.33.0-kv_events.py
for f in .venv-vllm33/lib/python3*/site-packages/vllm/distributed/kv_events.py; do
  if [ -s "$f" ]; then cp "$f" "$v33"; fi
done
if [ ! -s "$v33" ]; then
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
if [ ! -s "$v33" ]; then
  tally fail --part engine-events --label "$label" --why "vLLM 0.33.0's kv_events.py could not be fetched (output above)"
  exit 0
fi
export KVLINK_VLLM033_KV_EVENTS="$repo/$v33"
pytest_part engine-events "$label" "$MIN_ENGINE_EVENTS" \
  engine_events "$repo/.venv-vllm/bin/python" -p no:cacheprovider -p no:warnings
