"""Sim-to-live parity: one trace slice through ``simulate`` and through engine-sims + the gateway.

Both sides run the same engine model (``tokenspeed_router/engine_model.py``,
timed by ``tokenspeed_router/timing.py``) with the same profile, workers
named alike (``w0`` …), the same token ids and the same router policy and
options; what only the live side has is real processes: HTTP, the KV event
transport and its lag, the gateway's load accounting (when a prefill counts
as done, when a request is released) and its truth loop. So where the two
disagree beyond noise, the live path does something the router in process
does not, and that is a bug to fix there.

* **simulate** — :class:`~tokenspeed_router.sim.cluster.Simulator` with the
  real ``Router`` (``RouterBackend``), on the virtual clock, the first token
  signalled at prefill end (what a streaming gateway sees);
* **live** — one ``engine-sim --timing PROFILE --time-scale K`` per worker,
  one ``serve`` gateway (``url=`` workers) whose time constants are divided
  by K like the engines' clock (``clock_scaled_router_flags``), and
  ``loadgen``'s open-loop replay with arrivals divided by K. The live TTFT
  compared is the engine's own, in modelled seconds
  (``engine_timing.modelled_ttft_s``): what the routing decisions
  caused, free of the wall-clock noise of a loaded machine (an engine-sim
  whose loop is starved fires its timers late; times K, 10 ms late is 40
  modelled ms). The client's TTFT (wall x K) and the router-added latency
  (client - engine, wall) are reported beside it, not compared.

Both sides replay the same **warm-up** first (:func:`warm_up_requests`):
short prompts of their own, one at a time, before the slice. The live
gateway needs one (its first requests pay one-time costs), and the
router's fitted prefill rate learns from every request it routes; a
warm-up the simulated router did not see left the two routers believing
different engine speeds (one engine on its own fit, another still on the
fleet's), so they split at the first close call, by the machine's luck.
The warm-up's outcomes are left out of the comparison.

Both routers are told the engines' real prefill rate and overhead
(:meth:`ParitySetup.router_prior`) as the prior of cost model v2's fit. With
the shipped prior (10k tokens/s against engines of 2.5k) the fit is still
learning the rate through the slice, and every close call depends on how far
it got: the simulated conversation slice alone swung from 43 % to 51 % hit
and from 5.9 to 10.1 s TTFT p99 with nothing changed but the warm-up, so
two runs of it (simulated or live) could not be compared. How fast the fit
leaves a wrong prior is a routing question (docs/routing.md), not parity's.

:func:`compare` checks per-worker request counts, hit ratio and TTFT p50 /
p99 against :class:`Tolerances` (docs/compare-routers.md says why those).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenspeed_router.loadgen.fleet import (
    EngineSimOptions,
    Fleet,
    PeerRouter,
    clock_scaled_router_flags,
)
from tokenspeed_router.loadgen.prompts import PromptBuilder, PromptConfig
from tokenspeed_router.loadgen.replay import ReplayConfig, replay
from tokenspeed_router.percentiles import percentile
from tokenspeed_router.sim.cluster import ClusterConfig, CostModel, Simulator
from tokenspeed_router.sim.policies import make_backend
from tokenspeed_router.sim.traces import TraceRequest
from tokenspeed_router.timing import Profile, TimingModel

__all__ = ["AT_LOAD", "AT_LOAD_TOLERANCES", "AtLoad", "ParitySetup", "SideResult", "Tolerances", "compare",
           "format_comparison", "live_side", "prepare", "simulate_side", "simulate_spread", "warm_up_requests"]

MODEL = "tokenspeed-sim"


@dataclass(frozen=True, kw_only=True)
class ParitySetup:
    """One cluster, described once for both sides (modelled seconds)."""

    num_workers: int = 4
    capacity_tokens: int = 12_500
    block_size: int = 16
    timing: Profile = "fifo"
    prefill_tokens_per_s: float = 2_500.0
    prefill_overhead_s: float | None = None
    decode_s_per_token: float = 0.02
    max_output_tokens: int = 16
    #: live engines and arrivals run this many times faster than modelled
    time_scale: float = 4.0
    #: the simulator's event delay in *wall* seconds of the live side (x time_scale modelled)
    event_lag_wall_s: float = 0.002
    #: the simulator's first-token delay (engine to gateway), in wall seconds of the live side
    first_token_lag_wall_s: float = 0.002
    policy: str = "kv_aware"
    router_options: tuple[tuple[str, Any], ...] = ()
    #: live side: this real peer router instead of the ``serve`` gateway, and ``policy`` is its
    #: emulation in ``sim/peers`` (benchmarks/peer_parity.py); None: our gateway
    peer: PeerRouter | None = None
    #: warm-up requests both sides replay before the slice (modelled seconds apart)
    warm_up_requests: int = 12
    warm_up_gap_s: float = 0.5
    #: simulated runs under the live path's timing noise (:func:`simulate_spread`)
    spread_runs: int = 8
    #: the most an arrival is made late in them, in wall seconds of the live side
    spread_delay_wall_s: float = 0.010
    spread_seed: int = 0

    def __post_init__(self) -> None:
        if self.warm_up_requests < 0 or not self.warm_up_gap_s > 0:
            raise ValueError("warm_up_requests must be >= 0 and warm_up_gap_s > 0")
        if self.spread_runs < 0 or not self.spread_delay_wall_s >= 0:
            raise ValueError("spread_runs must be >= 0 and spread_delay_wall_s >= 0")

    def timing_model(self) -> TimingModel:
        return TimingModel(profile=self.timing, prefill_tokens_per_s=self.prefill_tokens_per_s,
                           prefill_overhead_s=self.prefill_overhead_s,
                           decode_s_per_token=self.decode_s_per_token)

    def router_prior(self) -> dict[str, float]:
        """The engines' modelled prefill rate and overhead, as router options (modelled seconds)."""
        return {"prefill_tokens_per_s": self.prefill_tokens_per_s,
                "prefill_overhead_s": self.timing_model().overhead_s}

    def worker_names(self) -> list[str]:
        return [f"w{i}" for i in range(self.num_workers)]


