"""What the router believes about each engine: its prefill queue, speed, cache horizon, pending stores.

Cost model v2 (``RouterConfig.cost_model = "v2"``, docs/routing.md) estimates
a request's time to first token on an engine in *seconds*. It needs four
things per engine that the v1 token-unit cost lacked, each kept here:

* **the prefill queue as a clock** (:attr:`EngineBelief.free_at`): prefills
  run one after another; each routed request adds ``overhead + uncached /
  rate`` seconds after the previous one, so the queue ahead of a new request
  is ``free_at - now``: the running prefill's remainder decays with time,
  and every queued prefill pays its overhead. A first token (``done``)
  re-anchors the clock at the real time;
* **a fitted prefill rate and overhead** (:class:`PrefillFit`): from each
  finished prefill's service time (first token minus the later of its
  routing and the previous first token on that engine) against its
  uncached tokens, a robust online regression;
* **the eviction horizon**: an LRU engine of capacity ``C`` tokens evicts a
  block once about ``C`` new tokens were inserted after its last use. The
  router counts the uncached tokens it sends to each engine (the insertion
  clock) and remembers, per prompt block, the clock at its last use there
  (``touches``). A block survives until a new request's prefill starts when
  ``clock_now - touch < C``: every prefill queued ahead is already on the
  clock, so this is the survival *at the start of that prefill*. ``C`` is
  learned from the engine's events (the blocks it held when it first removed
  some) or configured;
* **room in the cache** (:meth:`EngineBelief.admission_wait_s`): the new
  blocks of the requests in flight are pinned until they finish
  (``resident_new``); a prompt whose own new blocks do not fit in the rest
  of the capacity waits for some of them to end, for about the time a
  request stays (``residence_s``, learnt from admissions and releases).
  vLLM and SGLang admit a prefill only when its blocks can be allocated,
  so this wait is real and the queue clock does not see it (issue 31: the
  chat tail was engines whose believed queue was 0 and whose prompts
  waited for memory);
* **bridged predictions**: the prompt of a request in flight is credited to
  its engine from routing until the engine's ``BlockStored`` for it can have
  arrived (the first ``BlockStored`` batch after its first token, or
  ``grace_s`` after it), never longer; a restart or a clear ends them all.

Pure bookkeeping: no clock reads (callers pass ``now``), no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["EngineBelief", "PrefillFit", "rendezvous_pick", "stable_name_key"]

_MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: a stable 64-bit mix (Python's ``hash`` of str is salted per process)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def stable_name_key(name: str) -> int:
    """A worker name as a 64-bit key, equal in every process and replica."""
    h = 0xCBF29CE484222325  # FNV-1a 64
    for b in name.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & _MASK
    return h


def rendezvous_pick(key: int, names: Sequence[str], name_keys: dict[str, int]) -> str:
    """Highest-random-weight choice of ``names`` for ``key``.

    Every replica that sees the same tied set and the same key (a prompt's
    first uncached block) picks the same worker, and a request's siblings
    (same block) follow it, without any shared state.
    """
    best = names[0]
    best_w = -1
    k = key & _MASK
    for n in names:
        nk = name_keys.get(n)
        if nk is None:
            nk = name_keys[n] = stable_name_key(n)
        w = _mix64(k ^ nk)
        if w > best_w or (w == best_w and n < best):
            best, best_w = n, w
    return best


class PrefillFit:
    """``service_s ≈ overhead + tokens / rate``, fitted online, leaving a wrong prior fast.

    A ridge regression over exponentially forgotten sums (``forget`` per
    sample: the fit follows an engine whose speed changes). The configured
    rate and overhead are a prior on each coefficient, not pseudo-samples:

    * the **rate**'s prior is worth ``prior_weight`` samples at first and
      fades by ``prior_fade`` per sample (to 0.1 % of it), so a prior 4x off is
      left within about ten samples of varied length (issue 26: engines
      faster or slower than the router was told must not be routed as if
      they were not; ``tests/unit/test_engine_belief.py`` measures it);
    * the **overhead**'s prior keeps ``overhead_weight`` samples' worth: a
      per-prefill overhead is small and alike across engines, so while every
      sample has the same length (a warm-up of one prompt) the data move the
      rate, not an overhead the samples cannot tell from it.

    Each sample's weight is Huber's against a residual scale learnt from the
    data (1 within 2.5 scales, less beyond, 0 past six: one stalled prefill
    is not a slow engine); the first ``warmup`` samples only learn the scale,
    so a wrong prior cannot make every real sample look like an outlier. The
    estimates are clamped to [rate0 / 20, rate0 * 20] and
    [0, 10 * overhead0 + 0.5 s].
    """

    __slots__ = (
        "_abs_res",
        "_lam_a",
        "_lam_a_floor",
        "_lam_b",
        "_n",
        "_overhead",
        "_overhead0",
        "_prior_fade",
        "_rate",
        "_rate0",
        "_s",
        "_su",
        "_sus",
        "_suu",
        "forget",
        "samples",
    )

    #: samples that only learn the residual scale (every one counts fully)
    WARMUP = 5
    #: tokens of the typical prompt the rate's prior is expressed at
    U_REF = 4096.0

    def __init__(self, rate0: float, overhead0: float, *, forget: float = 0.995, prior_weight: float = 4.0,
                 prior_fade: float = 0.7, overhead_weight: float = 2.0) -> None:
        if not (rate0 > 0 and overhead0 >= 0 and 0 < forget <= 1 and prior_weight > 0
                and 0 < prior_fade <= 1 and overhead_weight > 0):
            raise ValueError("PrefillFit needs rate0 > 0, overhead0 >= 0, forget and prior_fade in (0, 1], "
                             "positive prior weights")
        self._rate0 = self._rate = float(rate0)
        self._overhead0 = self._overhead = float(overhead0)
        self.forget = forget
        self._prior_fade = prior_fade
        # Prior precisions, in samples' worth: a sample at U_REF tokens pins the slope
        # with weight U_REF**2, one at any length pins the intercept with weight 1.
        self._lam_a = prior_weight * self.U_REF * self.U_REF
        self._lam_a_floor = 0.001 * self._lam_a
        self._lam_b = overhead_weight
        self._n = self._su = self._suu = self._s = self._sus = 0.0
        self._abs_res = 0.0
        self.samples = 0

    @property
    def rate(self) -> float:
        """Fitted prefill tokens per second."""
        return self._rate

    @property
    def overhead(self) -> float:
        """Fitted seconds per prefill beyond its tokens."""
        return self._overhead

    def predict(self, tokens: float) -> float:
        return self._overhead + max(tokens, 0.0) / self._rate

    def observe(self, tokens: float, service_s: float) -> None:
        """Fold one finished prefill in (ignored when not finite or negative)."""
        if not (math.isfinite(tokens) and math.isfinite(service_s)) or tokens < 0 or service_s < 0:
            return
        residual = abs(service_s - self.predict(tokens))
        scale = self._abs_res
        weight = 1.0
        if self.samples >= self.WARMUP and residual > 2.5 * scale:
            weight = 2.5 * scale / residual if residual <= 6.0 * scale else 0.0
        if self.samples < self.WARMUP:
            self._abs_res = max(self._abs_res, 0.0) + (residual - self._abs_res) / (self.samples + 1)
        else:
            self._abs_res = 0.95 * scale + 0.05 * min(residual, 3.0 * scale)
        f = self.forget
        self._n = f * self._n + weight
        self._su = f * self._su + weight * tokens
        self._suu = f * self._suu + weight * tokens * tokens
        self._s = f * self._s + weight * service_s
        self._sus = f * self._sus + weight * tokens * service_s
        self._lam_a = max(self._lam_a * self._prior_fade, self._lam_a_floor)
        self.samples += 1
        self._solve()

    def _solve(self) -> None:
        """Ridge solution of [[n + λb, Σu], [Σu, Σu² + λa]] (b, a) = (Σs + λb·b0, Σus + λa·a0)."""
        a0, b0 = 1.0 / self._rate0, self._overhead0
        m11 = self._n + self._lam_b
        m12 = self._su
        m22 = self._suu + self._lam_a
        r1 = self._s + self._lam_b * b0
        r2 = self._sus + self._lam_a * a0
        det = m11 * m22 - m12 * m12
        if det <= 0:
            return
        b = (r1 * m22 - m12 * r2) / det
        a = (m11 * r2 - m12 * r1) / det
        a = min(max(a, a0 / 20), a0 * 20)
        self._rate = 1.0 / a
        self._overhead = min(max(b, 0.0), 10 * self._overhead0 + 0.5)


@dataclass(slots=True)
class _Pending:
    uncached: int
    service_s: float
    routed_at: float


@dataclass(slots=True)
class _Resident:
    new_tokens: int
    admitted_at: float


@dataclass(slots=True)
class _Prediction:
    hashes: list[int]
    deadline: float
    done: bool = False


@dataclass(slots=True)
class EngineBelief:
    """One engine as cost model v2 sees it (see the module docstring)."""

    own_fit: PrefillFit
    #: the fleet's fit (every engine's samples): used until this engine has its own
    shared_fit: PrefillFit | None = None
    capacity_tokens: float = math.inf
    #: capacity was configured: events never change it
    capacity_fixed: bool = False
    pending: dict[str, _Pending] = field(default_factory=dict)
    pending_uncached: int = 0
    free_at: float = -math.inf
    last_done_at: float = -math.inf
    clock: int = 0
    touches: OrderedDict[int, int] = field(default_factory=OrderedDict)
    predicted: dict[int, int] = field(default_factory=dict)
    predictions: dict[str, _Prediction] = field(default_factory=dict)
    next_deadline: float = math.inf
    #: (deadline, request id) of every prediction deadline set (a heap; entries whose
    #: prediction ended or moved are skipped when they come up): expiring costs what expires,
    #: not a walk over every request in flight on each decision
    deadlines: list[tuple[float, str]] = field(default_factory=list)
    #: predictions whose first token came (they end at the next BlockStored batch)
    done_predictions: set[str] = field(default_factory=set)
    #: requests in flight here, admission to release: the new blocks each pins
    residents: dict[str, _Resident] = field(default_factory=dict)
    resident_new: int = 0
    #: how long a request stays, admission to release (an EWMA; 0 until one is seen)
    residence_s: float = 0.0
    residence_samples: int = 0

    #: samples an engine needs before its own fit replaces the fleet's
    OWN_FIT_SAMPLES = 8
    #: the weight of a new residence sample (about the last 20 requests)
    RESIDENCE_GAIN = 0.05

    @property
    def fit(self) -> PrefillFit:
        """This engine's fit once it has a few samples, else the fleet's (an engine never
        measured is as fast as the others, not as fast as the prior)."""
        own = self.own_fit
        shared = self.shared_fit
        if shared is None or own.samples >= self.OWN_FIT_SAMPLES:
            return own
        return shared

    # --- queue clock -----------------------------------------------------------
    def queue_s(self, now: float) -> float:
        """Seconds of prefill queued ahead of a request routed now."""
        q = self.free_at - now
        return q if q > 0.0 else 0.0

    def admit(self, request_id: str, uncached: int, now: float) -> None:
        service = self.fit.predict(uncached)
        self.pending[request_id] = _Pending(uncached, service, now)
        self.pending_uncached += uncached
        old = self.residents.pop(request_id, None)
        if old is not None:
            self.resident_new -= old.new_tokens
        self.residents[request_id] = _Resident(uncached, now)
        self.resident_new += uncached
        start = max(self.free_at, now, self.last_done_at)
        self.free_at = start + service
        self.clock += uncached

    def done(self, request_id: str, now: float, uncached: int | None = None, *, fit: bool = True) -> None:
        """First token of ``request_id``: its prefill is over; fit its service time."""
        p = self.pending.get(request_id)
        if p is None:
            return
        head = next(iter(self.pending)) == request_id
        if head and fit:  # nothing routed earlier still prefilling: a clean service-time sample
            start = max(p.routed_at, self.last_done_at)
            tokens = p.uncached if uncached is None else uncached
            self.own_fit.observe(tokens, now - start)
            if self.shared_fit is not None:
                self.shared_fit.observe(tokens, now - start)
        self._remove(request_id, p)
        self.last_done_at = max(self.last_done_at, now)
        self._reclock()

    def release(self, request_id: str, now: float) -> None:
        """``request_id`` ended: its prefill (if still queued), its pinned blocks and its prediction go."""
        p = self.pending.get(request_id)
        if p is not None:
            self._remove(request_id, p)
            self._reclock()
        r = self.residents.pop(request_id, None)
        if r is not None:
            self.resident_new -= r.new_tokens
            stay = now - r.admitted_at
            if math.isfinite(stay) and stay >= 0:
                self.residence_samples += 1
                gain = max(self.RESIDENCE_GAIN, 1.0 / self.residence_samples)
                self.residence_s += gain * (stay - self.residence_s)
        self.end_prediction(request_id)

    def admission_wait_s(self, uncached: float, credited: float) -> float:
        """Seconds a prompt with ``uncached`` new tokens waits for cache room (module docstring).

        The room is the capacity less the new blocks requests in flight pin
        and the prompt's own cached prefix (in use too); what does not fit
        waits for that fraction of the pinned blocks to be released, at
        ``residence_s`` for all of them. 0 while the capacity is unknown.
        """
        cap = self.capacity_tokens
        pinned = self.resident_new
        if cap == math.inf or pinned <= 0 or self.residence_s <= 0.0:
            return 0.0
        deficit = uncached - (cap - pinned - credited)
        if deficit <= 0:
            return 0.0
        return self.residence_s * min(1.0, deficit / pinned)

    def _remove(self, request_id: str, p: _Pending) -> None:
        del self.pending[request_id]
        self.pending_uncached -= p.uncached

    def _reclock(self) -> None:
        """Rebuild the clock from the last first token, with the current fit."""
        t = self.last_done_at
        predict = self.fit.predict
        for p in self.pending.values():
            t = max(t, p.routed_at) + predict(p.uncached)
        self.free_at = t

    # --- eviction horizon ------------------------------------------------------
    def touch(self, hashes: Sequence[int]) -> None:
        """The prompt's blocks are used at the clock reached after its own insertion."""
        if not hashes:
            return
        clock = self.clock
        touches = self.touches
        move = touches.move_to_end
        for h in reversed(hashes):  # leaf first, root last: parents stay newer (prefix-closed)
            touches[h] = clock
            move(h)
        horizon = self.capacity_tokens
        if horizon < math.inf:  # forget what is certainly evicted already
            oldest = clock - 2 * horizon
            while touches:
                h, t = next(iter(touches.items()))
                if t >= oldest:
                    break
                del touches[h]
        elif len(touches) > 1_000_000:
            for _ in range(len(touches) - 1_000_000):
                touches.popitem(last=False)

    def surviving_blocks(self, hashes: Sequence[int], band: float) -> tuple[int, int] | None:
        """Leading prompt blocks sure (first) and likely (second) to survive to a new prefill's start.

        None when the horizon is unknown or the first block was never used
        here (then nothing is known against the index). Blocks are sure when
        their age is below ``(1 - band) * C``, likely below ``C``; blocks this
        router never sent here end the known run and are not trimmed.
        """
        cap = self.capacity_tokens
        touches = self.touches
        if cap == math.inf or not hashes or hashes[0] not in touches:
            return None
        clock = self.clock
        sure = self._deepest(hashes, clock - (1.0 - band) * cap)
        likely = self._deepest(hashes, clock - cap)
        known = self._deepest(hashes, -math.inf)
        if sure >= known:
            return None  # every known block surely survives: nothing to trim
        return sure, likely

    def _deepest(self, hashes: Sequence[int], oldest_ok: float) -> int:
        """Leading blocks touched here no earlier than ``oldest_ok`` (ages grow with depth)."""
        touches = self.touches
        get = touches.get
        t0 = get(hashes[0])
        if t0 is None or t0 < oldest_ok:
            return 0
        lo, hi = 1, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            t = get(hashes[mid - 1])
            if t is not None and t >= oldest_ok:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def saw_removal(self, held_tokens: int, removed_tokens: int) -> None:
        """The engine evicted: it was full at ``held + removed`` tokens (a lower bound on C)."""
        if self.capacity_fixed or removed_tokens <= 0:
            return
        full = float(held_tokens + removed_tokens)
        if self.capacity_tokens == math.inf or full > self.capacity_tokens:
            self.capacity_tokens = full

    # --- bridged predictions ----------------------------------------------------
    def predict(self, request_id: str, hashes: list[int], deadline: float) -> None:
        """Credit ``hashes`` here until the request's BlockStored can have arrived."""
        self.end_prediction(request_id)
        counts = self.predicted
        for h in hashes:
            counts[h] = counts.get(h, 0) + 1
        self.predictions[request_id] = _Prediction(hashes, deadline)
        self._deadline(request_id, deadline)

    def _deadline(self, request_id: str, deadline: float) -> None:
        heap = self.deadlines
        if len(heap) > 2 * len(self.predictions) + 1024:  # mostly entries of ended predictions: rebuild
            heap[:] = [(p.deadline, rid) for rid, p in self.predictions.items()]
            heapq.heapify(heap)
        heapq.heappush(heap, (deadline, request_id))
        if deadline < self.next_deadline:
            self.next_deadline = deadline

    def end_prediction(self, request_id: str) -> None:
        pred = self.predictions.pop(request_id, None)
        if pred is None:
            return
        if pred.done:
            self.done_predictions.discard(request_id)
        counts = self.predicted
        for h in pred.hashes:
            c = counts[h] - 1
            if c:
                counts[h] = c
            else:
                del counts[h]

    def prediction_done(self, request_id: str, deadline: float) -> None:
        """First token seen: end at the next BlockStored batch, or at ``deadline``."""
        pred = self.predictions.get(request_id)
        if pred is not None:
            pred.done = True
            self.done_predictions.add(request_id)
            if deadline < pred.deadline:
                pred.deadline = deadline
                self._deadline(request_id, deadline)

    def stored(self) -> None:
        """A BlockStored batch arrived: predictions whose prefill is over are now in the index."""
        if self.done_predictions:
            for rid in list(self.done_predictions):
                self.end_prediction(rid)

    def expire_predictions(self, now: float) -> None:
        if now < self.next_deadline:
            return
        heap, predictions = self.deadlines, self.predictions
        while heap and heap[0][0] <= now:
            _, rid = heapq.heappop(heap)
            p = predictions.get(rid)
            if p is not None and p.deadline <= now:  # else ended, or a later deadline of a new one
                self.end_prediction(rid)
        self.next_deadline = heap[0][0] if heap else math.inf

    def predicted_blocks(self, hashes: Sequence[int]) -> int:
        """Leading prompt blocks covered by predictions in flight (their union is prefix-closed)."""
        counts = self.predicted
        if not counts or not hashes or hashes[0] not in counts:
            return 0
        lo, hi = 1, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in counts:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def cleared(self) -> None:
        """The engine restarted or was cleared: it holds nothing, nothing is pending a store."""
        for rid in list(self.predictions):
            self.end_prediction(rid)
        self.touches.clear()
