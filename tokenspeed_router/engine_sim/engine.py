"""The simulated engine: a scheduler loop over a real ``PrefixCache``, timed by :mod:`.timing`.

One asyncio task (:meth:`Engine.run`) owns the cache and every request's
state; HTTP handlers only :meth:`Engine.submit` a :class:`SimRequest` and read
its output queue. Per step (see :mod:`.timing` for durations):

1. Admission, FIFO, while fewer than ``max_num_seqs`` run: the request
   starts in the cache as an engine's would (``begin_request``: longest
   cached prefix matched and *locked*, pages for the rest allocated, evicting
   unlocked leaves if needed). If its pages cannot be found while others
   run, it waits (head of line); alone, it runs with only what fits cached.
   The reported ``cached_tokens`` is the hit capped at
   ``(prompt_len - 1) // block_size * block_size``, as vLLM does: the last
   prompt token is always computed.
2. The token budget goes to decoding requests (one token each), then to
   prefill chunks, FIFO.
3. When a prompt's prefill completes its full blocks are cached
   (``cache_unfinished_req``, which publishes ``BlockStored``; the request
   keeps its lock) and its first token is emitted; when it has
   ``max_tokens`` tokens it is finished (``cache_finished_req`` releases the
   lock). Only prompt tokens are cached, not generated ones. The step's
   events go out as one batch at its end.

P/D (DESIGN §10): a ``prefill_only`` request stops after its first token and
reports its block ids; a ``remote_prefill`` request counts its prompt as
transferred (no prefill compute), caches it, and decodes.

The restart fault swaps in a fresh cache (its publisher rebound, seq 0)
between steps; requests already running finish against the old cache, whose
events go nowhere, as if they had been transferred.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections import deque
from typing import Literal

from tokenspeed_router.cache import PrefixCache, Req
from tokenspeed_router.engine_sim.publishing import EventOutlet
from tokenspeed_router.engine_sim.timing import TimingModel
from tokenspeed_router.errors import ConfigError, OutOfPagesError

__all__ = ["EngineConfig", "EngineStatistics", "Role", "SimRequest", "Engine"]

logger = logging.getLogger(__name__)

Role = Literal["both", "prefill", "decode"]

#: Output items: ("token", id) per generated token, then ("done", finish_reason).
OutputItem = tuple[str, object]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    name: str = "engine-sim"
    role: Role = "both"
    block_size: int = 16
    capacity_tokens: int = 262_144
    max_num_seqs: int = 64
    max_model_len: int = 131_072
    timing: TimingModel = dataclasses.field(default_factory=TimingModel)
    restart_after_requests: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.role not in ("both", "prefill", "decode"):
            raise ConfigError(f"role must be both, prefill or decode, got {self.role!r}")
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.capacity_tokens < self.block_size:
            raise ConfigError(f"capacity_tokens must hold one block, got {self.capacity_tokens}")
        if self.max_num_seqs <= 0 or self.max_model_len <= 0:
            raise ConfigError("max_num_seqs and max_model_len must be positive")
        if self.restart_after_requests is not None and self.restart_after_requests <= 0:
            raise ConfigError("restart_after_requests must be positive")


@dataclasses.dataclass(eq=False)
class SimRequest:
    """One request's state; owned by the engine loop once submitted."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    prefill_only: bool = False
    remote_prefill: bool = False
    #: Filled by the engine:
    cached_tokens: int = 0
    num_computed: int = 0
    num_output: int = 0
    prefilled: bool = False
    finished: bool = False
    aborted: bool = False
    block_ids: list[int] = dataclasses.field(default_factory=list)
    output: asyncio.Queue[OutputItem] = dataclasses.field(default_factory=asyncio.Queue)
    req: Req | None = None
    cache: PrefixCache | None = None


@dataclasses.dataclass(frozen=True)
class EngineStatistics:
    num_running: int
    num_waiting: int
    num_finished: int
    num_aborted: int
    prompt_tokens: int
    cached_tokens: int
    computed_prompt_tokens: int
    generation_tokens: int
    cache_tokens: int
    cache_capacity_tokens: int
    num_steps: int
    num_restarts: int
    num_events_dropped: int


