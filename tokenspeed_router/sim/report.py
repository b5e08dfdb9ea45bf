"""Metrics of simulated runs, ``results.json`` and PNG plots.

Metric definitions (why each one):

* ``hit_ratio`` — cached prompt tokens / all prompt tokens (token-weighted,
  what prefill compute actually saves), from the workers' real caches.
* ``ttft_*_s`` — simulated time to first token = queueing + prefill (+ KV
  transfer when disaggregated); percentiles are nearest-rank.
* ``queue_*_s`` — the queueing part alone: a policy that piles work on one
  worker shows up here first.
* ``load_imbalance`` — busiest worker's prefill busy time / the mean (1.0 is
  perfect balance; the collapse of pure prefix routing is 8.0 on 8 workers).
* ``prediction_error_tokens`` — mean |predicted hit - actual hit| for
  policies that predict (kv_aware, approx, oracle): how stale the router's
  view of the caches was.

matplotlib is imported only when plots are written (an optional extra).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.percentiles import percentile
from tokenspeed_router.sim.cluster import RunResult

__all__ = [
    "POLICY_ORDER",
    "format_table",
    "policy_metrics",
    "results_document",
    "write_plots",
    "write_results",
]

#: Report order: baselines first, then ours, then the ceiling.
POLICY_ORDER = ("random", "round_robin", "least_loaded", "approx", "kv_aware", "oracle")




def policy_metrics(run: RunResult, *, slo_s: Sequence[float] = (2.0, 10.0)) -> dict[str, Any]:
    """The per-policy metrics dictionary written to ``results.json``."""
    total = int(run.input_tokens.sum())
    pool = run.busy_s[: run.num_prefill_workers or run.busy_s.size]
    busy_mean = float(pool.mean()) if pool.size else 0.0
    predicted = run.predicted_hit_tokens >= 0
    out: dict[str, Any] = {
        "requests": int(run.ttft_s.size),
        "hit_ratio": float(run.hit_tokens.sum() / total) if total else 0.0,
        "ttft_p50_s": percentile(run.ttft_s, 50),
        "ttft_p90_s": percentile(run.ttft_s, 90),
        "ttft_p99_s": percentile(run.ttft_s, 99),
        "ttft_mean_s": float(run.ttft_s.mean()) if run.ttft_s.size else math.nan,
        "queue_p50_s": percentile(run.queue_s, 50),
        "queue_p99_s": percentile(run.queue_s, 99),
        "queue_mean_s": float(run.queue_s.mean()) if run.queue_s.size else math.nan,
        "load_imbalance": float(pool.max() / busy_mean) if busy_mean else 0.0,
        "busy_s_per_worker": [round(float(b), 3) for b in run.busy_s],
        "requests_per_worker": np.bincount(run.worker_index, minlength=run.busy_s.size).tolist(),
        "event_batches_published": run.events_published,
        "event_batches_lost": run.events_lost_batches,
        "wall_s": round(run.wall_s, 3),
    }
    for slo in slo_s:
        out[f"ttft_under_{slo:g}s"] = float((run.ttft_s <= slo).mean()) if run.ttft_s.size else 0.0
    if predicted.any():
        err = np.abs(run.predicted_hit_tokens[predicted] - run.hit_tokens[predicted])
        out["prediction_error_tokens"] = float(err.mean())
        over = run.predicted_hit_tokens[predicted] > run.hit_tokens[predicted]
        out["predicted_hit_actual_miss_rate"] = float(over.mean())
    return out


def results_document(
    *,
    trace: str,
    workers: int,
    runs: Mapping[str, RunResult],
    config: Mapping[str, Any],
    trace_stats: Mapping[str, float],
    sweeps: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble the ``results.json`` document (schema: see the module doc)."""
    policies = {name: policy_metrics(runs[name]) for name in _ordered(runs)}
    doc: dict[str, Any] = {
        "trace": trace,
        "workers": workers,
        "config": dict(config),
        "trace_stats": dict(trace_stats),
        "policies": policies,
    }
    if "oracle" in policies and policies["oracle"]["hit_ratio"] > 0:
        oracle_hit = policies["oracle"]["hit_ratio"]
        doc["hit_ratio_vs_oracle"] = {n: m["hit_ratio"] / oracle_hit for n, m in policies.items()}
    if sweeps:
        doc["sweeps"] = dict(sweeps)
    return doc


