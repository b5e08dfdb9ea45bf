"""How long an engine takes: the one timing model of ``simulate`` and ``engine-sim``.

Both the simulator (``sim/cluster.py``, a virtual clock) and the engine
simulator (``engine_sim/engine.py``, real time) run the same scheduler
(:mod:`tokenspeed_router.engine_model`) timed by this model, so that a trace
replayed through ``simulate`` and through engine-sims behind a router gives
the same per-request times for the same routing. Two profiles:

``fifo`` — one prefill at a time per engine, first come first served
    (vLLM without chunked prefill on a saturated GPU, and the engine model of
    the research notes): a prefill costs ``prefill_overhead_s + uncached
    tokens / prefill_tokens_per_s``; decode runs beside it without contention,
    one token every ``decode_s_per_token`` for each running request. The
    first token comes out when the prefill ends.

``chunked`` — vLLM's scheduler with chunked prefill: steps with a token
    budget of ``max_batched_tokens``; every decoding request takes one token
    of it, the rest goes to prefill chunks, FIFO. A step costs ``overhead +
    prefill_tokens / prefill_tokens_per_s`` (the overhead only when it
    prefills) plus, when any request decodes,
    ``decode_s_per_token * (1 + decode_batch_cost * (num_decoding - 1))``.
    A request's first token comes out at the end of the step that finishes
    its prefill; each later step yields one more.

Only *uncached* prompt tokens are prefilled. Durations here are *modelled*
seconds; ``time_scale`` K runs an engine-sim K times faster than modelled
(K = 0: no modelled delay at all, which measures everything around the
engine). The model ignores attention cost growing with context and the KV
memory generated tokens take.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from tokenspeed_router.errors import ConfigError

__all__ = ["PROFILES", "Profile", "TimingModel"]

Profile = Literal["fifo", "chunked"]
PROFILES: tuple[Profile, ...] = ("fifo", "chunked")

#: the fixed cost of one FIFO prefill when none is given (kernel launches, scheduling)
DEFAULT_FIFO_OVERHEAD_S = 0.020


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimingModel:
    """Modelled durations (seconds, before ``time_scale``) of prefill and decode.

    ``prefill_overhead_s`` None takes the profile's default: 20 ms per FIFO
    prefill, nothing per chunked step (as engine-sim has always run).
    """

    profile: Profile = "chunked"
    prefill_tokens_per_s: float = 20_000.0
    prefill_overhead_s: float | None = None
    decode_s_per_token: float = 0.02
    decode_batch_cost: float = 0.02
    max_batched_tokens: int = 2048
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ConfigError(f"timing profile must be one of {', '.join(PROFILES)}, got {self.profile!r}")
        if self.prefill_tokens_per_s <= 0:
            raise ConfigError(f"prefill_tokens_per_s must be positive, got {self.prefill_tokens_per_s}")
        if self.prefill_overhead_s is not None and self.prefill_overhead_s < 0:
            raise ConfigError(f"prefill_overhead_s must be >= 0, got {self.prefill_overhead_s}")
        if self.decode_s_per_token < 0 or self.decode_batch_cost < 0:
            raise ConfigError("decode_s_per_token and decode_batch_cost must be >= 0")
        if self.max_batched_tokens <= 0:
            raise ConfigError(f"max_batched_tokens must be positive, got {self.max_batched_tokens}")
        if self.time_scale < 0:
            raise ConfigError(f"time_scale must be >= 0 (0 = instant), got {self.time_scale}")

    @property
    def instant(self) -> bool:
        return self.time_scale == 0

    @property
    def overhead_s(self) -> float:
        """The fixed cost of one prefill (FIFO) or of one step that prefills (chunked)."""
        if self.prefill_overhead_s is not None:
            return self.prefill_overhead_s
        return DEFAULT_FIFO_OVERHEAD_S if self.profile == "fifo" else 0.0

    def prefill_s(self, uncached_tokens: int) -> float:
        """Modelled service time of one whole FIFO prefill of ``uncached_tokens``."""
        if self.instant:
            return 0.0
        return self.overhead_s + max(0, uncached_tokens) / self.prefill_tokens_per_s

    def decode_token_s(self) -> float:
        """Modelled time between two tokens of one request (FIFO: no contention)."""
        return 0.0 if self.instant else self.decode_s_per_token

    def chunk_step_s(self, num_prefill_tokens: int, num_decoding: int) -> float:
        """Modelled duration of one chunked step."""
        if self.instant:
            return 0.0
        modelled = 0.0
        if num_prefill_tokens > 0:
            modelled = self.overhead_s + num_prefill_tokens / self.prefill_tokens_per_s
        if num_decoding > 0:
            modelled += self.decode_s_per_token * (1.0 + self.decode_batch_cost * (num_decoding - 1))
        return modelled

    def step_s(self, num_prefill_tokens: int, num_decoding: int) -> float:
        """Wall-clock seconds of one chunked step (:meth:`chunk_step_s` / ``time_scale``)."""
        if self.instant:
            return 0.0
        return self.chunk_step_s(num_prefill_tokens, num_decoding) / self.time_scale

    def wall_s(self, modelled_s: float) -> float:
        """Modelled seconds as wall seconds (0 when instant)."""
        return 0.0 if self.instant else modelled_s / self.time_scale
