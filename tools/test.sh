#!/usr/bin/env bash
# The project's test command (README, CI). It runs the parts in tools/test/, each recording its
# results in one tally (tools/test/tally.py), then prints the summary, each part's wall time
# and the total, and exits non-zero unless every part passed:
#   checks         layers, cycles, format, lint (a failure stops the command at once)
#   host           every Rust test on this machine, then the transfer suites with a key
#   python         the Python wheel (maturin, into .venv) and its tests
#   soak           a 60-second fault soak and a 16 x 16 fleet run on this host (tools/soak.sh)
#   pychecks       ruff (lint, format) and mypy over the Python package and tools (.venv-vllm)
#   vllm32         the vLLM connector through vLLM 0.32's own Scheduler (.venv-vllm)
#   sglang         the SGLang backend through SGLang's own queues (.venv-vllm)
#   atom           the ATOM connector through ATOM's own engine, pinned snapshot (.venv-vllm)
#   vllm33         the vLLM connector through vLLM 0.33 (.venv-vllm33, layered on .venv-vllm)
#   engine-events  KV events through vLLM 0.33's, 0.32's and SGLang's own event code
#   gpu            tools/gpu-check.sh --cpu-only: the GPU check on emulated device memory and a
#                  real model (transformers' Llama) on the CPU, tokens compared (.venv-vllm)
#   vm             the RDMA tests for real inside a SoftRoCE VM (tools/softroce/run.sh), then a
#                  75-second fault soak and a 4 x 4 fleet run over RDMA in the same boot
# atom runs beside the others once python has built the wheel, after the vLLM model caches are
# warmed there (the side lane below); vm waits for it to end, and runs alone.
# It installs what it needs: tools/deps.sh first, then everything else (PyPI into the venvs,
# the VM's packages and kernel) in the background (tools/test/prepare.sh) while the Rust parts
# build and run; a part that needs an install waits for it (lib.sh's `prepared`).
#
#   tools/test.sh                                # everything (CI)
#   KVLINK_SKIP_VM=1 tools/test.sh               # all but the VM, reported as not run
#   KVLINK_TEST_PARTS="checks host" tools/test.sh  # some parts; the others are reported as not run
#
# Each part's line says passed, failed and skipped with the reasons, and names each failed
# test with why. Rust tests that lack hardware here report a structured skip (tests/common's
# `skip`) and count as skipped; pytest suites are tallied from their JUnit reports, and a skip
# there fails (the command installs what they need), as does any skip inside the VM. A part
# that ran fewer tests than its minimum (MIN_* in its file) fails too: a build that produced
# no tests must not look green.
set -euo pipefail

ALL_PARTS="checks host python soak pychecks vllm32 sglang atom vllm33 engine-events gpu vm"
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
parts=${KVLINK_TEST_PARTS:-$ALL_PARTS}
for part in $parts; do
  case " $ALL_PARTS " in
    *" $part "*) ;;
    *) echo "test: no part \"$part\" (parts: $ALL_PARTS)" >&2; exit 2 ;;
  esac
done
started=$SECONDS
# Free disk, in GB, where the run writes (target/ and the venvs are inside the checkout).
free_gb() { df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}'; }
echo "test: $(free_gb) GB of disk free at the start; a whole run writes about 19 GB" \
  "(target/ 4, .venv-vllm 9, .venv-vllm33 5, the rest 1)"
