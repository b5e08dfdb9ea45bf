"""The simulated engine: the shared scheduler (:mod:`tokenspeed_router.engine_model`) in real time.

The scheduling, the prefix-cache life cycle and the timing profiles
(``fifo``, ``chunked``: :mod:`tokenspeed_router.timing`) are the ones
``simulate`` runs; this module only drives them on the asyncio loop. HTTP
handlers :meth:`Engine.submit` a :class:`SimRequest` and read its output
queue; one timer (``loop.call_at``) fires when the core has something due,
so an idle engine costs nothing and a busy one one callback per step or
token. The modelled clock is wall time since the engine started, times
``time_scale``. Each request records its own wall-clock queue and TTFT
(:attr:`SimRequest.wall_submitted`, :attr:`SimRequest.wall_first_token`):
the engine's share of what a client measures, so a load generator can tell
how much a router in front added.

P/D (DESIGN §10): a ``prefill_only`` request stops after its first token and
reports its block ids; a ``remote_prefill`` request counts its prompt as
transferred (no prefill compute), caches it, and decodes.

The restart fault swaps in a fresh cache (its publisher rebound, seq 0)
after a step; requests already running finish against the old cache, whose
events go nowhere, as if they had been transferred. Each step's (or
event's) cache events go out as one batch at its end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Literal

from tokenspeed_router.cache import PrefixCache
from tokenspeed_router.engine_model import EngineCore, ModelRequest
from tokenspeed_router.engine_sim.publishing import EventOutlet
from tokenspeed_router.errors import ConfigError
from tokenspeed_router.timing import TimingModel

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
class SimRequest(ModelRequest):
    """One HTTP request's state: the core's, plus its output queue and wall-clock times."""

    output: asyncio.Queue[OutputItem] = dataclasses.field(default_factory=asyncio.Queue)
    #: loop time when the engine got it, and when its first token came out
    wall_submitted: float = 0.0
    wall_first_token: float | None = None

    @property
    def engine_ttft_s(self) -> float | None:
        """Wall seconds from reaching the engine to its first token (the engine's share of TTFT)."""
        if self.wall_first_token is None:
            return None
        return self.wall_first_token - self.wall_submitted


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
    """The asyncio driver of one :class:`EngineCore`; see the module docstring."""

    def __init__(self, config: EngineConfig, outlet: EventOutlet) -> None:
        self.config = config
        self.outlet = outlet
        cache = self._new_cache()
        outlet.attach(cache, config.capacity_tokens)
        self.core = EngineCore(config.timing, cache, self, block_size=config.block_size,
                               max_num_seqs=config.max_num_seqs)
        self._closing = False
        self._restarted = False
        self._token_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._origin = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._stopped = asyncio.Event()

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

    @property
    def cache(self) -> PrefixCache:
        cache: PrefixCache = self.core.cache
        return cache

    @property
    def waiting(self) -> Sequence[ModelRequest]:
        return self.core.waiting

    @property
    def running(self) -> Sequence[ModelRequest]:
        return self.core.running

    # ------------------------------------------------------------------ clock

    def _modelled_now(self) -> float:
        assert self._loop is not None
        scale = self.config.timing.time_scale
        return (self._loop.time() - self._origin) * scale if scale > 0 else 0.0

    def _wall_at(self, modelled_s: float) -> float:
        scale = self.config.timing.time_scale
        return self._origin + modelled_s / scale if scale > 0 else 0.0

    # ------------------------------------------------------------------ handlers' side

    def submit(self, request: SimRequest) -> None:
        """Queue ``request`` (FIFO); its tokens arrive on ``request.output``."""
        loop = self._bind_loop()
        request.wall_submitted = loop.time()
        self.core.submit(request, self._modelled_now())
        self._schedule()

    def abort(self, request: SimRequest) -> None:
        """The client went away: free the request at the next step boundary."""
        if not request.finished:
            self.core.abort(request)
            self._schedule()

    def statistics(self) -> EngineStatistics:
        core = self.core
        stats = core.cache.statistics()
        return EngineStatistics(
            num_running=len(core.running),
            num_waiting=len(core.waiting),
            num_finished=core.num_finished,
            num_aborted=core.num_aborted,
            prompt_tokens=core.prompt_tokens,
            cached_tokens=core.cached_tokens,
            computed_prompt_tokens=core.computed_prompt_tokens,
            generation_tokens=core.generation_tokens,
            cache_tokens=stats.cached_tokens,
            cache_capacity_tokens=stats.total_pages * stats.page_size,
            num_steps=core.num_steps,
            num_restarts=self.outlet.num_restarts,
            num_events_dropped=self.outlet.num_dropped,
        )

    def close(self) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stopped.set()

    # ------------------------------------------------------------------ the loop

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._origin = self._loop.time()
        return self._loop

    async def run(self) -> None:
        """Serve until :meth:`close` (the work itself runs in timer callbacks)."""
        self._bind_loop()
        self._schedule()
        await self._stopped.wait()

    def _schedule(self) -> None:
        """(Re)arm the one timer for the core's next due event."""
        if self._closing or self._loop is None:
            return
        due = self.core.next_event_s()
        if due is None:
            return
        at = self._wall_at(due) if self.config.timing.time_scale > 0 else self._loop.time()
        if self._timer is not None:
            if self._timer_at is not None and self._timer_at <= at:
                return
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._tick, due)

    def _tick(self, due: float) -> None:
        self._timer = self._timer_at = None
        if self._closing:
            return
        try:
            self.core.advance(max(self._modelled_now(), due))
            self.outlet.flush(self.cache)
            self._maybe_restart()
        except Exception:  # a bug must not hang every client: fail what runs, keep serving
            logger.exception("engine-sim %s: step failed", self.config.name)
            core = self.core
            for r in [*core.running, *core.waiting]:
                if isinstance(r, SimRequest):
                    r.output.put_nowait(("error", "engine step failed"))
                r.finished = True
            core.running.clear()
            core.waiting.clear()
        self._schedule()

    # ------------------------------------------------------------------ the core's listener

    def tokens(self, r: ModelRequest, count: int, t: float) -> None:
        assert isinstance(r, SimRequest)
        if r.wall_first_token is None and self._loop is not None:
            r.wall_first_token = self._loop.time()
        for _ in range(count):
            r.output.put_nowait(("token", next(self._token_ids) % 50_000))

    def prefill_done(self, r: ModelRequest, t: float) -> None:
        if r.cache is self.core.cache:
            self.outlet.prompt_cached(r.req.origin_input_ids)

    def done(self, r: ModelRequest, reason: str, t: float) -> None:
        assert isinstance(r, SimRequest)
        r.output.put_nowait(("done", reason))

    def _maybe_restart(self) -> None:
        limit = self.config.restart_after_requests
        if limit is None or self._restarted or self.core.num_finished < limit:
            return
        self._restarted = True
        old = self.core.cache
        self.outlet.flush(old)
        old.detach_publisher()
        self.outlet.restart()
        self.core.cache = self._new_cache()
        self.outlet.attach(self.core.cache, self.config.capacity_tokens)
        logger.warning("engine-sim %s: restarted after %d requests", self.config.name, self.core.num_finished)