class Engine:
    """The scheduler loop; see the module docstring."""

    def __init__(self, config: EngineConfig, outlet: EventOutlet) -> None:
        self.config = config
        self.outlet = outlet
        self.cache = self._new_cache()
        outlet.attach(self.cache, config.capacity_tokens)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._restarted = False
        self._token_ids = itertools.count(1)
        self._finished = 0
        self._aborted = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._computed_prompt_tokens = 0
        self._generation_tokens = 0
        self._steps = 0

    def _new_cache(self) -> PrefixCache:
        c = self.config
        num_pages = c.capacity_tokens // c.block_size
        return PrefixCache.with_capacity(
            num_pages,
            page_size=c.block_size,
            max_num_reqs=c.max_num_seqs,
            max_context_len=min(c.max_model_len, num_pages * c.block_size),
            debug_checks=False,
        )

    # ------------------------------------------------------------------ handlers' side

    def submit(self, request: SimRequest) -> None:
        """Queue ``request`` (FIFO); its tokens arrive on ``request.output``."""
        self.waiting.append(request)
        self._wake.set()

    def abort(self, request: SimRequest) -> None:
        """The client went away: free the request at the next step boundary."""
        if not request.finished:
            request.aborted = True
            self._wake.set()

    def statistics(self) -> EngineStatistics:
        stats = self.cache.statistics()
        return EngineStatistics(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_finished=self._finished,
            num_aborted=self._aborted,
            prompt_tokens=self._prompt_tokens,
            cached_tokens=self._cached_tokens,
            computed_prompt_tokens=self._computed_prompt_tokens,
            generation_tokens=self._generation_tokens,
            cache_tokens=stats.cached_tokens,
            cache_capacity_tokens=stats.total_pages * stats.page_size,
            num_steps=self._steps,
            num_restarts=self.outlet.num_restarts,
            num_events_dropped=self.outlet.num_dropped,
        )

    def close(self) -> None:
        self._closing = True
        self._wake.set()

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Step until :meth:`close`; every exception in a step is logged and fails its requests."""
        while not self._closing:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._step()
            except Exception:  # a bug must not hang every client: fail what runs, keep serving
                logger.exception("engine-sim %s: step failed", self.config.name)
                for r in [*self.running, *self.waiting]:
                    r.output.put_nowait(("error", "engine step failed"))
                    r.finished = True
                self.running = []
                self.waiting.clear()

    async def _step(self) -> None:
        timing = self.config.timing
        self._drop_aborted()
        self._admit()
        decoding = [r for r in self.running if r.prefilled]
        budget = timing.max_batched_tokens - len(decoding)
        chunks: list[tuple[SimRequest, int]] = []
        for r in self.running:
            if budget <= 0:
                break
            if not r.prefilled:
                n = min(len(r.prompt) - r.num_computed, budget)
                chunks.append((r, n))
                budget -= n
        num_prefill = sum(n for _, n in chunks)
        delay_s = timing.step_s(num_prefill, len(decoding))
        if not decoding and not chunks:
            # Everything waits on pages held by nobody running: cannot happen
            # (admission runs a lone request), but never spin.
            self.outlet.flush(self.cache)
            self._wake.clear()
            await self._wake.wait()
            return
        await asyncio.sleep(delay_s)
        self._steps += 1
        for r in decoding:
            self._emit_token(r)
        for r, n in chunks:
            r.num_computed += n
            self._computed_prompt_tokens += n
            if r.num_computed >= len(r.prompt):
                self._prefill_done(r)
                self._emit_token(r)
        self._finish_done()
        self.outlet.flush(self.cache)
        self._maybe_restart()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            r = self.waiting[0]
            if r.aborted:
                self.waiting.popleft()
                self._end(r, "abort")
                continue
            try:
                req = self.cache.begin_request(r.prompt, strict=True)
            except OutOfPagesError:
                if self.running:
                    return  # head of line waits for pages to be released
                req = self.cache.begin_request(r.prompt, strict=False)
            self.waiting.popleft()
            bs = self.config.block_size
            hit = 0 if req.prefix_indices is None else int(req.prefix_indices.numel()) * bs
            r.cached_tokens = min(hit, (len(r.prompt) - 1) // bs * bs)
            r.req = req
            r.cache = self.cache
            self._prompt_tokens += len(r.prompt)
            self._cached_tokens += r.cached_tokens
            self.running.append(r)
            if r.remote_prefill:
                r.num_computed = len(r.prompt)
                self._prefill_done(r)
            else:
                r.num_computed = r.cached_tokens

    def _prefill_done(self, r: SimRequest) -> None:
        assert r.req is not None and r.cache is not None
        r.prefilled = True
        r.cache.cache_unfinished_req(r.req, token_ids=r.req.origin_input_ids)
        if r.req.prefix_indices is not None:
            r.block_ids = [int(x) for x in r.req.prefix_indices.tolist()]
        if r.cache is self.cache:
            self.outlet.prompt_cached(r.req.origin_input_ids)

    def _emit_token(self, r: SimRequest) -> None:
        r.num_output += 1
        self._generation_tokens += 1
        r.output.put_nowait(("token", next(self._token_ids) % 50_000))

    def _finish_done(self) -> None:
        keep: list[SimRequest] = []
        for r in self.running:
            if r.aborted:
                self._release(r)
                self._end(r, "abort")
            elif r.prefilled and (r.num_output >= r.max_tokens or r.prefill_only):
                self._release(r)
                self._finished += 1
                self._end(r, "length")
            else:
                keep.append(r)
        self.running = keep

    def _drop_aborted(self) -> None:
        if any(r.aborted for r in self.running):
            self._finish_done()

    def _release(self, r: SimRequest) -> None:
        if r.req is None or r.cache is None:
            return
        computed = r.req.origin_input_ids[: r.num_computed]
        r.cache.cache_finished_req(r.req, token_ids=computed)
        r.req = None

    def _end(self, r: SimRequest, reason: str) -> None:
        r.finished = True
        if reason == "abort":
            self._aborted += 1
        r.output.put_nowait(("done", reason))

    def _maybe_restart(self) -> None:
        limit = self.config.restart_after_requests
        if limit is None or self._restarted or self._finished < limit:
            return
        self._restarted = True
        self.outlet.flush(self.cache)
        self.cache.detach_publisher()
        self.outlet.restart()
        self.cache = self._new_cache()
        self.outlet.attach(self.cache, self.config.capacity_tokens)
        logger.warning("engine-sim %s: restarted after %d requests", self.config.name, self._finished)
