#!/usr/bin/env bash
# Test command parts "vllm32" and "vllm33" (tools/test/vllm.sh old|new): vLLM's own Scheduler
# drives kvlink's connector (kvlink.vllm) in two processes. vLLM and torch (about 8 GB) go into
# a venv per release, the newest layered on the one before (tools/test/vllm-venv.sh); the
# kvlink wheel the python part built is installed into it as a user would, without Rust.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/vllm-venv.sh"
MIN_VLLM=42

case ${1:-} in
  # The newest release, layered on .venv-vllm (SGLang's and ATOM's extras included, so that
  # what the layer sees stays the same from run to run).
  new) part=vllm33 venv=.venv-vllm33 pin=$VLLM_PIN base=.venv-vllm ;;
  old) part=vllm32 venv=.venv-vllm pin=$VLLM_OLD_PIN base="" ;;
  *) echo "usage: tools/test/vllm.sh old|new" >&2; exit 2 ;;
esac
label="vLLM connector ($pin)"
echo "test: the vLLM connector through vLLM's real Scheduler ($pin in $venv)"
if ! vllm_venv "$venv" "$pin" "$base"; then
  tally fail --part "$part" --label "$label" --why "$pin could not be installed into $venv (output above)"
  exit 0
fi
if ! wheel=$(built_wheel); then
  tally fail --part "$part" --label "$label" --why "no kvlink wheel to install (the python part builds it)"
  exit 0
fi
"$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel"
pytest_part "$part" "$label" "$MIN_VLLM" vllm "$repo/$venv/bin/python" -p no:cacheprovider
