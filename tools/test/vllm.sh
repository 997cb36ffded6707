#!/usr/bin/env bash
# Test command parts "vllm32" and "vllm33" (tools/test/vllm.sh old|new): vLLM's own Scheduler
# drives kvlink's connector (kvlink.vllm) in two processes. vLLM and torch (about 8 GB) go into
# a venv per release, the newest layered on the one before (tools/test/vllm-venv.sh); the
# kvlink wheel the python part built is installed into it as a user would, without Rust.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
MIN_VLLM=92

case ${1:-} in
  # The newest release, layered on .venv-vllm (SGLang's and ATOM's extras included, so that
  # what the layer sees stays the same from run to run).
  new) part=vllm33 venv=.venv-vllm33 pin=$VLLM_PIN stage=vllm-new ;;
  old) part=vllm32 venv=.venv-vllm pin=$VLLM_OLD_PIN stage=vllm-old ;;
  *) echo "usage: tools/test/vllm.sh old|new" >&2; exit 2 ;;
esac
label="vLLM connector ($pin)"
echo "test: the vLLM connector through vLLM's real Scheduler ($pin in $venv)"
if ! prepared "$stage"; then
  tally fail --part "$part" --label "$label" --why "$pin could not be installed into $venv: $(prepared_why "$stage")"
  exit 0
fi
if ! use_wheel "$venv"; then
  tally fail --part "$part" --label "$label" --why "the kvlink wheel could not be installed (the python part builds it)"
  exit 0
fi
pytest_part "$part" "$label" "$MIN_VLLM" vllm "$repo/$venv/bin/python" -p no:cacheprovider
