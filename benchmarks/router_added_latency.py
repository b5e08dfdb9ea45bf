"""Router-added latency during a trace replay: client TTFT minus the engine's own TTFT (issues 20 and 27).

Run: ``flock /tmp/tsr-bench.lock .venv/bin/python benchmarks/router_added_latency.py
[--quick] [--runs 3] [--time-scales 1,2] [--routers tokenspeed,vllm-router]
[--trace synthetic] [--timing fifo] [--groups N] [--profile-gateway] [--out DIR]``
(vllm-router: ``make peers`` puts it in ``.venv-peers``, or any ``vllm-router``
on ``PATH``; a router whose binary is missing is skipped with a note).

The load of docs/compare-routers.md (``compare_routers.py``'s slice, 4
engine-sims with 12.5k-token caches, memory pressure) replayed at each
``--time-scales`` speed (1 = the engines' modelled speed and the trace's
arrival rate, 2 = both twice as fast): each request's engine reports its own
wall-clock TTFT (``engine_timing.ttft_s``, from the request reaching the
engine to its first token), so ``client TTFT - engine TTFT`` is what
everything in between added. Per speed and run, each on a fresh fleet,
interleaved in this order:

* ``tokenspeed`` -- through our ``serve`` gateway (kv_aware);
* ``vllm-router`` -- vllm-router's ``kv_aware`` on the same KV events;
* ``direct`` -- loadgen sends each request straight to the engine our
  gateway chose for it in that run (the same placement, so the same engine
  load and stream traffic, without a router): the floor of loadgen's own
  loop, HTTP and the engines' HTTP layer, measured beside the others.

Reported per speed: router-added p50 / p99 / max (wall ms) per router,
medians and min-max over runs, each router's p99 minus the direct p99 of
the same run, and what our gateway's ``/metrics`` says stalled its loop
(``tokenspeed_http_loop_longest_lag_seconds``, the longest GC pause).
Target (issue 27): our p99 <= vllm-router's at every speed.
``--profile-gateway`` records our gateway with py-spy (``pip install
py-spy``; not a project dependency) into ``DIR/gateway-<speed>x-<run>.txt``
(collapsed stacks, all threads, idle frames included). Output:
``DIR/results.json`` and a text table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compare_routers import ROUTERS, load_slice, run_one
from wrk_output import histogram_buckets

from tokenspeed_router.sim.report import write_results
from tokenspeed_router.sim.runner import ProgressBar

KEYS = ("router_added_p50_s", "router_added_p99_s", "router_added_max_s", "ttft_p99_s")


def _metrics_text(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            return str(resp.read().decode())
    except OSError:
        return None


def _schedstat(pid: int) -> dict[int, tuple[int, int]]:
    """Per OS thread of ``pid``: ns on a CPU and ns waiting runnable for one (``/proc/.../schedstat``)."""
    out: dict[int, tuple[int, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            run_ns, wait_ns, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        out[int(tid)] = (int(run_ns), int(wait_ns))
    return out


class _Watch:
    """What stalled our gateway during the replay alone (from ``on_ready`` to ``inspect``):
    its HTTP loop's lag histogram (a timer due every 10 ms, ``server/loop_lag.py``) and
    each thread's CPU time and time spent runnable but waiting for a CPU."""

    def __init__(self, profile: Path | None, *, ours: bool = True) -> None:
        self._ours = ours
        self._profiler = _Profiler(profile) if profile is not None else None
        self._lag0: dict[float, float] = {}
        self._sched0: dict[int, tuple[int, int]] = {}
        self._pid: int | None = None
        self._t0 = 0.0

    def ready(self, urls: Sequence[str]) -> None:
        self._pid = _listening_pid(int(urls[0].rsplit(":", 1)[-1]))
        text = _metrics_text(urls[0]) if self._ours else None
        self._lag0 = histogram_buckets(text, "tokenspeed_http_loop_lag_seconds") if text else {}
        self._sched0 = _schedstat(self._pid) if self._pid else {}
        self._t0 = time.monotonic()
        if self._profiler is not None and self._pid is not None:
            self._profiler.attach(self._pid)

    def inspect(self, urls: Sequence[str]) -> dict[str, Any]:
        if self._profiler is not None:
            self._profiler.detach()
        elapsed = time.monotonic() - self._t0
        out = _gateway_stalls(urls) if self._ours else {}
        text = _metrics_text(urls[0]) if self._ours else None
        lag = histogram_buckets(text, "tokenspeed_http_loop_lag_seconds") if text else {}
        total = lag.get(float("inf"), 0.0) - self._lag0.get(float("inf"), 0.0)
        for bound in (0.005, 0.01, 0.025, 0.05):
            if total and bound in lag:
                late = total - (lag[bound] - self._lag0.get(bound, 0.0))
                out[f"loop_late_over_{bound * 1000:g}ms"] = late / total
        out["loop_lag_samples_replay"] = total
        if self._pid is not None:
            sched = _schedstat(self._pid)
            main = sched.get(self._pid, (0, 0))
            main0 = self._sched0.get(self._pid, (0, 0))
            others = [(r - self._sched0.get(t, (0, 0))[0], w - self._sched0.get(t, (0, 0))[1])
                      for t, (r, w) in sched.items() if t != self._pid]
            out["main_thread_cpu_s"] = (main[0] - main0[0]) / 1e9
            out["main_thread_runqueue_wait_s"] = (main[1] - main0[1]) / 1e9
            out["other_threads_cpu_s"] = sum(r for r, _ in others) / 1e9
            out["other_threads_runqueue_wait_s"] = sum(w for _, w in others) / 1e9
            out["replay_wall_s"] = elapsed
        return out


