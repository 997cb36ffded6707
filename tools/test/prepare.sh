#!/usr/bin/env bash
# The test command's installs, run in the background while the first parts compile and test
# (tools/test.sh starts it): downloads and venv builds wait on the network and the disk, the
# Rust builds on the two cores, so the two go side by side. Each stage ends with a mark in
# target/prepare/STAGE (first line "ok" or "fail: why"); a part that needs a stage waits for
# its mark (lib.sh's `prepared`). Its log is target/prepare/STAGE.log.
#
#   tools/test/prepare.sh STAGE...
#
# Stages, in the order they run (each quick when what it installs is there already):
#   venv       .venv with maturin, ziglang, numpy, pytest, pyzmq, msgpack and msgspec
#   vllm-old   .venv-vllm with vLLM 0.32 and pytest, then SGLang's wheel (no dependencies),
#              SGLang's and ATOM's extras and the Python checkers (ruff, mypy) in it
#   vllm-new   .venv-vllm33 with vLLM 0.33, layered on .venv-vllm when it holds one
#   kv-events  vLLM 0.33's kv_events.py beside .venv-vllm, for the engine-events part
#   vm         the SoftRoCE VM's packages, virtme-ng and kernel (tools/softroce/run.sh --prepare),
#              beside the pip stages
set -uo pipefail
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/vllm-venv.sh"

marks=target/prepare
mkdir -p "$marks"

# stage NAME FUNCTION: runs FUNCTION once, its output into NAME.log, and writes NAME's mark.
stage() {
  local name=$1 fn=$2 start=$SECONDS
  rm -f "$marks/$name"
  if "$fn" >"$marks/$name.log" 2>&1; then
    echo "ok" >"$marks/$name.tmp"
  else
    echo "fail: $(grep -v '^\s*$' "$marks/$name.log" | tail -n 1 | cut -c1-300)" >"$marks/$name.tmp"
  fi
  echo "$((SECONDS - start)) s" >>"$marks/$name.tmp"
  mv "$marks/$name.tmp" "$marks/$name"
  [ "$(head -n 1 "$marks/$name")" = ok ]
}

prepare_venv() {
  if [ ! -x .venv/bin/pip ]; then
    rm -rf .venv
    if ! python3 -m venv .venv; then
      rm -rf .venv
      tools/deps.sh python3-venv && python3 -m venv .venv || return 1
    fi
  fi
  .venv/bin/pip install -q --disable-pip-version-check "maturin>=1.5,<2" ziglang numpy pytest \
    pyzmq msgpack msgspec
}

prepare_vllm_old() {
  vllm_venv .venv-vllm "$VLLM_OLD_PIN" "" || return 1
  if ! .venv-vllm/bin/python -c "import sys; from importlib.metadata import version; sys.exit(version('sglang') != '${SGLANG_PIN#sglang==}')" 2>/dev/null; then
    PIP_NO_CACHE_DIR=1 .venv-vllm/bin/pip install -q --disable-pip-version-check --no-deps "$SGLANG_PIN" \
      || { echo "$SGLANG_PIN could not be installed into .venv-vllm"; return 1; }
  fi
  # shellcheck disable=SC2086 # the extras are several requirements
  PIP_NO_CACHE_DIR=1 .venv-vllm/bin/pip install -q --disable-pip-version-check $SGLANG_EXTRAS $ATOM_EXTRAS \
    $PY_CHECKERS || { echo "$SGLANG_EXTRAS $ATOM_EXTRAS $PY_CHECKERS could not be installed into .venv-vllm"; return 1; }
}

# Layered on .venv-vllm when that holds a vLLM (vllm_venv installs it whole otherwise), so a
# part run on its own needs no vllm-old stage first.
prepare_vllm_new() {
  vllm_venv .venv-vllm33 "$VLLM_PIN" .venv-vllm
}

# vLLM 0.33's kv_events.py, from .venv-vllm33, or from its wheel when that venv is missing.
prepare_kv_events() {
  local v33=.venv-vllm/vllm-0.33.0-kv_events.py f dir
  for f in .venv-vllm33/lib/python3*/site-packages/vllm/distributed/kv_events.py; do
    if [ -s "$f" ]; then cp "$f" "$v33"; return 0; fi
  done
  [ -s "$v33" ] && return 0
  dir=$(mktemp -d)
  .venv-vllm/bin/pip download -q --disable-pip-version-check --no-deps "$VLLM_PIN" -d "$dir" || return 1
  .venv-vllm/bin/python - "$dir" "$v33" <<'PY'
import glob, sys, zipfile
(wheel,) = glob.glob(sys.argv[1] + "/vllm-0.33.0-*.whl")
with zipfile.ZipFile(wheel) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("vllm/distributed/kv_events.py"))
PY
  local rc=$?
  rm -rf "$dir"
  return $rc
}

prepare_vm() {
  tools/softroce/run.sh --prepare
}

stages=" $* "
# The VM's apt installs go beside the pip stages: one waits on Debian's mirror, the others on
# PyPI's.
if [[ $stages == *" vm "* ]]; then
  stage vm prepare_vm &
fi
[[ $stages == *" venv "* ]] && stage venv prepare_venv
[[ $stages == *" vllm-old "* ]] && stage vllm-old prepare_vllm_old
[[ $stages == *" vllm-new "* ]] && stage vllm-new prepare_vllm_new
[[ $stages == *" kv-events "* ]] && stage kv-events prepare_kv_events
wait
exit 0