@dataclass
class SideResult:
    """One side's per-request outcomes (TTFT in modelled seconds)."""

    name: str
    workers: list[str | None]
    ttft_s: list[float | None]
    cached_tokens: list[int | None]
    prompt_tokens: list[int]
    errors: int = 0
    #: live side only: the client's TTFT (wall x time scale) and the router-added latency (wall)
    client_ttft_s: list[float | None] = dataclasses.field(default_factory=list)
    router_added_s: list[float | None] = dataclasses.field(default_factory=list)

    def select(self, indices: Sequence[int]) -> SideResult:
        """The outcomes of ``indices`` only, in that order (every per-request list alike)."""
        def pick(values: list[Any]) -> list[Any]:
            return [values[i] for i in indices] if values else []

        return replace(self, workers=pick(self.workers), ttft_s=pick(self.ttft_s),
                       cached_tokens=pick(self.cached_tokens), prompt_tokens=pick(self.prompt_tokens),
                       client_ttft_s=pick(self.client_ttft_s), router_added_s=pick(self.router_added_s))

    def placed(self) -> int:
        """Requests that reached a worker (at least 1: a share's denominator)."""
        return max(1, sum(1 for w in self.workers if w is not None))

    def shape(self, names: Sequence[str]) -> list[float]:
        """Workers' shares of the requests, smallest first (which worker had which share left out)."""
        counts = self.per_worker(names)
        return sorted(counts[w] / self.placed() for w in names)

    def per_worker(self, names: Sequence[str]) -> dict[str, int]:
        counts = Counter({n: 0 for n in names})
        counts.update(w for w in self.workers if w is not None)
        return dict(sorted(counts.items()))

    def hit_ratio(self) -> float:
        pairs = [(c, p) for c, p in zip(self.cached_tokens, self.prompt_tokens, strict=True) if c is not None]
        total = sum(p for _, p in pairs)
        return sum(c for c, _ in pairs) / total if total else 0.0

    def ttft(self, q: float) -> float:
        values = [t for t in self.ttft_s if t is not None]
        return percentile(values, q) if values else float("nan")


