#!/usr/bin/env bash
# Test command part "soak": a 60-second fault soak on this host (tools/soak.sh: TCP and the
# same-host path; prefills and decodes killed and restarted, stopped, a prefill not polling,
# holds expiring under their reader, cancels, a wrong key), then a fleet run of 16 prefills and
# 16 decodes (every decode reads from every prefill, all 256 sessions close idle, a decode
# moving from prefill to prefill holds no more sessions than the idle limit allows). The VM part
# runs both over RDMA.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

echo "test: a 60-second fault soak on this host"
logged_part soak soak "fault soak, host (60 s)" 1 count "" tools/soak.sh --minutes 1 --quiet 4
echo "test: a fleet run on this host (16 prefills x 16 decodes)"
logged_part fleet fleet "fleet run, host (16 x 16, TCP)" 1 count "" tools/soak.sh --fleet 16,16
