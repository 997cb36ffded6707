#!/usr/bin/env bash
# Test command part "vm": the RDMA tests for real inside the SoftRoCE VM
# (tools/softroce/run.sh): the one-device tests, the holds' (confirmations, leases) and the
# two-device ones (striping, failover), in one boot. Inside the VM a skip fails: it has the
# devices. KVLINK_SKIP_VM=1 leaves the part out, and the summary says so.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
MIN_VM=20

label="SoftRoCE VM (RDMA)"
if [ "${KVLINK_SKIP_VM:-0}" = 1 ]; then
  tally skip --part vm --label "$label" --why "KVLINK_SKIP_VM=1; the RDMA tests did not run for real"
  exit 0
fi
echo "test: RDMA tests inside the SoftRoCE VM"
bins=$(cargo test --test rdma --test rdma_holds --test rdma_rails --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    if d.get("reason") == "compiler-artifact" and d.get("executable") and d["target"]["name"] in ("rdma", "rdma_holds", "rdma_rails"):
        print(d["executable"])')
if [ "$(printf '%s\n' "$bins" | grep -c .)" != 3 ]; then
  tally fail --part vm --label "$label" --why "the three rdma test binaries could not be built"
  exit 0
fi
vmcmd=$(mktemp -p target vm-rdma.XXXXXX.sh)
{ echo 'rc=0'; for b in $bins; do echo "\"$b\" --test-threads=1 || rc=1"; done; echo 'exit $rc'; } >"$vmcmd"
cargo_part vm "$label" "$MIN_VM" fail "" tools/softroce/run.sh -- bash "$vmcmd"