has() { case " $parts " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

tools/deps.sh
export KVLINK_TALLY="$repo/target/test-tally.jsonl"
mkdir -p target
: >"$KVLINK_TALLY"
tally() { python3 tools/test/tally.py "$@"; }

# The background installs: the venvs every Python part shares (vllm33's is layered on the
# others', so it is made after them whichever of them run), the VM's boot.
stages=""
for part in python pychecks vllm32 sglang atom vllm33 engine-events gpu; do
  if has "$part"; then stages="venv vllm-old vllm-new kv-events"; fi
done
if has vm && [ "${KVLINK_SKIP_VM:-0}" != 1 ]; then stages="$stages vm"; fi
rm -rf target/prepare
mkdir -p target/prepare
prepare_pid=""
if [ -n "$stages" ]; then
  # shellcheck disable=SC2086 # the stages are several words
  bash tools/test/prepare.sh $stages >target/prepare/all.log 2>&1 &
  prepare_pid=$!
  export KVLINK_PREPARE_PID=$prepare_pid
fi
# (An installs run that ended already is not an error: under set -e a failed kill here would
# set the command's exit status.)
stop_prepare() { if [ -n "$prepare_pid" ]; then kill "$prepare_pid" 2>/dev/null || true; fi; }
trap stop_prepare EXIT

# run_part PART: runs its script, records its wall time, and a failure of the script itself.
run_part() {
  local part=$1 from=$((SECONDS - started)) t0=$SECONDS rc=0 run
  case $part in
    vllm32) run=(tools/test/vllm.sh old) ;;
    vllm33) run=(tools/test/vllm.sh new) ;;
    *) run=("tools/test/$part.sh") ;;
  esac
  bash "${run[@]}" || rc=$?
  tally time --part "$part" --seconds $((SECONDS - t0)) --started "$from"
  if [ "$rc" -ne 0 ]; then
    if [ "$part" = checks ]; then
      echo "test: the checks failed (output above)" >&2
      exit 1
    fi
    tally fail --part "$part" --label "$part" --why "its script stopped (exit $rc; output above)"
  fi
}

# The side lane: vLLM's model-info caches filled (tools/test/vllm-warm.sh), then the parts that
# wait far more than they compute, one after another, beside the others from when SIDE_AFTER
# has ended (it builds the wheel). ATOM's tests mostly wait on its engines' start-ups, 5-second
# metrics pushes and shut-downs (its engine cores' idle polling runs at the lowest priority,
# tests/atom/engine.py). Two cores are then kept busy where one part alone (mypy, a suite's
# one driving process) left one idle. The lane's output is kept in target/test-logs/side.log and shown when it has
# ended, which the main lane waits for before SIDE_BEFORE: the VM emulates its CPUs, and its
# soak, starved beside the ATOM suite, once could not tell a slow recovery from none.
SIDE_PARTS="atom"
SIDE_AFTER=python
SIDE_BEFORE=vm
side_pid=""
in_side() { case " $SIDE_PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
start_side() {
  local part run=() warm=()
  for part in $SIDE_PARTS; do has "$part" && run+=("$part"); done
  has vllm32 && warm+=(old)
  has vllm33 && warm+=(new)
  [ $((${#run[@]} + ${#warm[@]})) -gt 0 ] || return 0
  mkdir -p target/test-logs
  echo "test: beside the other parts (output before vm):${warm[*]:+ the vLLM model caches warmed,} ${run[*]}"
  (
    [ ${#warm[@]} -eq 0 ] || bash tools/test/vllm-warm.sh "${warm[@]}"
    for part in "${run[@]}"; do run_part "$part"; done
  ) >target/test-logs/side.log 2>&1 &
  side_pid=$!
}
# The side lane and everything it started, when the command stops early.
kill_tree() {
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
stop_all() {
  stop_prepare
  if [ -n "$side_pid" ]; then kill_tree "$side_pid"; fi
}
trap stop_all EXIT

# end_side: waits for the side lane, if it runs, and shows its output.
end_side() {
  [ -n "$side_pid" ] || return 0
  local t0=$SECONDS
  wait "$side_pid" || true
  side_pid=""
  echo "test: the output of the side lane (vLLM's model caches, $SIDE_PARTS):"
  cat target/test-logs/side.log
  echo "test: waited $((SECONDS - t0)) s for the side lane"
}

for part in $ALL_PARTS; do
  if [ "$part" = "$SIDE_BEFORE" ]; then end_side; fi
  if ! has "$part"; then
    tally skip --part "$part" --label "$part" --why "left out by KVLINK_TEST_PARTS"
  elif ! in_side "$part"; then
    run_part "$part"
  fi
  if [ "$part" = "$SIDE_AFTER" ]; then start_side; fi
done
end_side
wait_prepare=$SECONDS
# Its status is in its marks; a failed wait must not stop the summary below.
if [ -n "$prepare_pid" ]; then wait "$prepare_pid" 2>/dev/null || true; fi
for mark in target/prepare/*; do
  case $mark in *.log) continue ;; esac
  [ -f "$mark" ] && echo "test: install stage $(basename "$mark"): $(tr '\n' ' ' <"$mark")"
done
[ $((SECONDS - wait_prepare)) -gt 1 ] && echo "test: waited $((SECONDS - wait_prepare)) s for the background installs at the end"
echo "test: $(free_gb) GB of disk free at the end"
tally summary --total $((SECONDS - started))
