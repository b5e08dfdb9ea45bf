"""The truth loop: does the engine reuse what the index says it holds?

After each answer the engine reports ``usage.prompt_tokens_details.cached_tokens``
(the prefix it really reused). The gateway compares it with what the index
predicted for that worker when the request was routed. Per worker, over the
last ``window`` *informative* requests (predicted or reported above zero),
a request *disagrees* when

* the engine reused far less than predicted: ``predicted - reported > max(bs, predicted/2)``
  (the index holds blocks the engine does not: lost ``BlockRemoved`` events,
  a hash seed or tokenizer that differs between the events and the cache), or
* far more than even the index *after* the answer can explain:
  ``reported - max(predicted, predicted_after) > max(bs, reported/2)``. The
  second look (``predicted_after``, taken when the usage arrives) forgives the
  ordinary race where a sibling request's blocks were stored between routing
  and prefill; what is left is the engine reusing prefixes the index never
  matches (tokenizer or chat-template mismatch, lost ``BlockStored`` events).

A worker is flagged ``misaligned`` when at least half of a full-enough window
(``window // 2`` samples) disagrees, or when its reported reuse comes in
multiples of a block size that is not the one its events declare; it is
cleared when at most a quarter disagrees again (hysteresis, so it does not
flap). Predictions are capped at ``(prompt_tokens - 1) // bs * bs``: engines
always recompute the last prompt token, so a fully cached prompt reports one
block less. Each worker's state is owned by the event loop (no lock).

Trust is gradual (``on_trust``): the router's credit for a worker's prefix is
scaled by ``trust = 1 - (f - 0.25) / (0.75 - 0.25)`` clamped to [0, 1], with
``f`` the disagreeing fraction of the window (1 up to a quarter disagreeing,
0 from three quarters, 0 too for block-size evidence). Only at 0 is the worker
routed on load alone (``on_change(worker, True)``). The ``misaligned`` flag,
its log line and metrics keep their own hysteresis: they tell the operator,
trust tells the router. A healthy engine under memory pressure reuses a
little less than the index said (blocks evicted while the request queued):
that lowers its trust a little instead of cutting it off.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["TruthCollector", "TruthLoop", "TruthSample", "WorkerTruth", "cap_prediction", "trust_of"]

logger = logging.getLogger(__name__)

FLAG_FRACTION = 0.5
CLEAR_FRACTION = 0.25
#: disagreeing fraction at which trust reaches 0 (routed on load only)
TRUST_ZERO_FRACTION = 0.75


def trust_of(disagreeing: int, window: int) -> float:
    """Trust in a worker's prefix for ``disagreeing`` of ``window`` recent requests (see the module doc)."""
    if window <= 0:
        return 1.0
    f = disagreeing / window
    return min(max(1.0 - (f - CLEAR_FRACTION) / (TRUST_ZERO_FRACTION - CLEAR_FRACTION), 0.0), 1.0)
#: reported values needed before their common divisor counts as block-size evidence
_MIN_BLOCK_EVIDENCE = 4