def _ordered(names: Mapping[str, Any]) -> list[str]:
    known = [n for n in POLICY_ORDER if n in names]
    return known + sorted(n for n in names if n not in POLICY_ORDER)


def check_out_dir(out_dir: Path) -> None:
    """Fail before a run, not after it, when ``--out`` cannot be a results folder."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} exists and is not a directory")


def write_results(doc: Mapping[str, Any], out_dir: Path) -> Path:
    """Write ``results.json`` (NaN written as null, so strict parsers accept it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(_jsonable(doc), indent=2) + "\n", encoding="utf-8")
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def format_table(doc: Mapping[str, Any], *, modes: Mapping[str, str] | None = None) -> str:
    """A fixed-width text table of policies vs hit ratio and TTFT."""
    head = f"{'policy':<19}{'hit':>7}{'vs oracle':>10}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'mean':>9}{'imbal':>7}"
    if modes:
        head += "  mode"
    lines = [head, "-" * len(head)]
    ratio = doc.get("hit_ratio_vs_oracle", {})
    for name, m in doc["policies"].items():
        vs = f"{ratio[name]:.0%}" if name in ratio else "-"
        line = (
            f"{name:<19}{m['hit_ratio']:>7.1%}{vs:>10}{m['ttft_p50_s']:>9.2f}s{m['ttft_p90_s']:>8.2f}s"
            f"{m['ttft_p99_s']:>8.2f}s{m['ttft_mean_s']:>8.2f}s{m['load_imbalance']:>7.2f}"
        )
        if modes:
            line += f"  {modes.get(name, '')}"
        lines.append(line)
    return "\n".join(lines)


def try_write_plots(
    runs: Mapping[str, RunResult], out_dir: Path, *, title: str
) -> tuple[list[Path], str | None]:
    """:func:`write_plots`, or no plots and the reason when matplotlib is missing.

    Plots are the optional extra (``[plot]``): the results are already written,
    so a missing matplotlib is a note for the user, not a failed run.
    """
    try:
        return write_plots(runs, out_dir, title=title), None
    except ImportError as err:
        return [], f"plots skipped: {err}"


def write_plots(runs: Mapping[str, RunResult], out_dir: Path, *, title: str) -> list[Path]:
    """Write hit ratio, TTFT CDF and per-worker load PNGs; returns their paths.

    Raises ImportError with an install hint when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the extra
        raise ImportError("plots need matplotlib: pip install 'tokenspeed-router[plot]'") from err
    out_dir.mkdir(parents=True, exist_ok=True)
    names = _ordered(runs)
    metrics = {n: policy_metrics(runs[n]) for n in names}
    paths: list[Path] = []

    fig, (ax_hit, ax_cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {n: plt.get_cmap("tab10")(i) for i, n in enumerate(POLICY_ORDER)}
    hits = [metrics[n]["hit_ratio"] * 100 for n in names]
    ax_hit.bar(names, hits, color=[colors.get(n, "grey") for n in names])
    for i, h in enumerate(hits):
        ax_hit.text(i, h, f"{h:.1f}", ha="center", va="bottom", fontsize=8)
    ax_hit.set_ylabel("prefix hit ratio (% of prompt tokens)")
    ax_hit.set_title("hit ratio per policy")
    ax_hit.tick_params(axis="x", rotation=30)
    for n in names:
        ttft = np.sort(runs[n].ttft_s)
        if ttft.size:
            ax_cdf.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=n, color=colors.get(n, "grey"))
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("simulated TTFT (s, log)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT CDF")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / "policies.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

    shown = [n for n in ("round_robin", "least_loaded", "kv_aware", "oracle") if n in runs] or names
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 2.2 * len(shown)), sharex=True, squeeze=False)
    for ax, n in zip(axes[:, 0], shown, strict=True):
        run = runs[n]
        if run.load_times_s.size:
            for w, wname in enumerate(run.worker_names):
                ax.plot(run.load_times_s, run.load_backlog_s[:, w], lw=0.8, label=wname)
        ax.set_ylabel("backlog (s)")
        ax.set_title(f"{n}: queued prefill work per worker", fontsize=9)
    axes[-1, 0].set_xlabel("simulated time (s)")
    axes[0, 0].legend(fontsize=7, ncol=8, loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / "load.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    paths.append(path)
    return paths
