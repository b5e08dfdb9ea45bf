"""What every workload shape is built from: prompts that grow, sessions that interleave.

A prompt is a list of prefix-chained block ids plus its length in tokens, in
the Mooncake sense (an id names a block *and everything before it*). Growing
a prompt keeps its full blocks and mints fresh ids for the rest, including
the partial block it ended on: that block's content changes, so its id does
too, which is what the Mooncake conversation trace does (no request there
repeats another's partial last block). Two prompts extended from one parent
share exactly the parent's full blocks.

A session is a run of requests where each one's prompt extends the last
(chats, agent loops); single-turn shapes are sessions of one request.
:func:`run_sessions` interleaves them on one clock: new sessions start at
the times the shape's arrival process gives, follow-ups wait in a heap until
they are due. Everything random comes from one ``random.Random`` the caller
owns, drawn in a fixed order, so a seed fixes the trace.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.sim.traces import TraceRequest

__all__ = [
    "IdMint",
    "Prompt",
    "Turn",
    "ZipfSampler",
    "lognormal",
    "lognormal_int",
    "lognormal_median_for_mean",
    "param",
    "poisson_clock",
    "Shape",
    "require",
    "run_sessions",
    "single_turns",
    "to_requests",
]


def param(default: Any, doc: str) -> Any:
    """A dataclass field with its documentation (units included) kept at run time.

    ``trace --list --shape NAME`` prints these, and a test checks every
    parameter has one, so the docs cannot fall behind the code.
    """
    return field(default=default, metadata={"doc": doc})


def require(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``ok`` (parameter checks)."""
    if not ok:
        raise ConfigError(message)


class IdMint:
    """Hands out fresh block ids 1, 2, 3, ... (one mint per generated trace)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = 0

    def __call__(self) -> int:
        self.last += 1
        return self.last


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as prefix-chained block ids and its length in tokens."""

    ids: tuple[int, ...] = ()
    length: int = 0

    def extended(self, add: int, block: int, mint: IdMint) -> Prompt:
        """This prompt with ``add`` more tokens: full blocks kept, the rest freshly minted."""
        if add <= 0:
            return self
        ids = list(self.ids)
        if self.length % block and ids:
            ids.pop()  # the straddling block gets new content, hence a new id
        new_length = self.length + add
        while len(ids) * block < new_length:
            ids.append(mint())
        return Prompt(tuple(ids), new_length)


@dataclass(slots=True)
class Turn:
    """One request of a session, and what the session needs to go on.

    ``state`` is the shape's own continuation (turns left, which tenant, ...);
    the engine never reads it.
    """

    arrival_s: float
    prompt: Prompt
    output_tokens: int
    session: int
    state: Any = None


def run_sessions(
    requests: int,
    *,
    next_start: Callable[[], tuple[float, Any]],
    start: Callable[[float, int, Any], Turn],
    follow: Callable[[Turn], Turn | None],
) -> list[Turn]:
    """The first ``requests`` turns at or after time 0, in arrival order.

    ``next_start()`` gives the next session's start time (non-decreasing) and
    a key for ``start``; ``start(t, session, key)`` builds its first turn;
    ``follow(turn)`` the session's next turn after ``turn`` was sent, or
    ``None`` when the session ends. A shape warms up by starting its clock
    before 0: turns before 0 are played (their sessions go on) but not kept,
    as a window cut out of running traffic. The order of the calls is fixed
    (every session due before the next start is released first), which is
    what makes a trace a function of its seed.
    """
    heap: list[tuple[float, int, Turn]] = []
    order = 0
    sessions = 0
    out: list[Turn] = []
    while len(out) < requests:
        t, key = next_start()
        # Release the follow-up turns that are due before the next new session.
        while heap and heap[0][0] <= t and len(out) < requests:
            _, _, turn = heapq.heappop(heap)
            if turn.arrival_s >= 0.0:
                out.append(turn)
            nxt = follow(turn)
            if nxt is not None:
                order += 1
                heapq.heappush(heap, (nxt.arrival_s, order, nxt))
        if len(out) >= requests:
            break
        first = start(t, sessions, key)
        sessions += 1
        order += 1
        heapq.heappush(heap, (first.arrival_s, order, first))
    return out