def cap_prediction(matched_tokens: int, prompt_tokens: int, block_size: int) -> int:
    """What an engine can report at most for ``matched_tokens``: it recomputes the last token."""
    if block_size <= 0 or prompt_tokens <= 0:
        return 0
    return min(matched_tokens, (prompt_tokens - 1) // block_size * block_size)


@dataclass(frozen=True, slots=True)
class TruthSample:
    """One answered request: predicted (at routing, after the answer) vs reported cached tokens."""

    predicted: int
    reported: int
    block_size: int
    predicted_after: int = 0

    def too_low(self) -> bool:
        return self.predicted - self.reported > max(self.block_size, self.predicted / 2)

    def too_high(self) -> bool:
        explained = max(self.predicted, self.predicted_after)
        return self.reported - explained > max(self.block_size, self.reported / 2)


@dataclass
class WorkerTruth:
    """One worker's record; ``misaligned`` and ``cause`` are what ``/workers`` shows."""

    window: deque[TruthSample]
    predicted_total: int = 0
    reported_total: int = 0
    requests: int = 0
    unreported: int = 0  # answers without cached_tokens (engine flag missing)
    misaligned: bool = False
    cause: str | None = None
    flips: int = 0
    trust: float = 1.0

    def disagreeing(self) -> tuple[int, int]:
        return sum(1 for s in self.window if s.too_low() or s.too_high()), len(self.window)

    def block_size_evidence(self) -> int | None:
        """The engine's apparent block size when it differs from the events' one."""
        reported = [s.reported for s in self.window if s.reported > 0]
        if len(reported) < _MIN_BLOCK_EVIDENCE:
            return None
        bs = self.window[-1].block_size
        g = math.gcd(*reported)
        if bs <= 0 or g == bs:
            return None
        mismatched = sum(1 for s in self.window if s.reported != s.predicted)
        if mismatched * 2 < len(self.window):
            return None
        if g % bs != 0:
            return g  # reuse in units the events never use
        # A coarser engine block (a power-of-two multiple, as block sizes are) needs more
        # evidence: several distinct reported sizes, and predictions it could never report.
        ratio = g // bs
        if ratio & (ratio - 1) or len(set(reported)) < 3:
            return None
        # The signature of a coarser engine block is rounding: the engine reports
        # the index's prediction rounded down to g. Reports that are merely all
        # multiples of g are no evidence: a workload that shares prefixes in coarse
        # units (a Mooncake trace replay shares 512-token blocks) produces them with
        # matching block sizes, and under memory pressure evictions and races make
        # reports differ from predictions without any rounding.
        coarse = [s for s in self.window if s.predicted > 0 and s.predicted % g]
        rounded = sum(1 for s in coarse if s.reported == s.predicted // g * g)
        if coarse and rounded * 2 > len(coarse):
            return g
        return None

    def diagnose(self) -> str:
        """The likely cause, from the evidence in the window."""
        bs = self.window[-1].block_size if self.window else 0
        g = self.block_size_evidence()
        if g is not None:
            return (f"block size: the engine reports reuse in multiples of {g} tokens but its "
                    f"events declare block_size {bs}")
        low = sum(1 for s in self.window if s.too_low())
        high = sum(1 for s in self.window if s.too_high())
        p = sum(s.predicted for s in self.window)
        r = sum(s.reported for s in self.window)
        if high >= low:
            if p <= r / 10:
                return ("tokenizer or chat-template mismatch: the engine reuses prefixes the index "
                        "never matches (the router hashes other token ids than the engine caches), "
                        "or its BlockStored events are not arriving")
            return "lost events: the engine holds more than its BlockStored events said"
        if r <= p / 10:
            return ("the engine reuses none of the predicted prefix: hash seed or tokenizer differs "
                    "between its events and its cache, or prefix caching is off")
        return ("lost BlockRemoved events or unpublished evictions: the index holds blocks the "
                "engine no longer has")


class TruthLoop:
    """Per-worker predicted vs reported cached tokens; flags misaligned workers.

    Without ``on_trust``, ``on_change(worker, misaligned)`` is called when the
    flag flips (the gateway then routes the worker on load only, or trusts it
    again). With ``on_trust(worker, trust)``, trust is gradual (module doc):
    ``on_trust`` gets each change of at least 0.05 (and every reach of 0 or 1),
    and ``on_change`` is called only when trust reaches 0 or leaves it.
    """

    def __init__(self, window: int, on_change: Callable[[str, bool], None],
                 *, on_trust: Callable[[str, float], None] | None = None) -> None:
        self._size = window
        self._min = max(window // 2, 2)
        self._on_change = on_change
        self._on_trust = on_trust
        self._workers: dict[str, WorkerTruth] = {}

    def _get(self, worker: str) -> WorkerTruth:
        wt = self._workers.get(worker)
        if wt is None:
            wt = self._workers[worker] = WorkerTruth(deque(maxlen=self._size))
        return wt

    def observe_unreported(self, worker: str) -> None:
        """An answer whose usage had no ``cached_tokens`` (the engine does not report it)."""
        wt = self._get(worker)
        wt.requests += 1
        wt.unreported += 1

    def observe(self, worker: str, sample: TruthSample) -> None:
        wt = self._get(worker)
        wt.requests += 1
        wt.predicted_total += sample.predicted
        wt.reported_total += sample.reported
        if sample.predicted <= 0 and sample.reported <= 0:
            return  # both cold: no evidence either way
        wt.window.append(sample)
        bad, n = wt.disagreeing()
        if n < self._min:
            return
        evidence = wt.block_size_evidence()
        if self._on_trust is not None:
            self._update_trust(worker, wt, 0.0 if evidence is not None else trust_of(bad, n))
        if not wt.misaligned:
            if bad >= FLAG_FRACTION * n or evidence is not None:
                wt.misaligned = True
                wt.cause = wt.diagnose()
                wt.flips += 1
                logger.warning(
                    "worker %s misaligned: engine reported %d cached tokens where the index predicted %d "
                    "over its last %d requests (%d disagree); likely cause: %s; routing it on load only",
                    worker, sum(s.reported for s in wt.window), sum(s.predicted for s in wt.window),
                    n, bad, wt.cause,
                )
                if self._on_trust is None:
                    self._on_change(worker, True)
        elif bad <= CLEAR_FRACTION * n and evidence is None:
            wt.misaligned = False
            wt.flips += 1
            logger.warning("worker %s aligned again (%d of %d recent requests disagree): trusting its prefix",
                           worker, bad, n)
            wt.cause = None
            if self._on_trust is None:
                self._on_change(worker, False)

    def _update_trust(self, worker: str, wt: WorkerTruth, trust: float) -> None:
        old = wt.trust
        if trust == old or (abs(trust - old) < 0.05 and trust not in (0.0, 1.0)):
            return
        wt.trust = trust
        assert self._on_trust is not None
        self._on_trust(worker, trust)
        if (trust == 0.0) != (old == 0.0):
            self._on_change(worker, trust == 0.0)

    def forget(self, worker: str) -> None:
        self._workers.pop(worker, None)

    def status(self, worker: str) -> dict[str, Any]:
        """The ``truth`` entry of ``GET /workers`` for ``worker``."""
        wt = self._workers.get(worker)
        if wt is None:
            return {"misaligned": False, "cause": None, "requests": 0, "window": 0,
                    "predicted_cached_tokens": 0, "reported_cached_tokens": 0, "reports_cached_tokens": None}
        bad, n = wt.disagreeing()
        return {
            "misaligned": wt.misaligned,
            "cause": wt.cause,
            "trust": wt.trust,
            "requests": wt.requests,
            "window": n,
            "window_disagreeing": bad,
            "predicted_cached_tokens": wt.predicted_total,
            "reported_cached_tokens": wt.reported_total,
            "reports_cached_tokens": wt.requests > wt.unreported if wt.requests else None,
        }

    def misaligned(self) -> dict[str, str]:
        return {w: wt.cause or "" for w, wt in self._workers.items() if wt.misaligned}

    def items(self) -> Iterator[tuple[str, WorkerTruth]]:
        return iter(list(self._workers.items()))


class TruthCollector(Collector):
    """Exports the truth loop at scrape time (``tokenspeed_gateway_*``)."""

    def __init__(self, truth: TruthLoop) -> None:
        self._truth = truth

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        predicted = CounterMetricFamily(
            "tokenspeed_gateway_predicted_cached_tokens",
            "prompt tokens the index predicted the chosen worker to hold (capped as the engine reports)",
            labels=["worker"])
        reported = CounterMetricFamily(
            "tokenspeed_gateway_reported_cached_tokens",
            "prompt tokens the engine reported as reused (usage.prompt_tokens_details.cached_tokens)",
            labels=["worker"])
        misaligned = GaugeMetricFamily(
            "tokenspeed_gateway_worker_misaligned",
            "1 while the engine's reported reuse disagrees with the index (routed on load only)",
            labels=["worker"])
        ratio = GaugeMetricFamily(
            "tokenspeed_gateway_truth_disagreement_ratio",
            "fraction of the worker's recent informative requests whose reported reuse disagrees",
            labels=["worker"])
        for name, wt in self._truth.items():
            predicted.add_metric([name], float(wt.predicted_total))
            reported.add_metric([name], float(wt.reported_total))
            misaligned.add_metric([name], 1.0 if wt.misaligned else 0.0)
            bad, n = wt.disagreeing()
            ratio.add_metric([name], bad / n if n else 0.0)
        yield from (predicted, reported, misaligned, ratio)