def prepare(requests: Sequence[TraceRequest], setup: ParitySetup) -> list[TraceRequest]:
    """The slice both sides replay: arrivals from 0, outputs capped (``max_tokens`` = output length)."""
    if not requests:
        return []
    t0 = requests[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - t0,
                    output_length=max(1, min(r.output_length, setup.max_output_tokens)))
            for r in requests]


#: hash ids of warm-up blocks: far above any trace's (Mooncake ids count up from 0)
_WARM_UP_IDS = 1 << 60


def warm_up_requests(requests: Sequence[TraceRequest], setup: ParitySetup) -> list[TraceRequest]:
    """The warm-up both sides replay, then the slice shifted after it (warm-up first).

    Each warm-up request is two blocks of its own (nothing in the slice
    shares them) with a two-token answer, ``warm_up_gap_s`` apart: long
    enough that each is done before the next on an idle engine, so they
    teach both routers clean prefill samples, not a queue.
    """
    n, gap = setup.warm_up_requests, setup.warm_up_gap_s
    if n == 0 or not requests:
        return list(requests)
    block = requests[0].block_tokens
    warm = [TraceRequest(request_id=f"warm-up-{i}", arrival_s=i * gap, input_length=2 * block, output_length=2,
                         hash_ids=(_WARM_UP_IDS + 2 * i, _WARM_UP_IDS + 2 * i + 1), block_tokens=block)
            for i in range(n)]
    offset = n * gap + 1.0
    return warm + [replace(r, arrival_s=r.arrival_s + offset) for r in requests]


def simulate_side(requests: Sequence[TraceRequest], setup: ParitySetup) -> SideResult:
    """The slice through ``simulate``'s engine model and the in-process router (after the warm-up)."""
    t = setup.timing_model()
    cluster = ClusterConfig(
        num_workers=setup.num_workers, capacity_tokens=setup.capacity_tokens, page_size=setup.block_size,
        cost=CostModel(profile=setup.timing, prefill_tokens_per_s=setup.prefill_tokens_per_s,
                       prefill_overhead_s=t.overhead_s, decode_s_per_token=setup.decode_s_per_token),
        event_delay_s=setup.event_lag_wall_s * setup.time_scale,
        first_token_delay_s=setup.first_token_lag_wall_s * setup.time_scale,
    )
    sim = Simulator(cluster)
    options: dict[str, Any] = {**setup.router_prior(), **dict(setup.router_options)}
    # a peer emulation (setup.peer) ignores router options: the peers run with their defaults
    backend = make_backend(setup.policy, cluster, sim, router_options=options, signal_prefill_done=True)
    replayed = warm_up_requests(requests, setup)
    run = sim.run(replayed, backend)
    names = run.worker_names
    warm = len(replayed) - len(requests)
    return SideResult(
        name="simulate",
        workers=[names[i] for i in run.worker_index.tolist()],
        ttft_s=[float(x) for x in run.ttft_s.tolist()],
        cached_tokens=[int(x) for x in run.hit_tokens.tolist()],
        prompt_tokens=[int(x) for x in run.input_tokens.tolist()],
    ).select(range(warm, len(replayed)))


def simulate_spread(requests: Sequence[TraceRequest], setup: ParitySetup) -> list[SideResult]:
    """``setup.spread_runs`` simulated runs with every arrival late by up to the live path's delay.

    Live, each request reaches the router some milliseconds after loadgen
    sent it (HTTP, the gateway's parsing; ``spread_delay_wall_s`` wall,
    ``time_scale`` times that modelled) and each event some milliseconds
    after the engine published it. A decision that is a near-tie can fall
    either way on that noise, and everything after it follows; so the
    simulator's prediction for one live run is the range these runs span
    (seeded: the same slice gives the same runs).
    """
    rng = random.Random(setup.spread_seed)
    delay = setup.spread_delay_wall_s * setup.time_scale
    runs = []
    for _ in range(setup.spread_runs):
        late = [replace(r, arrival_s=r.arrival_s + rng.uniform(0.0, delay)) for r in requests]
        order = sorted(range(len(late)), key=lambda i: late[i].arrival_s)
        side = simulate_side([late[i] for i in order], setup)
        back = [0] * len(order)  # the outcomes in the slice's own order, as live reports them
        for pos, i in enumerate(order):
            back[i] = pos
        runs.append(side.select(back))
    return runs


