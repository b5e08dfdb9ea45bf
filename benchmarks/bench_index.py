"""KvIndex benchmark: ingestion, match (hashing included), removal, memory per block.

Thin wrapper around ``tokenspeed-router bench`` (``tokenspeed_router/router/bench.py``,
where the workload is described). Run::

    .venv/bin/python benchmarks/bench_index.py --quick          # smoke, < 30 s
    .venv/bin/python benchmarks/bench_index.py                  # 8 and 64 workers, ~1M blocks
    .venv/bin/python benchmarks/bench_index.py --json out.json
    benchmarks/dynamo_compare.sh                                # side by side with NVIDIA Dynamo
"""

from __future__ import annotations

import sys

from tokenspeed_router.router.bench import main

if __name__ == "__main__":
    sys.exit(main())