def single_turns(rng: random.Random, requests: int, rate_per_s: float,
                 start: Callable[[float, int, Any], Turn]) -> list[Turn]:
    """:func:`run_sessions` for shapes whose sessions are one request, arriving as Poisson."""
    return run_sessions(requests, next_start=poisson_clock(rng, rate_per_s), start=start,
                        follow=lambda _turn: None)


def to_requests(turns: Sequence[Turn], block: int, *, prefix: str = "s",
                whole_ms: bool = False) -> list[TraceRequest]:
    """Turns as :class:`TraceRequest` rows sorted by arrival (stable), ids ``{prefix}{i}``.

    ``whole_ms`` rounds arrivals to milliseconds (the Mooncake format's unit)
    and re-bases them so the first is 0: what a written file reads back as.
    """
    ordered = sorted(turns, key=lambda t: t.arrival_s)
    t0 = round(ordered[0].arrival_s * 1000.0) if whole_ms and ordered else 0

    def arrival(t: Turn) -> float:
        return (round(t.arrival_s * 1000.0) - t0) / 1000.0 if whole_ms else t.arrival_s

    return [
        TraceRequest(request_id=f"{prefix}{i}", arrival_s=arrival(t), input_length=t.prompt.length,
                     output_length=t.output_tokens, hash_ids=t.prompt.ids, block_tokens=block)
        for i, t in enumerate(ordered)
    ]


def poisson_clock(rng: random.Random, rate_per_s: float, *, start_s: float = 0.0) -> Callable[[], tuple[float, Any]]:
    """A ``next_start`` for :func:`run_sessions`: Poisson arrivals at ``rate_per_s``."""
    t = [start_s]

    def next_start() -> tuple[float, Any]:
        t[0] += rng.expovariate(rate_per_s)
        return t[0], None

    return next_start


def lognormal_median_for_mean(mean: float, sigma: float) -> float:
    """The median of the lognormal with this ``mean`` and log-space ``sigma``."""
    return mean / math.exp(sigma * sigma / 2.0)


def lognormal(rng: random.Random, median: float, sigma: float) -> float:
    """A lognormal draw with this ``median`` and log-space ``sigma`` (one normal draw)."""
    return rng.lognormvariate(math.log(median), sigma)


def lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A lognormal draw (``median``, log-space ``sigma``), rounded and clipped to [lo, hi]."""
    return int(min(max(round(lognormal(rng, median, sigma)), lo), hi))


class ZipfSampler:
    """Draws ranks 0..n-1 with probability proportional to 1 / (rank + 1) ** s.

    ``s = 0`` is uniform. One ``rng.random()`` per draw (bisect on cumulative
    weights), so the number of draws, not their values, fixes the RNG state.
    """

    __slots__ = ("_cum",)

    def __init__(self, n: int, s: float) -> None:
        require(n >= 1, f"a Zipf sampler needs at least one item, got {n}")
        require(s >= 0, f"a Zipf exponent must be >= 0, got {s}")
        total = 0.0
        cum: list[float] = []
        for k in range(n):
            total += 1.0 / (k + 1) ** s
            cum.append(total)
        self._cum = [c / total for c in cum]

    def top_share(self, fraction: float) -> float:
        """The probability mass of the top ``fraction`` of ranks (at least one rank)."""
        k = max(1, round(fraction * len(self._cum)))
        return self._cum[k - 1]

    def __call__(self, rng: random.Random) -> int:
        return min(bisect.bisect_left(self._cum, rng.random()), len(self._cum) - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """Base of every workload shape; a shape's parameters are its dataclass fields.

    Subclasses set ``NAME`` (the ``trace --shape`` name), ``SUMMARY`` (one
    line), ``SOURCES`` (the published characterizations the defaults come
    from) and ``RATE`` (the field ``trace --rate`` sets), and implement
    :meth:`turns`.
    """

    NAME: ClassVar[str] = ""
    SUMMARY: ClassVar[str] = ""
    SOURCES: ClassVar[tuple[str, ...]] = ()
    RATE: ClassVar[str] = ""

    def turns(self, rng: random.Random, requests: int, block: int) -> list[Turn]:
        """Exactly ``requests`` turns (arrival >= 0) drawn from ``rng``, ids of ``block`` tokens."""
        raise NotImplementedError