def live_side(requests: Sequence[TraceRequest], setup: ParitySetup, log_dir: Path, *,
              python: str | None = None, startup_timeout_s: float = 120.0) -> SideResult:
    """The slice through engine-sims and a ``serve`` gateway (or ``setup.peer``), in real time (scaled)."""
    k = setup.time_scale
    overhead_ms = None if setup.prefill_overhead_s is None else setup.prefill_overhead_s * 1000.0
    engine = EngineSimOptions(block_size=setup.block_size, capacity_tokens=setup.capacity_tokens,
                              prefill_tokens_per_s=setup.prefill_tokens_per_s,
                              decode_s_per_token=setup.decode_s_per_token, time_scale=k, model=MODEL,
                              timing=setup.timing, prefill_overhead_ms=overhead_ms)
    fleet_kw: dict[str, Any] = {"startup_timeout_s": startup_timeout_s}
    if python is not None:
        fleet_kw["python"] = python
    extra = clock_scaled_router_flags(k, **setup.router_prior())
    for key, value in setup.router_options:
        extra += ["--router-option", f"{key}={value}"]
    replayed = warm_up_requests(requests, setup)
    paced = [replace(r, arrival_s=r.arrival_s / k) for r in replayed]
    builder = PromptBuilder(PromptConfig(model=MODEL, max_output_tokens=setup.max_output_tokens,
                                         prompt_format=setup.peer.prompt_format if setup.peer else "tokens"))
    with Fleet(log_dir, **fleet_kw) as fleet:
        engines = fleet.start_engines(setup.worker_names(), [engine] * setup.num_workers)
        if setup.peer is not None:
            url = fleet.start_peer(setup.peer.peer, setup.peer, engines)
        else:
            url = fleet.start_gateway("gateway", engines, policy=setup.policy, extra=extra)
        outcome = replay(paced, builder, ReplayConfig(target=url))
    records = outcome.records
    warm = len(replayed) - len(requests)
    return SideResult(
        name="live",
        workers=[r.worker if r.ok else None for r in records],
        ttft_s=[r.engine_modelled_ttft_s if r.ok else None for r in records],
        cached_tokens=[r.cached_tokens if r.ok else None for r in records],
        prompt_tokens=[r.prompt_tokens or r.input_length for r in records],
        errors=sum(1 for r in records if not r.ok),
        client_ttft_s=[r.ttft_s * k if r.ok and r.ttft_s is not None else None for r in records],
        router_added_s=[r.router_added_s if r.ok else None for r in records],
    ).select(range(warm, len(replayed)))


@dataclass(frozen=True)
class Tolerances:
    """How far live may be from simulate (see docs/compare-routers.md for why these).

    ``worker_share``: the largest difference between the two sides' shares of
    the requests, busiest worker against busiest, second against second and
    so on (0.05 = 5 points; the load's shape: which of two equal idle engines
    took a prefix group is arbitrary once the runs part, so the share per
    worker name is reported as ``named_diff``, not compared), widened to ``share_sigmas`` standard
    deviations of the difference of two binomial shares (``sqrt(2 p (1 - p)
    / n)``, p = 1 / workers) for short slices: once one decision differs (a
    10 ms hiccup reorders two events), later ties fall either way, and over
    n requests the counts then differ by sampling noise alone;
    ``hit_points``: hit ratio difference;
    ``ttft_p50`` / ``ttft_p99``: relative TTFT difference, with an absolute
    floor ``ttft_floor_s`` (modelled) below which a difference is noise.
    ``tail_quantile``: the tail compared with the ``ttft_p99`` tolerance (99;
    a slice of under ~200 requests should compare p90: its p99 is its
    slowest one or two requests).
    ``reported``: rows shown side by side with their difference but not
    judged (``ok`` always, ``judged`` False), e.g. ``"requests_per_worker"``
    or ``"ttft_p50_s"``.
    """

    worker_share: float = 0.05
    share_sigmas: float = 2.0
    hit_points: float = 0.04
    ttft_p50: float = 0.25
    ttft_p99: float = 0.35
    ttft_floor_s: float = 0.05
    tail_quantile: float = 99.0
    reported: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class AtLoad:
    """Parity where queues form (issue 31): the fleet, the load and the traces of the at-load runs.

    The same fleet as ``benchmarks/compare_routers.py``'s headline: ``setup``
    (8 engines of 10,000 tokens/s with 150k-token caches, full-size prompts,
    real time, decode 20 ms/token, outputs up to ``setup.max_output_tokens``),
    each trace generated with ``requests`` requests at ``load`` of the
    fleet's prefill capacity (``capacity_tokens_per_s``; ``trace --load``).
    """

    setup: ParitySetup
    load: float = 0.35
    requests: int = 1000
    traces: tuple[str, ...] = ("agentic", "chat", "docqa")
    #: prompts as the trace has them (1: full size)
    prompt_scale: float = 1.0

    @property
    def capacity_tokens_per_s(self) -> float:
        """The fleet's prefill capacity in modelled tokens per second (workers x prefill rate)."""
        return self.setup.num_workers * self.setup.prefill_tokens_per_s


