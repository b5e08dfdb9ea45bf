"""The engine's scheduler, without a clock: what ``simulate`` and ``engine-sim`` both run.

One :class:`EngineCore` per engine owns its waiting queue, its running
requests and their prefix-cache life cycle; the :mod:`~tokenspeed_router.timing`
model says how long each piece of work takes. It never reads a clock and
never sleeps: a *driver* tells it the time. ``engine-sim`` drives it in real
time (asyncio timers, ``engine_sim/engine.py``); ``simulate`` drives it on a
virtual clock (``sim/cluster.py``). Because both run this one code, a trace
replayed through ``simulate`` and through engine-sims behind a router gives
the same per-request prefill, hit and first-token times for the same
routing; what differs is only what the router in between does.

The driver's contract: :meth:`EngineCore.submit` a request at time ``t``;
ask :meth:`EngineCore.next_event_s` when something is due next (``None``:
idle until the next submit); at that time call :meth:`EngineCore.advance`.
The listener hears every token, prefill completion and end as it happens.

The cache life cycle is an engine's (``PrefixCache``'s engine API):

1. Admission, FIFO, while fewer than ``max_num_seqs`` run (and, in the
   ``fifo`` profile, only when no other prefill runs): ``begin_request``
   matches and *locks* the longest cached prefix and allocates pages for the
   rest, evicting unlocked leaves if needed. If its pages cannot be found
   while others run, the head of the queue waits; alone, it runs with only
   what fits cached. ``cached_tokens`` is the hit capped at
   ``(prompt_len - 1) // block_size * block_size``, as vLLM reports it: the
   last prompt token is always computed.
2. When a prompt's prefill completes its full blocks are cached
   (``cache_unfinished_req``, which emits ``BlockStored``; the request keeps
   its lock) and its first token is emitted.
3. With ``max_tokens`` tokens it is finished (``cache_finished_req``
   releases the lock). Only prompt tokens are cached, not generated ones.

So the blocks of a request are pinned from admission to its last token: a
decoding request's prefix cannot be evicted under it. P/D: a
``prefill_only`` request ends after its first token; a ``remote_prefill``
one counts its prompt as transferred (nothing to prefill) and decodes.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from tokenspeed_router.errors import OutOfPagesError
from tokenspeed_router.timing import TimingModel

__all__ = ["EngineCore", "EngineListener", "ModelRequest", "reported_hit"]

#: times within this of each other are "now" (float sums of durations drift)
_EPS = 1e-9


def reported_hit(hit_tokens: int, prompt_len: int, block_size: int) -> int:
    """The prefix reuse an engine reports for ``hit_tokens`` matched: it recomputes the last token."""
    return min(hit_tokens, max(0, (prompt_len - 1) // block_size * block_size))


@dataclasses.dataclass(eq=False)
class ModelRequest:
    """One request's scheduling state; owned by its :class:`EngineCore` once submitted."""

    request_id: str
    prompt: Sequence[int] | Any  # token ids (a list, or a numpy array in the simulator)
    max_tokens: int
    prefill_only: bool = False
    remote_prefill: bool = False
    #: the driver's own handle (the simulator's request index)
    tag: int = -1
    #: uncached tokens the driver expects (read-only probe at submit); queue estimates use it
    estimate_uncached: int = -1
    # Filled by the core (times in the driver's modelled seconds):
    arrival_s: float = 0.0
    admitted_s: float | None = None
    first_token_s: float | None = None
    cached_tokens: int = 0
    num_computed: int = 0
    num_output: int = 0
    prefilled: bool = False
    finished: bool = False
    aborted: bool = False
    block_ids: list[int] = dataclasses.field(default_factory=list)
    req: Any = None
    cache: Any = None


class EngineListener(Protocol):
    """What a driver hears from its core (all on the driver's thread, at modelled time ``t``)."""

    def tokens(self, r: ModelRequest, count: int, t: float) -> None:
        """``count`` more tokens of ``r`` came out (the first one is its first token)."""

    def prefill_done(self, r: ModelRequest, t: float) -> None:
        """``r``'s prompt is computed and cached (before its first token)."""

    def done(self, r: ModelRequest, reason: str, t: float) -> None:
        """``r`` ended: ``"length"`` or ``"abort"``."""


