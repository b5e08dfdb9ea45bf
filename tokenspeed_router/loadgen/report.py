"""Summaries of a replay, ``results.json``, a text table and PNG plots.

Metric definitions (nearest-rank percentiles, the simulator's definition):

* ``ttft_*_s``, ``e2e_*_s`` — over successful requests;
* ``itl_*_s`` — over every inter-token gap of every successful request
  (a token-weighted view: long answers count more, as users feel them);
* ``hit_ratio`` — engine-reported: sum of ``usage.prompt_tokens_details.
  cached_tokens`` / sum of ``usage.prompt_tokens``, over successful requests
  whose engine reported both (``usage_reported`` says how many did). This is
  what the engines actually reused, whoever routed;
* ``router_added_*_s`` — client TTFT minus the engine's own TTFT
  (``engine_timing.ttft_s``, engine-sim reports it), over successful
  requests whose engine reported it (``router_added_reported`` says how
  many): what the router, the network and the load generator added;
* ``spread`` — requests per worker (``x-tokenspeed-worker``, else
  ``x-engine-id``, else ``system_fingerprint``) and ``max_over_mean``: 1.0 is
  an even split; a router that piles load on one engine shows it here.

matplotlib is imported only when plots are written (the ``plot`` extra);
without it the plots are skipped with a note, never the results.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenspeed_router.loadgen.client import RequestRecord
from tokenspeed_router.percentiles import percentile
from tokenspeed_router.sim.report import write_results

__all__ = ["format_runs_table", "summarize", "write_plots", "write_results"]

logger = logging.getLogger(__name__)


def _dist(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_{k}": None for k in ("p50_s", "p90_s", "p99_s", "mean_s")}
    return {
        f"{prefix}_p50_s": percentile(values, 50),
        f"{prefix}_p90_s": percentile(values, 90),
        f"{prefix}_p99_s": percentile(values, 99),
        f"{prefix}_mean_s": sum(values) / len(values),
    }


def summarize(records: Sequence[RequestRecord], *, wall_s: float,
              workers: Sequence[str] = ()) -> dict[str, Any]:
    """The metrics of one run (see the module docstring).

    ``workers``: every worker behind the target, when known, so that one that
    got no request at all counts in the spread (a router that starves an
    engine looks balanced over the engines it did use).
    """
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    added = [a for r in ok if (a := r.router_added_s) is not None]
    usage = [r for r in ok if r.prompt_tokens is not None and r.cached_tokens is not None]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in usage)
    cached_tokens = sum(r.cached_tokens or 0 for r in usage)
    per_worker = Counter({w: 0 for w in workers})
    per_worker.update(r.worker or "?" for r in ok)
    counts = list(per_worker.values())
    mean = sum(counts) / len(counts) if counts else 0.0
    errors = Counter((r.error or "").split(":")[0] for r in records if not r.ok)
    out: dict[str, Any] = {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "error_kinds": dict(errors.most_common(5)),
        "wall_s": wall_s,
        "throughput_req_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        **_dist(ttft, "ttft"),
        **_dist(itl, "itl"),
        **_dist(e2e, "e2e"),
        **_dist(added, "router_added"),
        "router_added_max_s": max(added) if added else None,
        "router_added_reported": len(added),
        "output_tokens": sum(r.completion_tokens or r.output_chunks for r in ok),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "hit_ratio": cached_tokens / prompt_tokens if prompt_tokens else None,
        "usage_reported": len(usage),
        "requests_per_worker": dict(sorted(per_worker.items())),
        "spread_max_over_mean": max(counts) / mean if mean else None,
    }
    return out


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_runs_table(runs: Mapping[str, Mapping[str, Any]], *, label: str = "run") -> str:
    """One row per run: TTFT p50/p99, ITL p50, e2e p99, hit ratio, spread, errors."""
    width = max([len(label), *(len(n) for n in runs)]) + 2
    head = (f"{label:<{width}}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'e2e p99':>9}"
            f"{'hit':>7}{'spread':>8}{'added p99':>10}{'errors':>8}")
    lines = [head, "-" * len(head)]
    for name, m in runs.items():
        hit = "-" if m.get("hit_ratio") is None else f"{m['hit_ratio']:.1%}"
        spread = "-" if m.get("spread_max_over_mean") is None else f"{m['spread_max_over_mean']:.2f}"
        lines.append(
            f"{name:<{width}}{_fmt_s(m.get('ttft_p50_s')):>10}{_fmt_s(m.get('ttft_p99_s')):>10}"
            f"{_fmt_s(m.get('itl_p50_s')):>9}{_fmt_s(m.get('e2e_p99_s')):>9}{hit:>7}{spread:>8}"
            f"{_fmt_s(m.get('router_added_p99_s')):>10}{m.get('errors', 0):>8}"
        )
    return "\n".join(lines)


def write_plots(
    runs: Mapping[str, Sequence[RequestRecord]], out_dir: Path, *, title: str,
    workers: Sequence[str] = (), name: str = "loadgen.png",
) -> list[Path]:
    """TTFT CDF, TTFT over time and requests per worker, one curve/bar group per run.

    Returns the written paths; an empty list (and a log line) without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: plots skipped "
                       "(pip install 'tokenspeed-router[plot]')")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (ax_cdf, ax_time, ax_spread) = plt.subplots(1, 3, figsize=(16, 4.5))
    workers = sorted({*workers, *(r.worker or "?" for recs in runs.values() for r in recs if r.ok)})
    n_runs = max(1, len(runs))
    bar_w = 0.8 / n_runs
    for k, (label, recs) in enumerate(runs.items()):
        ok = [r for r in recs if r.ok and r.ttft_s is not None]
        ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
        if ttft:
            ax_cdf.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=label)
            ax_time.scatter([r.sent_s for r in ok], [r.ttft_s for r in ok], s=4, label=label, alpha=0.6)
        counts = Counter(r.worker or "?" for r in recs if r.ok)
        ax_spread.bar([i + k * bar_w for i in range(len(workers))], [counts.get(w, 0) for w in workers],
                      width=bar_w, label=label)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("TTFT (s, log)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT CDF")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend(fontsize=8)
    ax_time.set_yscale("log")
    ax_time.set_xlabel("send time (s)")
    ax_time.set_ylabel("TTFT (s, log)")
    ax_time.set_title("TTFT over the run")
    ax_time.grid(True, alpha=0.3)
    ax_spread.set_xticks([i + 0.4 - bar_w / 2 for i in range(len(workers))], workers, rotation=30,
                         fontsize=8)
    ax_spread.set_ylabel("requests")
    ax_spread.set_title("requests per worker")
    ax_spread.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