#: the at-load fleet (``sim_live_parity.py --at-load``, ``peer_parity.py --at-load``)
AT_LOAD = AtLoad(setup=ParitySetup(num_workers=8, capacity_tokens=150_000, prefill_tokens_per_s=10_000.0,
                                   decode_s_per_token=0.02, max_output_tokens=4096, time_scale=1.0))
#: simulate against live at that load: TTFT p99 within 20 %, hit within 1 point; p50 and the
#: per-engine request shares reported beside them, not judged
AT_LOAD_TOLERANCES = Tolerances(hit_points=0.01, ttft_p50=0.20, ttft_p99=0.20,
                                reported=("requests_per_worker", "ttft_p50_s"))


def compare(sim: SideResult, live: SideResult, names: Sequence[str],
            tol: Tolerances = Tolerances(), spread: Sequence[SideResult] = ()) -> dict[str, Any]:
    """Rows ``{metric: {simulate, live, diff, tolerance, ok}}``, an overall ``ok``, and what is reported
    beside them, not compared (``live_wall``): requests placed alike, the first placed apart, the
    live client's TTFT and the router-added latency.

    ``spread``: simulated runs of the same slice under the live path's timing noise
    (:func:`simulate_spread`). Each metric's ``diff`` is then live's distance from the
    nearest outcome the simulator produced (``sim`` or one of them; 0 inside their
    range, given as ``range``), not from ``sim`` alone: where a near-tie can fall either
    way, the simulator predicts a range, and one live run is one draw from it.
    """
    runs = [sim, *spread]
    sim_counts, live_counts = sim.per_worker(names), live.per_worker(names)
    n_sim, n_live = sim.placed(), live.placed()
    # The load's shape, not the workers' names: once two runs part at a near-tie, which of two
    # idle engines took a prefix group is a coin flip with no bearing on the result.
    live_shape = live.shape(names)
    share_diff = min(max((abs(a - b) for a, b in zip(r.shape(names), live_shape, strict=True)), default=0.0)
                     for r in runs)
    named_diff = max((abs(sim_counts[w] / n_sim - live_counts[w] / n_live) for w in names), default=0.0)
    p = 1.0 / max(1, len(names))
    share_allowed = max(tol.worker_share, tol.share_sigmas * math.sqrt(2 * p * (1 - p) / n_sim))
    rows: dict[str, Any] = {
        "requests_per_worker": {"simulate": sim_counts, "live": live_counts, "diff": share_diff,
                                "tolerance": share_allowed, "ok": share_diff <= share_allowed,
                                "named_diff": named_diff,
                                "shares": {"simulate": {w: c / n_sim for w, c in sim_counts.items()},
                                           "live": {w: c / n_live for w, c in live_counts.items()}}},
    }

    def row(sim_value: float, values: list[float], live_value: float, allowed: float) -> dict[str, Any]:
        low, high = min(values), max(values)
        diff = max(low - live_value, live_value - high, 0.0)
        out: dict[str, Any] = {"simulate": sim_value, "live": live_value, "diff": diff, "tolerance": allowed,
                               "ok": diff <= allowed}
        if spread:
            out["range"] = [low, high]
        return out

    rows["hit_ratio"] = row(sim.hit_ratio(), [r.hit_ratio() for r in runs], live.hit_ratio(), tol.hit_points)
    for q, rel in ((50.0, tol.ttft_p50), (tol.tail_quantile, tol.ttft_p99)):
        a = sim.ttft(q)
        rows[f"ttft_p{q:g}_s"] = row(a, [r.ttft(q) for r in runs], live.ttft(q), max(rel * a, tol.ttft_floor_s))
    client = [t for t in live.client_ttft_s if t is not None]
    added = [a for a in live.router_added_s if a is not None]
    apart = [i for i, (a, b) in enumerate(zip(sim.workers, live.workers, strict=False)) if a != b]
    info = {"placed_alike": min(len(sim.workers), len(live.workers)) - len(apart),
            "first_apart": apart[0] if apart else None,
            "simulated_runs": len(runs),
            "client_ttft_p50_s": percentile(client, 50) if client else None,
            "client_ttft_p99_s": percentile(client, 99) if client else None,
            "router_added_p50_s": percentile(added, 50) if added else None,
            "router_added_p99_s": percentile(added, 99) if added else None}
    rows["errors"] = {"simulate": sim.errors, "live": live.errors, "diff": live.errors, "tolerance": 0,
                      "ok": live.errors == 0}
    for name, r in rows.items():
        r["judged"] = name not in tol.reported
        if not r["judged"]:
            r["ok"] = True
    return {"rows": rows, "ok": all(r["ok"] for r in rows.values()), "live_wall": info}