def _gateway_stalls(urls: Sequence[str]) -> dict[str, Any]:
    """The gateway's own account of its loop's stalls, from ``/metrics`` (before it stops)."""
    out: dict[str, Any] = {}
    text = _metrics_text(urls[0])
    if text is None:
        return {"error": "no /metrics"}
    for line in text.splitlines():
        if line.startswith("tokenspeed_http_loop_longest_lag_seconds"):
            out["loop_longest_lag_s"] = float(line.split()[-1])
        elif line.startswith("tokenspeed_gc_longest_pause_seconds"):
            out["gc_longest_pause_s"] = float(line.split()[-1])
        elif line.startswith("tokenspeed_http_loop_lag_seconds_count"):
            out["loop_lag_samples"] = float(line.split()[-1])
    return out


class _Profiler:
    """py-spy attached to our gateway for one run."""

    def __init__(self, out: Path) -> None:
        self._out = out
        self._proc: subprocess.Popen[bytes] | None = None

    def attach(self, pid: int) -> None:
        pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not Path(pyspy).exists():
            return
        self._proc = subprocess.Popen([pyspy, "record", "--pid", str(pid), "--format", "raw", "--idle",
                                       "--threads", "--rate", "200", "--output", str(self._out), "--nonblocking"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def detach(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()


def _listening_pid(port: int) -> int | None:
    """The pid of the process listening on 127.0.0.1:``port`` (Linux /proc)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return int(pid)
    return None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _one_speed(args: argparse.Namespace, scale: float, routers: list[str], groups: int | None, runs: int,
               log_root: Path, bar: ProgressBar) -> dict[str, Any]:
    requests = load_slice(args.trace, groups=groups, speedup_factor=scale)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in [*routers, "direct"]}
    for run in range(runs):
        placement: list[str | None] = []
        for name in routers:
            ours = name == "tokenspeed"
            watch = _Watch(args.out / f"gateway-{scale:g}x-{run + 1}.txt" if args.profile_gateway and ours
                           else None, ours=ours)
            summary, records = run_one(ROUTERS[name], "pressure", requests, time_scale=scale,
                                       log_dir=log_root / f"{name}-{scale:g}x-{run}", progress=bar,
                                       timing=args.timing, label=f"{name}@{scale:g}x#{run + 1}",
                                       inspect=watch.inspect, on_ready=watch.ready)
            rows[name].append(summary)
            if name == "tokenspeed":
                placement = [r.worker for r in records]
        summary, _ = run_one(ROUTERS["direct"], "pressure", requests, time_scale=scale,
                             log_dir=log_root / f"direct-{scale:g}x-{run}", progress=bar, timing=args.timing,
                             label=f"direct@{scale:g}x#{run + 1}", placement=placement or None)
        rows["direct"].append(summary)
    medians = {name: {k: statistics.median(v for r in rs if (v := r.get(k)) is not None) for k in KEYS}
               for name, rs in rows.items()}
    spans = {name: {k: (min(r[k] for r in rs), max(r[k] for r in rs)) for k in KEYS} for name, rs in rows.items()}
    over_direct = {name: [g["router_added_p99_s"] - d["router_added_p99_s"]
                          for g, d in zip(rows[name], rows["direct"], strict=True)] for name in routers}
    return {"time_scale": scale, "requests": len(requests), "runs": rows, "median": medians, "min_max": spans,
            "minus_direct_p99_s": over_direct}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="synthetic", help="synthetic or conversation")
    parser.add_argument("--timing", default="fifo", help="engine timing profile (fifo, chunked)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--groups", type=int, default=None, help="prefix groups (default: the slice's, 60)")
    parser.add_argument("--time-scales", default="1,2", help="replay speeds, comma-separated (default 1,2)")
    parser.add_argument("--routers", default="tokenspeed,vllm-router",
                        help="routers beside the direct floor (tokenspeed first: direct replays its placement)")
    parser.add_argument("--profile-gateway", action="store_true", help="py-spy our gateway in every run")
    parser.add_argument("--quick", action="store_true", help="12 groups, one run")
    parser.add_argument("--out", type=Path, default=Path("out/router_added_latency"))
    args = parser.parse_args(argv)
    groups = 12 if args.quick else args.groups
    runs = 1 if args.quick else max(1, args.runs)
    scales = [float(s) for s in args.time_scales.split(",") if s.strip()]
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    for name in list(routers):
        why = ROUTERS[name].available()
        if why is not None:
            print(f"skipping {name}: {why}")
            routers.remove(name)
    args.out.mkdir(parents=True, exist_ok=True)
    log_root = Path(tempfile.mkdtemp(prefix="router-added-"))
    bar = ProgressBar()
    started = time.monotonic()
    speeds = [_one_speed(args, scale, routers, groups, runs, log_root, bar) for scale in scales]
    doc = {
        "config": {"trace": args.trace, "timing": args.timing, "runs": runs, "groups": groups,
                   "time_scales": scales, "routers": routers},
        "speeds": speeds,
        "wall_s": time.monotonic() - started,
    }
    path = write_results(doc, args.out)
    verdicts = []
    for sp in speeds:
        print(f"\n{args.trace} at {sp['time_scale']:g}x, {sp['requests']} requests, engines {args.timing}, "
              f"{runs} run(s)")
        print(f"{'':<13}{'added p50':>22}{'added p99':>22}{'added max':>22}   (wall ms, median [min-max])")
        for name in sp["runs"]:
            m, s = sp["median"][name], sp["min_max"][name]
            cells = [f"{_ms(m[k])} [{_ms(s[k][0])}-{_ms(s[k][1])}]" for k in KEYS[:3]]
            print(f"{name:<13}" + "".join(f"{c:>22}" for c in cells))
        for name, diffs in sp["minus_direct_p99_s"].items():
            print(f"{name} p99 - direct p99 (ms): " + ", ".join(_ms(v) for v in diffs))
        stalls = [r.get("inspected", {}) for r in sp["runs"].get("tokenspeed", [])]
        print("gateway loop longest lag since start (ms): "
              + ", ".join(_ms(x.get("loop_longest_lag_s")) for x in stalls))
        print("gateway loop late > 10 / > 50 ms during the replay: " + ", ".join(
            f"{100 * x.get('loop_late_over_10ms', float('nan')):.2f}% / {100 * x.get('loop_late_over_50ms', float('nan')):.2f}%"
            for x in stalls))
        print("gateway main thread: CPU / waiting for a CPU (s): " + ", ".join(
            f"{x.get('main_thread_cpu_s', float('nan')):.2f} / {x.get('main_thread_runqueue_wait_s', float('nan')):.2f}"
            for x in stalls))
        print("gateway longest GC pause (ms): " + ", ".join(_ms(x.get("gc_longest_pause_s")) for x in stalls))
        for name, rs in sp["runs"].items():
            seen = [r.get("inspected", {}) for r in rs if r.get("inspected")]
            if seen:
                print(f"{name} process, all threads: CPU / waiting for a CPU (s): " + ", ".join(
                    f"{x.get('main_thread_cpu_s', 0) + x.get('other_threads_cpu_s', 0):.2f} / "
                    f"{x.get('main_thread_runqueue_wait_s', 0) + x.get('other_threads_runqueue_wait_s', 0):.2f}"
                    for x in seen))
        if "tokenspeed" in sp["median"] and "vllm-router" in sp["median"]:
            ours = sp["median"]["tokenspeed"]["router_added_p99_s"]
            theirs = sp["median"]["vllm-router"]["router_added_p99_s"]
            verdicts.append(f"{sp['time_scale']:g}x: {'met' if ours <= theirs else 'NOT met'} "
                            f"({_ms(ours)} vs {_ms(theirs)} ms)")
    if verdicts:
        print("\ntarget tokenspeed p99 <= vllm-router p99: " + "; ".join(verdicts))
    print(f"results: {path} (wall {doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
