#!/usr/bin/env bash
# kvlink's KV-event index against Dynamo's (tools/bench_index.py): the same prefix-caching
# trace over ZeroMQ into `kvlink-events index` and Dynamo's standalone indexer, the same
# queries over HTTP and in process (kvlink.events.Index against Dynamo's RadixTree).
#
#   tools/bench-index.sh [--engines N] [--requests N] [--queries N] [--rounds N]
#
# Installs ai-dynamo-runtime 1.6.1 into target/bench-index-venv (its own venv), builds
# kvlink-events (release) and uses the kvlink wheel in .venv (tools/test.sh python builds it).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
tools/deps.sh
venv=target/bench-index-venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import dynamo.llm, zmq, msgpack' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "ai-dynamo-runtime==1.6.1" pyzmq msgpack
fi
cargo build --release -q -p kvlink-events-cli
py=.venv/bin/python
if ! "$py" -c 'import kvlink.events, zmq, msgpack' 2>/dev/null; then
  echo "bench-index: .venv has no kvlink wheel with pyzmq and msgpack: run tools/test.sh python first" >&2
  exit 1
fi
exec "$py" tools/bench_index.py --kvlink-events target/release/kvlink-events \
  --dynamo-python "$venv/bin/python" "$@"
