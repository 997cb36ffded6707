#!/usr/bin/env bash
# Test command part "soak": a 60-second fault soak on this host (tools/soak.sh: TCP and the
# same-host path; prefills and decodes killed and restarted, stopped, a prefill not polling,
# holds expiring under their reader, cancels, a wrong key). The VM part runs one over RDMA.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

echo "test: a 60-second fault soak on this host"
logged_part soak soak "fault soak, host (60 s)" 1 count "" tools/soak.sh --minutes 1 --quiet 4
