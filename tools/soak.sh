#!/usr/bin/env bash
# kvlink's fault soak (tools/soak/soak.py): prefill and decode engines in processes of their own
# (tools/kvlink-soak), requests all the time, faults at random times from a printed seed, every
# invariant checked; the last line says `soak: PASS` or `soak: FAIL`.
#
#   tools/soak.sh [--minutes N] [--seed S]           # on this host: TCP and the same-host path
#   tools/soak.sh --vm [--minutes N] [--seed S]      # inside the SoftRoCE VM: RDMA over rxe0
#                                                    # and rxe1, their links taken down and up
#   tools/soak.sh --fleet P,D [--vm]                 # the fleet run (tools/soak/fleet.py): P
#                                                    # prefills, D decodes, every decode reading
#                                                    # from every prefill; the last line says
#                                                    # `fleet: PASS` or `fleet: FAIL`
# Other options go to soak.py or fleet.py (--help). Logs and report.json go to target/soak
# (target/soak-vm, target/fleet, target/fleet-vm). Default: 10 minutes.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

vm=0 minutes=10 fleet="" args=()
while [ $# -gt 0 ]; do
  case $1 in
    --vm) vm=1 ;;
    --minutes) minutes=$2; shift ;;
    --fleet) fleet=$2; shift ;;
    *) args+=("$1") ;;
  esac
  shift
done

tools/deps.sh
cargo build --workspace --bin kvlink-soak --quiet
bin="$repo/target/debug/kvlink-soak"
if [ -n "$fleet" ]; then
  if [ "$vm" = 1 ]; then
    out=target/fleet-vm
    mkdir -p "$out"
    export SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-1800}
    export SOFTROCE_RWDIRS="$repo/$out"
    exec tools/softroce/run.sh -- python3 tools/soak/fleet.py --vm --binary "$bin" \
      --fleet "$fleet" --out "$out" "${args[@]}"
  fi
  exec python3 tools/soak/fleet.py --binary "$bin" --fleet "$fleet" --out target/fleet "${args[@]}"
fi
if [ "$vm" = 1 ]; then
  out=target/soak-vm
  mkdir -p "$out"
  # Boot and the drain come on top of the soak itself.
  export SOFTROCE_TIMEOUT=$(( ${minutes%.*} * 60 + 600 ))
  export SOFTROCE_RWDIRS="$repo/$out"
  exec tools/softroce/run.sh -- python3 tools/soak/soak.py --vm --binary "$bin" \
    --minutes "$minutes" --out "$out" --decodes network,network "${args[@]}"
fi
exec python3 tools/soak/soak.py --binary "$bin" --minutes "$minutes" --out target/soak "${args[@]}"
