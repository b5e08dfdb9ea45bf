"""Render deploy/grafana/tokenspeed-router.json's panels from a real run, as one PNG (docs/operations.md).

Grafana cannot be installed offline here, so this stands in for its
screenshot, honestly: a real fleet (redis-server, three engine-sims, one of
them losing events on purpose, ``serve --state redis://...?ingest=stream``,
``loadgen`` replaying the bundled Mooncake slice through the gateway) is scraped once a second; each
panel's own PromQL (read from the dashboard JSON, ``$__rate_interval`` =
30 s, ``$worker`` = all) is evaluated over those scrapes by the small
evaluator below (the subset the dashboard uses: selectors, ``rate``,
``histogram_quantile``, ``sum``/``max``/``min`` ``by``, arithmetic between
vectors and scalars); matplotlib draws the result.

    .venv/bin/python deploy/render_dashboard.py --out docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import promql_parser as pp
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "tokenspeed-router.json"
TRACE = ROOT / "tokenspeed_router" / "sim" / "data" / "mooncake_synthetic_slice.jsonl"
Labels = frozenset[tuple[str, str]]
Scrape = tuple[float, dict[str, dict[Labels, float]]]


# ----------------------------------------------------------------------------- a tiny PromQL evaluator

def _matches(labels: dict[str, str], matchers: Any) -> bool:
    for m in matchers.matchers:
        value = labels.get(m.name, "")
        if m.op == pp.MatchOp.Equal and value != m.value:
            return False
        if m.op == pp.MatchOp.NotEqual and value == m.value:
            return False
        if m.op == pp.MatchOp.Re and not re.fullmatch(m.value, value):
            return False
        if m.op == pp.MatchOp.NotRe and re.fullmatch(m.value, value):
            return False
    return True


def _select(scrape: dict[str, dict[Labels, float]], sel: Any) -> dict[Labels, float]:
    return {k: v for k, v in scrape.get(sel.name, {}).items() if _matches(dict(k), sel.matchers)}


def evaluate(node: Any, scrapes: list[Scrape], i: int) -> dict[Labels, float] | float:
    """The value of ``node`` at scrape ``i`` (an instant vector or a scalar)."""
    t, now = scrapes[i]
    if isinstance(node, pp.NumberLiteral):
        return float(node.val)
    if isinstance(node, pp.ParenExpr):
        return evaluate(node.expr, scrapes, i)
    if isinstance(node, pp.VectorSelector):
        return _select(now, node)
    if isinstance(node, pp.Call):
        name = node.func.name
        if name == "rate":
            m = node.args[0]
            window = m.range.total_seconds()
            first = next(j for j in range(i + 1) if scrapes[j][0] >= t - window)
            t0, then = scrapes[first]
            old, new = _select(then, m.vector_selector), _select(now, m.vector_selector)
            return {k: max(0.0, v - old[k]) / (t - t0) for k, v in new.items() if k in old and t > t0}
        if name == "histogram_quantile":
            q = float(evaluate(node.args[0], scrapes, i))  # type: ignore[arg-type]
            vec = evaluate(node.args[1], scrapes, i)
            assert isinstance(vec, dict)
            groups: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
            for k, v in vec.items():
                d = dict(k)
                le = float(d.pop("le"))
                groups[frozenset(d.items())].append((le, v))
            return {k: _quantile(q, sorted(b)) for k, b in groups.items()}
        raise ValueError(f"function {name} not supported")
    if isinstance(node, pp.AggregateExpr):
        vec = evaluate(node.expr, scrapes, i)
        assert isinstance(vec, dict)
        keep = set(node.modifier.labels) if node.modifier is not None else set()
        out: dict[Labels, list[float]] = defaultdict(list)
        for k, v in vec.items():
            out[frozenset((n, x) for n, x in k if n in keep)].append(v)
        reducers: dict[str, Callable[[list[float]], float]] = {"sum": sum, "max": max, "min": min}
        fn = reducers[str(node.op)]
        return {k: float(fn(v)) for k, v in out.items()}
    if isinstance(node, pp.BinaryExpr):
        lhs, rhs = evaluate(node.lhs, scrapes, i), evaluate(node.rhs, scrapes, i)
        op = {"/": lambda a, b: a / b if b else math.nan, "*": lambda a, b: a * b,
              "+": lambda a, b: a + b, "-": lambda a, b: a - b}[str(node.op)]
        if isinstance(lhs, dict) and isinstance(rhs, dict):
            return {k: op(v, rhs[k]) for k, v in lhs.items() if k in rhs}
        if isinstance(lhs, dict):
            return {k: op(v, rhs) for k, v in lhs.items()}
        if isinstance(rhs, dict):
            return {k: op(lhs, v) for k, v in rhs.items()}
        return op(lhs, rhs)
    raise ValueError(f"{type(node).__name__} not supported")


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    rank, prev_le, prev_count = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_count) / (count - prev_count) if count > prev_count else 0)
        prev_le, prev_count = le, count
    return prev_le


# ----------------------------------------------------------------------------- the real run

def _start(cmd: list[str], log: Path, stdout: Any = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=stdout, stderr=open(log, "wb"),
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _engine(work: Path, name: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    proc = _start([sys.executable, "-m", "tokenspeed_router.cli", "engine-sim", "--port", "0", "--events",
                   "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0", "--time-scale", "10",
                   "--capacity-tokens", "65536", "--name", name, *extra], work / f"{name}.log", subprocess.PIPE)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def record(work: Path, seconds: float) -> list[Scrape]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        rport = _free_port()
        procs.append(_start([shutil.which("redis-server") or "redis-server", "--port", str(rport), "--save", "",
                             "--appendonly", "no", "--dir", str(work)], work / "redis.log"))
        specs = []
        for name, extra in (("w0", []), ("w1", []), ("w2", ["--fault-drop-events", "0.5"])):
            proc, info = _engine(work, name, extra)
            procs.append(proc)
            specs += ["--worker", f"name={name},url={info['url']},events={info['events'][0]},"
                      f"replay={info['replay'][0]}"]
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        state = f"redis://127.0.0.1:{rport}/0?ingest=stream"  # stream mode exports every state series
        procs.append(_start([sys.executable, "-m", "tokenspeed_router.cli", "serve", *specs, "--http",
                             f"127.0.0.1:{port}", "--state", state], work / "serve.log"))
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("serve did not start: see " + str(work / "serve.log"))
            time.sleep(0.2)
        procs.append(_start([sys.executable, "-m", "tokenspeed_router.cli", "loadgen", "--trace", str(TRACE),
                             "--target", url, "--time-scale", "12", "--scale-prompts", "0.0625",
                             "--max-output-tokens", "8", "--out", str(work / "loadgen"), "--quiet"],
                            work / "loadgen.log"))
        scrapes: list[Scrape] = []
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            text = httpx.get(f"{url}/metrics", timeout=5).text
            sample: dict[str, dict[Labels, float]] = defaultdict(dict)
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    sample[s.name][frozenset(s.labels.items())] = float(s.value)
            scrapes.append((time.monotonic() - start, dict(sample)))
            time.sleep(1.0)
        return scrapes
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


# ----------------------------------------------------------------------------- drawing

def _legend(fmt: str, labels: Labels) -> str:
    d = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt) or "value"


def draw(scrapes: list[Scrape], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    cols = 4
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 5.2, rows * 3.0))
    fig.patch.set_facecolor("#181b1f")
    for ax, panel in zip(axes.flat, panels, strict=False):
        ax.set_facecolor("#111217")
        ax.set_title(panel["title"], color="#d8d9da", fontsize=8.5, loc="left")
        ax.tick_params(colors="#8e8e8e", labelsize=7)
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        stat_values = []
        for target in panel["targets"]:
            text = target["expr"].replace("$__rate_interval", "30s").replace("$worker", ".*")
            node = pp.parse(text)
            series: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
            for i in range(len(scrapes)):
                value = evaluate(node, scrapes, i)
                for k, v in (value.items() if isinstance(value, dict) else [(frozenset(), value)]):
                    if not math.isnan(v) and not math.isinf(v):
                        series[k].append((scrapes[i][0], v))
            for k, points in sorted(series.items(), key=lambda kv: sorted(kv[0])):
                label = _legend(target.get("legendFormat", ""), k)
                if panel["type"] == "stat":
                    stat_values.append((label, points[-1][1]))
                else:
                    ax.plot([p[0] for p in points], [p[1] for p in points], label=label, linewidth=1.2)
        if panel["type"] == "stat":
            ax.set_xticks([])
            ax.set_yticks([])
            for j, (label, value) in enumerate(stat_values):
                good = value == 1 if ("connected" in label or "leaders" in label) else value == 0
                ax.text(0.05 + 0.24 * j, 0.45, f"{value:g}", fontsize=18, color="#73bf69" if good else "#f2495c",
                        transform=ax.transAxes)
                ax.text(0.05 + 0.24 * j, 0.2, label, fontsize=6.5, color="#d8d9da", transform=ax.transAxes)
        else:
            ax.set_xlabel("s into the run", color="#8e8e8e", fontsize=7)
            if ax.lines:
                ax.legend(fontsize=6, facecolor="#181b1f", labelcolor="#d8d9da", edgecolor="#2c3235", loc="best")
            else:
                ax.text(0.5, 0.5, "no data", color="#8e8e8e", ha="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("tokenspeed-router dashboard (panels' PromQL evaluated over a real run's scrapes; "
                 "w2 drops half its event batches)", color="#d8d9da", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    parser.add_argument("--seconds", type=float, default=90.0, help="how long to scrape the run (default 90)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the processes' logs here")
    args = parser.parse_args()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        scrapes = record(args.workdir, args.seconds)
    else:
        with tempfile.TemporaryDirectory(prefix="tsr-dashboard-") as tmp:
            scrapes = record(Path(tmp), args.seconds)
    draw(scrapes, args.out)
    print(f"{args.out}: {len(scrapes)} scrapes")


if __name__ == "__main__":
    main()
