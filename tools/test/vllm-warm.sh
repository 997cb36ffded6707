#!/usr/bin/env bash
# The first step of the test command's side lane (tools/test.sh), not a part of its own:
# fills the vLLM venvs' model-info caches (tests/vllm/warm_registry.py) while the main lane
# runs pychecks (mypy, one core busy) and vllm32, so that the vLLM suites find them warm.
# Nothing is tallied: if it fails, the suites inspect the models themselves, as vLLM always does.
#   tools/test/vllm-warm.sh old new    # .venv-vllm (vLLM 0.32), then .venv-vllm33 (0.33)
set -uo pipefail
source "$(dirname "$0")/lib.sh"

for which in "$@"; do
  case $which in
    old) venv=.venv-vllm stage=vllm-old ;;
    new) venv=.venv-vllm33 stage=vllm-new ;;
    *) echo "usage: tools/test/vllm-warm.sh [old] [new]" >&2; exit 2 ;;
  esac
  prepared "$stage" || continue
  t0=$SECONDS
  if ! (cd tests/vllm && "$repo/$venv/bin/python" warm_registry.py 2>&1 | grep -E '^warm_registry:|Error'); then
    echo "test: warming $venv's vLLM cache failed (its suite inspects the models itself)"
  fi
  echo "test: $venv's vLLM cache warmed in $((SECONDS - t0)) s"
done
exit 0
