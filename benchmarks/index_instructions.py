"""A fixed KvIndex workload for counting instructions (repeatable on a noisy machine).

Wall-clock timings on a shared machine move by 1.5x between runs; callgrind's
instruction counts do not. Run it under valgrind, collecting only the native
core's ingest (``Core_store``) and match (``do_match``) calls::

    valgrind --tool=callgrind --callgrind-out-file=out/cg.out \\
        --toggle-collect=do_match --toggle-collect=Core_store \\
        .venv/bin/python benchmarks/index_instructions.py
    callgrind_annotate --inclusive=yes out/cg.out | grep -E 'do_match|Core_store|walk'

Workload: ``tokenspeed-router bench``'s (``bench/cli_bench.py``), 64 workers,
60k stored blocks, then every continuation and new-conversation query of
8k and 32k tokens (list input), five times.
"""

from __future__ import annotations

import argparse

from tokenspeed_router.bench import cli_bench as bench
from tokenspeed_router.router.index import KvIndex


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=60_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    wl = bench.build_workload(args.workers, args.blocks, queries=10)
    queries = [q for by_len in wl.queries.values() for n, qs in by_len.items() if n >= 8000 for q in qs]
    index = KvIndex()
    for name, batch in wl.events:
        index.apply(name, batch)
    for _ in range(args.repeat):
        for q in queries:
            index.match(q)
    print(f"{index.implementation} core: {len(wl.events)} events, {wl.stored_blocks} blocks, "
          f"{len(queries) * args.repeat} queries")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
