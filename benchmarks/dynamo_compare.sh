#!/usr/bin/env bash
# Run the KvIndex benchmark and NVIDIA Dynamo's RadixTree on the same workload, in one process.
#
#   benchmarks/dynamo_compare.sh                 # 8 and 64 workers, ~1M stored blocks
#   benchmarks/dynamo_compare.sh --quick         # any benchmarks/bench_index.py flags pass through
#
# Creates a separate venv (default $TMPDIR/tokenspeed-router-dynamo-venv, override with DYNAMO_VENV) holding
# ai-dynamo-runtime==1.6.1 from PyPI plus our runtime dependencies, and runs this checkout
# from source (PYTHONPATH) so the project venv stays free of Dynamo. Results go to
# ${OUT:-out/bench_index_vs_dynamo.json}.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out
VENV="${DYNAMO_VENV:-${TMPDIR:-/tmp}/tokenspeed-router-dynamo-venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import dynamo.llm" 2>/dev/null; then
    "$VENV/bin/pip" install --quiet "ai-dynamo-runtime==1.6.1" numpy xxhash msgspec pyzmq
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" benchmarks/bench_index.py \
    --dynamo --json "${OUT:-out/bench_index_vs_dynamo.json}" "$@"
