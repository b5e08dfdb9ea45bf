"""Session statistics of a Mooncake-format trace: the figures the workload shapes are fitted to.

Run: ``.venv/bin/python benchmarks/trace_sessions.py FILE [FILE ...]`` (the
Mooncake traces, or files ``tokenspeed-router trace`` wrote, to compare a
shape with its source). The format has no session field, so sessions are
inferred: a request continues the latest earlier request whose full blocks
(``input_length // 512`` of them, at least 2) are the start of its own ids.
That reads a follow-up turn as a continuation (it repeats the previous
prompt and appends); it can also chain two questions on one document whose
prompt ends inside the same block, so use it on conversation-like traces.
Fits are lognormal by moments of the logarithm (median = exp(mean log)).
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from tokenspeed_router.percentiles import percentile
from tokenspeed_router.sim.traces import TraceRequest, load_mooncake, trace_summary


def parents(requests: list[TraceRequest], min_blocks: int = 2) -> list[int | None]:
    """For each request, the index of the request it continues (or None)."""
    latest: dict[tuple[int, ...], int] = {}
    out: list[int | None] = []
    for i, r in enumerate(requests):
        ids = r.hash_ids
        parent = None
        for k in range(len(ids), min_blocks - 1, -1):
            j = latest.get(ids[:k])
            if j is not None:
                parent = j
                break
        out.append(parent)
        latest[ids[: r.input_length // r.block_tokens]] = i
    return out


def _lognormal(values: Sequence[float]) -> str:
    logs = [math.log(v) for v in values if v > 0]
    return f"median {math.exp(statistics.fmean(logs)):.0f}, log-sd {statistics.pstdev(logs):.2f}"


def _dist(values: Sequence[float]) -> str:
    return (f"p10 {percentile(values, 10):.0f} p50 {percentile(values, 50):.0f} mean {statistics.fmean(values):.0f} "
            f"p90 {percentile(values, 90):.0f} p99 {percentile(values, 99):.0f}")


def describe(path: Path) -> None:
    reqs = load_mooncake(path)
    up = parents(reqs)
    roots = [i for i, p in enumerate(up) if p is None]
    follow = [(i, p) for i, p in enumerate(up) if p is not None]
    s = trace_summary(reqs)
    print(f"{path.name}: {len(reqs)} requests over {s['span_s']:.0f} s ({s['req_per_s']:.2f}/s), "
          f"ideal hit {s['ideal_hit_ratio']:.1%} (tokens) {s['ideal_block_hit_ratio']:.1%} (blocks)")
    print(f"  input: {_dist([r.input_length for r in reqs])}; lognormal {_lognormal([r.input_length for r in reqs])}")
    print(f"  output: {_dist([r.output_length for r in reqs])}")
    print(f"  sessions (inferred): {len(roots)}, {len(reqs) / len(roots):.2f} requests each")
    print(f"  first-turn input: {_dist([reqs[i].input_length for i in roots])}; "
          f"lognormal {_lognormal([reqs[i].input_length for i in roots])}")
    if not follow:
        return
    gaps = [reqs[i].arrival_s - reqs[p].arrival_s for i, p in follow]
    print(f"  gap to the session's previous request (s): {_dist(gaps)}; lognormal {_lognormal(gaps)}")
    added = [reqs[i].input_length - reqs[p].input_length - reqs[p].output_length for i, p in follow]
    big = [a for a in added if a > 1000]
    small = [a for a in added if 0 < a <= 1000]
    print(f"  added beyond the previous answer: {len(big) / len(added):.1%} > 1,000 tokens "
          f"({_dist(big) if big else '-'}); the rest > 0: p50 {percentile(small, 50):.0f} "
          f"p90 {percentile(small, 90):.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path, help="Mooncake-format .jsonl files")
    for path in parser.parse_args().traces:
        describe(path)


if __name__ == "__main__":
    main()
