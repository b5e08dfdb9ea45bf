"""Run several policies on one request list and collect their results.

Shared by ``simulate`` (fast mode, all policies) and ``demo`` (the baselines
in fast mode beside the live run). Each policy gets a fresh
:class:`Simulator`, so caches start cold for everyone and runs are
independent and deterministic for a seed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

from tokenspeed_router.sim.cluster import ClusterConfig, RunResult, Simulator
from tokenspeed_router.sim.policies import make_backend
from tokenspeed_router.sim.report import policy_metrics
from tokenspeed_router.sim.traces import TokenSynthesizer, TraceRequest

__all__ = ["Interrupted", "ProgressBar", "run_policies", "run_policy", "sweep"]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run_policies`; ``finished`` holds the policies that completed.

    A ``KeyboardInterrupt`` still, so callers that do not care stop as before;
    ``simulate`` catches it to write the finished policies' results.
    """

    def __init__(self, finished: dict[str, RunResult]) -> None:
        super().__init__(f"interrupted after {len(finished)} finished policies")
        self.finished = finished


class ProgressBar:
    """A one-line progress bar on a text stream (stderr), throttled; plain
    periodic lines when the stream is not a terminal.

    ``clock`` is injected so that it can be driven in tests; drawing happens
    at most every ``every_s`` seconds and once at the end.
    """

    def __init__(self, stream: TextIO | None = None, *, width: int = 30, every_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic, tty: bool | None = None,
                 log_every_s: float = 5.0) -> None:
        self._stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self._stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        #: On a terminal the bar redraws in place; in a log file (CI, ``| tee``)
        #: a full line every ``log_every_s`` instead of thousands of ``\r`` frames.
        self._tty = tty
        self._width = width
        self._every_s = every_s if tty else log_every_s
        self._clock = clock
        self._label = ""
        self._start = clock()
        self._last = -1e9

    def start(self, label: str) -> None:
        self._label = label
        self._start = self._clock()
        self._last = -1e9

    def __call__(self, done: int, total: int, note: str = "") -> None:
        now = self._clock()
        if done < total and now - self._last < self._every_s:
            return
        self._last = now
        frac = done / total if total else 1.0
        fill = int(frac * self._width)
        bar = "#" * fill + "-" * (self._width - fill)
        line = f"{self._label:<14}[{bar}] {frac:6.1%} {done}/{total} {now - self._start:6.1f}s"
        if note:
            line += f" {note}"
        if self._tty:
            self._stream.write("\r" + line + ("\n" if done >= total else ""))
        else:
            self._stream.write(line + "\n")
        self._stream.flush()


@dataclass(frozen=True)
class ReplicaOptions:
    """``simulate --replicas N``: N routers split the requests round-robin (``sim/replicas.py``)."""

    count: int = 1
    delay_s: float = 0.002
    """How late one replica's messages reach the others (Redis Pub/Sub's median here)."""
    share: str | None = "all"
    """``all`` (load + route predictions), ``load``, or None (nothing shared)."""


def run_policy(
    policy: str,
    requests: Sequence[TraceRequest],
    cluster: ClusterConfig,
    *,
    router_options: dict[str, Any] | None = None,
    signal_prefill_done: bool = True,
    synthesizer: TokenSynthesizer | None = None,
    progress: Callable[[int, int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    replicas: ReplicaOptions | None = None,
) -> RunResult:
    """One fast-mode run of ``policy`` on fresh workers (``replicas``: N routers splitting it)."""
    sim = Simulator(cluster, synthesizer=synthesizer)
    backend: Any
    if replicas is not None and replicas.count > 1 and policy != "oracle":
        from tokenspeed_router.sim.replicas import ReplicaSet

        backend = ReplicaSet(replicas.count, cluster, sim, share=replicas.share, delay_s=replicas.delay_s,
                             policy=policy, router_options=router_options,
                             signal_prefill_done=signal_prefill_done)
    else:
        backend = make_backend(policy, cluster, sim, router_options=router_options,
                               signal_prefill_done=signal_prefill_done)
    started = clock()
    result = sim.run(requests, backend, progress=progress)
    result.wall_s = clock() - started
    return result


def run_policies(
    policies: Iterable[str],
    requests: Sequence[TraceRequest],
    cluster: ClusterConfig,
    *,
    router_options: dict[str, Any] | None = None,
    signal_prefill_done: bool = True,
    progress: ProgressBar | None = None,
    replicas: ReplicaOptions | None = None,
) -> dict[str, RunResult]:
    """Run each policy in turn; one token synthesizer is shared (it is pure)."""
    synth = TokenSynthesizer(key=cluster.token_key)
    out: dict[str, RunResult] = {}
    for policy in policies:
        if progress is not None:
            progress.start(policy)
        try:
            out[policy] = run_policy(policy, requests, cluster, router_options=router_options,
                                     signal_prefill_done=signal_prefill_done,
                                     synthesizer=synth, progress=progress, replicas=replicas)
        except KeyboardInterrupt:
            raise Interrupted(dict(out)) from None
    return out


def sweep(
    name: str,
    values: Sequence[float],
    requests: Sequence[TraceRequest],
    cluster: ClusterConfig,
    *,
    policy: str = "kv_aware",
    router_options: dict[str, Any] | None = None,
    signal_prefill_done: bool = True,
    progress: ProgressBar | None = None,
) -> list[dict[str, Any]]:
    """Re-run ``policy`` with one cluster field varied (event delay or loss).

    ``name`` is ``event_delay_s`` or ``event_loss_rate``; returns one row of
    headline metrics per value.
    """
    rows: list[dict[str, Any]] = []
    synth = TokenSynthesizer(key=cluster.token_key)
    for value in values:
        if name == "event_delay_s":
            varied = replace(cluster, event_delay_s=value)
        elif name == "event_loss_rate":
            varied = replace(cluster, event_loss_rate=value)
        else:
            raise ValueError(f"cannot sweep {name!r}")
        if progress is not None:
            progress.start(f"{policy}@{value:g}")
        run = run_policy(policy, requests, varied, router_options=router_options,
                         signal_prefill_done=signal_prefill_done, synthesizer=synth,
                         progress=progress)
        m = policy_metrics(run)
        rows.append({name: value, **{k: m[k] for k in (
            "hit_ratio", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s",
            "load_imbalance", "event_batches_lost")}, "prediction_error_tokens":
            m.get("prediction_error_tokens")})
    return rows