class EngineCore:
    """One engine's scheduler over ``cache`` (see the module docstring).

    ``token_events`` False (the simulator) folds every decode token after the
    first into one event at the request's end: the same times, far fewer
    events. ``cache`` is public: a driver swaps it to model a restart
    (requests already running finish against their own cache).
    """

    def __init__(self, timing: TimingModel, cache: Any, listener: EngineListener, *,
                 block_size: int, max_num_seqs: int, token_events: bool = True) -> None:
        self.timing = timing
        self.cache = cache
        self.listener = listener
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.token_events = token_events
        self.fifo = timing.profile == "fifo"
        self.waiting: deque[ModelRequest] = deque()
        self.running: list[ModelRequest] = []
        self.now = 0.0
        # fifo: the one prefill in flight, and every decoding request's next event
        self._prefilling: ModelRequest | None = None
        self._prefill_end = 0.0
        self._lane_free_s = 0.0
        self._decode: list[tuple[float, int, ModelRequest]] = []
        self._order = itertools.count()
        # chunked: the step in flight
        self._step_end: float | None = None
        self._step_chunks: list[tuple[ModelRequest, int]] = []
        self._step_decoding: list[ModelRequest] = []
        #: the head of the queue waits for pages held by running requests
        self._blocked = False
        # statistics
        self.num_submitted = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.computed_prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        self.busy_s = 0.0  # modelled prefill service time given

    # ------------------------------------------------------------------ the driver's side

    def submit(self, r: ModelRequest, t: float) -> None:
        """Queue ``r`` (FIFO), arrived at ``t``."""
        self.now = max(self.now, t)
        r.arrival_s = t
        if r.estimate_uncached < 0:
            r.estimate_uncached = len(r.prompt)
        self.num_submitted += 1
        self.waiting.append(r)

    def abort(self, r: ModelRequest) -> None:
        """The client went away: ``r`` is freed at the next step boundary or decode event."""
        if not r.finished:
            r.aborted = True

    def next_event_s(self) -> float | None:
        """Modelled time of the next thing due (``<= now``: at once), or None when idle."""
        if self.fifo:
            due: float | None = None
            if self._prefilling is not None:
                due = self._prefill_end
            if self._decode:
                due = self._decode[0][0] if due is None else min(due, self._decode[0][0])
            if self._prefilling is None and self._can_admit():
                due = self.now if due is None else min(due, self.now)
            return due
        if self._step_end is not None:
            return self._step_end
        return self.now if (self.waiting or self.running) else None

    def advance(self, t: float) -> None:
        """Do everything due at or before ``t``."""
        self.now = max(self.now, t)
        if self.fifo:
            self._advance_fifo(self.now)
        else:
            self._advance_chunked(self.now)

    def backlog_s(self, t: float) -> float:
        """Modelled seconds of prefill queued ahead of a request arriving at ``t`` (an estimate)."""
        timing = self.timing
        if self.fifo:
            ahead = max(0.0, self._prefill_end - t) if self._prefilling is not None else 0.0
            return ahead + sum(timing.prefill_s(r.estimate_uncached) for r in self.waiting)
        tokens = sum(len(r.prompt) - r.num_computed for r in self.running if not r.prefilled)
        tokens += sum(r.estimate_uncached for r in self.waiting)
        return tokens / timing.prefill_tokens_per_s

    # ------------------------------------------------------------------ fifo

    def _can_admit(self) -> bool:
        return bool(self.waiting) and not self._blocked and len(self.running) < self.max_num_seqs

    def _advance_fifo(self, now: float) -> None:
        while True:
            lane = self._prefill_end if self._prefilling is not None else None
            head = self._decode[0][0] if self._decode else None
            # the earliest due completion first: a prefill end, or a decode event
            if lane is not None and lane <= now + _EPS and (head is None or lane <= head):
                self._fifo_prefill_end()
            elif head is not None and head <= now + _EPS:
                self._fifo_decode_event()
            elif self._prefilling is None and self._can_admit():
                self._fifo_start(now)
            else:
                return

    def _fifo_start(self, now: float) -> None:
        start = max(self._lane_free_s, self.waiting[0].arrival_s)
        r = self._admit_head(start)
        if r is None or r.finished:
            return
        if r.remote_prefill:
            self._push_decode(r, start)
            return
        duration = self.timing.prefill_s(len(r.prompt) - r.num_computed)
        self.busy_s += duration
        self._prefilling = r
        self._prefill_end = start + duration

    def _fifo_prefill_end(self) -> None:
        r, t = self._prefilling, self._prefill_end
        assert r is not None
        self._prefilling = None
        self._lane_free_s = t
        self.computed_prompt_tokens += len(r.prompt) - r.num_computed
        r.num_computed = len(r.prompt)
        self._prefill_done(r, t)
        self._emit(r, 1, t)
        if r.aborted or r.prefill_only or r.num_output >= r.max_tokens:
            self._finish(r, "abort" if r.aborted else "length", t)
        else:
            self._push_decode(r, t)

    def _push_decode(self, r: ModelRequest, t: float) -> None:
        remaining = r.max_tokens - r.num_output
        step = self.timing.decode_token_s()
        due = t + (step if self.token_events or r.num_output == 0 else remaining * step)
        heapq.heappush(self._decode, (due, next(self._order), r))

    def _fifo_decode_event(self) -> None:
        t, _, r = heapq.heappop(self._decode)
        if r.finished:
            return
        if r.aborted:
            self._finish(r, "abort", t)
            return
        if self.token_events or r.num_output == 0:
            self._emit(r, 1, t)
        else:
            self._emit(r, r.max_tokens - r.num_output, t)
        if r.num_output >= r.max_tokens:
            self._finish(r, "length", t)
        else:
            self._push_decode(r, t)

    # ------------------------------------------------------------------ chunked

    def _advance_chunked(self, now: float) -> None:
        start = now
        if self._step_end is not None:
            if self._step_end > now + _EPS:
                return
            start = self._step_end
            self._complete_step(start)
        if self.waiting or self.running:
            self._start_step(start)

    def _start_step(self, t: float) -> None:
        self._reap_aborted(t)
        while self._can_admit():
            r = self._admit_head(t)
            if r is None:
                break
        decoding = [r for r in self.running if r.prefilled]
        budget = self.timing.max_batched_tokens - len(decoding)
        chunks: list[tuple[ModelRequest, int]] = []
        for r in self.running:
            if budget <= 0:
                break
            if not r.prefilled:
                n = min(len(r.prompt) - r.num_computed, budget)
                chunks.append((r, n))
                budget -= n
        if not decoding and not chunks:
            # everything waits on pages held by nobody running: cannot happen (a lone
            # request is admitted with what fits), but never spin
            self._step_end = None
            return
        num_prefill = sum(n for _, n in chunks)
        duration = self.timing.chunk_step_s(num_prefill, len(decoding))
        if num_prefill:
            self.busy_s += self.timing.chunk_step_s(num_prefill, 0)
        self._step_chunks, self._step_decoding = chunks, decoding
        self._step_end = t + duration

    def _complete_step(self, t: float) -> None:
        self._step_end = None
        self.num_steps += 1
        chunks, decoding = self._step_chunks, self._step_decoding
        self._step_chunks, self._step_decoding = [], []
        for r in decoding:
            if not r.finished:
                self._emit(r, 1, t)
        for r, n in chunks:
            if r.finished:
                continue
            r.num_computed += n
            self.computed_prompt_tokens += n
            if r.num_computed >= len(r.prompt):
                self._prefill_done(r, t)
                self._emit(r, 1, t)
        for r in list(self.running):
            if r.aborted:
                self._finish(r, "abort", t)
            elif r.prefilled and (r.num_output >= r.max_tokens or r.prefill_only):
                self._finish(r, "length", t)

    def _reap_aborted(self, t: float) -> None:
        for r in [r for r in self.running if r.aborted]:
            self._finish(r, "abort", t)

    # ------------------------------------------------------------------ shared

    def _admit_head(self, t: float) -> ModelRequest | None:
        """Admit the head of the queue at ``t``; None when it must wait for pages."""
        while self.waiting and self.waiting[0].aborted:
            r = self.waiting.popleft()
            r.finished = True
            self.num_aborted += 1
            self.listener.done(r, "abort", t)
        if not self.waiting:
            return None
        r = self.waiting[0]
        try:
            req = self.cache.begin_request(r.prompt, strict=True)
        except OutOfPagesError:
            if self.running:
                self._blocked = True  # head of line waits for pages to be released
                return None
            req = self.cache.begin_request(r.prompt, strict=False)
        self.waiting.popleft()
        bs = self.block_size
        hit = 0 if req.prefix_indices is None else int(req.prefix_indices.numel()) * bs
        r.cached_tokens = reported_hit(hit, len(r.prompt), bs)
        r.req = req
        r.cache = self.cache
        r.admitted_s = t
        self.prompt_tokens += len(r.prompt)
        self.cached_tokens += r.cached_tokens
        self.running.append(r)
        if r.remote_prefill:
            r.num_computed = len(r.prompt)
            self._prefill_done(r, t)
        else:
            r.num_computed = r.cached_tokens
        return r

    def _prefill_done(self, r: ModelRequest, t: float) -> None:
        r.prefilled = True
        r.cache.cache_unfinished_req(r.req, token_ids=r.req.origin_input_ids)
        if r.req.prefix_indices is not None:
            r.block_ids = [int(x) for x in r.req.prefix_indices.tolist()]
        self.listener.prefill_done(r, t)

    def _emit(self, r: ModelRequest, count: int, t: float) -> None:
        if r.num_output == 0:
            r.first_token_s = t
        r.num_output += count
        self.generation_tokens += count
        self.listener.tokens(r, count, t)

    def _finish(self, r: ModelRequest, reason: str, t: float) -> None:
        if r.req is not None and r.cache is not None:
            r.cache.cache_finished_req(r.req, token_ids=r.req.origin_input_ids[: r.num_computed])
            r.req = None
        was_full = len(self.running) >= self.max_num_seqs
        if r in self.running:
            self.running.remove(r)
        r.finished = True
        if reason == "abort":
            self.num_aborted += 1
        else:
            self.num_finished += 1
        if self._blocked or was_full:
            # pages or a slot were released: the head may start now, not before
            self._blocked = False
            self._lane_free_s = max(self._lane_free_s, t)
        self.listener.done(r, reason, t)