def _verdict(row: dict[str, Any]) -> str:
    if not row.get("judged", True):
        return "(reported)"
    return "yes" if row["ok"] else "NO"


def format_comparison(result: dict[str, Any]) -> str:
    """The comparison as aligned text lines."""
    lines = [f"{'metric':<22}{'simulate':>12}{'live':>12}{'diff':>10}{'allowed':>10}  ok"]
    for name, row in result["rows"].items():
        if name == "requests_per_worker":
            lines.append(f"{name:<22}{list(row['simulate'].values())!s:>24}  "
                         f"{list(row['live'].values())!s}")
            lines.append(f"{'  max share diff':<22}{'':>24}{row['diff']:>10.3f}{row['tolerance']:>10.3f}  "
                         f"{_verdict(row)}"
                         + (f"  (by worker name {row['named_diff']:.3f}, not compared)" if "named_diff" in row
                            else ""))
            continue
        fmt = (lambda v: f"{v:>12.3f}") if isinstance(row["simulate"], float) else (lambda v: f"{v:>12}")
        span = row.get("range")
        lines.append(f"{name:<22}{fmt(row['simulate'])}{fmt(row['live'])}{row['diff']:>10.3f}"
                     f"{row['tolerance']:>10.3f}  {_verdict(row)}"
                     + ("" if span is None else f"  (simulated {span[0]:.3f}-{span[1]:.3f})"))
    info = result.get("live_wall") or {}
    if info.get("placed_alike") is not None:
        first = info.get("first_apart")
        lines.append(f"placed alike: {info['placed_alike']} requests"
                     + ("" if first is None else f" (the first placed apart: #{first})")
                     + (f"; simulated runs: {info['simulated_runs']}" if info.get("simulated_runs", 1) > 1 else ""))
    if info.get("client_ttft_p50_s") is not None:
        lines.append(f"live, not compared: client TTFT p50 {info['client_ttft_p50_s']:.3f} s / p99 "
                     f"{info['client_ttft_p99_s']:.3f} s (modelled); router-added p50 "
                     f"{(info['router_added_p50_s'] or 0) * 1000:.1f} ms / p99 "
                     f"{(info['router_added_p99_s'] or 0) * 1000:.1f} ms (wall)")
    return "\n".join(lines)
