"""The ``cold`` shape: a stream in which no request shares a block with another."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from tokenspeed_router.sim.shapes._core import (
    IdMint,
    Prompt,
    Shape,
    Turn,
    lognormal_int,
    param,
    require,
    single_turns,
)

__all__ = ["ColdShape"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ColdShape(Shape):
    """No reuse at all: every request's blocks are new, so routing can win only on load.

    The control shape: a KV-aware router must not lose to a load balancer
    here. Requests are single-turn, Poisson.

    Grounding: the Mooncake FAST'25 conversation trace with its prefix
    sharing removed: inputs lognormal with median 6,227 and log-sd 1.20 (a
    fit to all 12,031 of its inputs, ``benchmarks/trace_sessions.py``),
    bounded by its shortest and longest (891 and 126,195), outputs as in
    ``chat``, arrivals at its mean 3.40 req/s.
    """

    NAME: ClassVar[str] = "cold"
    SUMMARY: ClassVar[str] = ("a cold stream with no reuse: Mooncake conversation lengths and rate, "
                              "every block new")
    SOURCES: ClassVar[tuple[str, ...]] = (
        "Mooncake FAST'25 conversation trace: input median 6,227, log-sd 1.20 (lognormal fit), output "
        "median 350 / p99 1,120, 3.40 req/s (our statistics, benchmarks/trace_sessions.py), prefix sharing "
        "removed",
    )
    RATE: ClassVar[str] = "rate_per_s"

    rate_per_s: float = param(3.4, "requests per second, Poisson (1/s; Mooncake conversation)")
    input_tokens_median: int = param(6227, "median prompt, lognormal (tokens; Mooncake conversation)")
    input_tokens_sigma: float = param(1.20, "log-space sigma of prompts (Mooncake conversation)")
    input_tokens_min: int = param(891, "shortest prompt (tokens; Mooncake conversation min)")
    input_tokens_max: int = param(126195, "longest prompt (tokens; Mooncake conversation max)")
    output_tokens_median: int = param(350, "median output, lognormal (tokens; Mooncake conversation)")
    output_tokens_sigma: float = param(0.5, "log-space sigma of outputs (Mooncake conversation p99)")
    output_tokens_max: int = param(2000, "longest output (tokens; Mooncake conversation max)")

    def __post_init__(self) -> None:
        require(self.rate_per_s > 0, "rate_per_s must be > 0")
        require(1 <= self.input_tokens_min <= self.input_tokens_median <= self.input_tokens_max,
                "need 1 <= input_tokens_min <= input_tokens_median <= input_tokens_max")
        require(1 <= self.output_tokens_median <= self.output_tokens_max,
                "need 1 <= output_tokens_median <= output_tokens_max")
        require(min(self.input_tokens_sigma, self.output_tokens_sigma) >= 0, "sigmas must be >= 0")

    def turns(self, rng: random.Random, requests: int, block: int) -> list[Turn]:
        mint = IdMint()

        def start(t: float, session: int, _key: object) -> Turn:
            n = lognormal_int(rng, self.input_tokens_median, self.input_tokens_sigma, self.input_tokens_min,
                              self.input_tokens_max)
            output = lognormal_int(rng, self.output_tokens_median, self.output_tokens_sigma, 1,
                                   self.output_tokens_max)
            return Turn(t, Prompt().extended(n, block, mint), output, session)

        return single_turns(rng, requests, self.rate_per_s, start)
