"""The ``multitenant`` shape: API tenants with their own system prompts, rates and bursts."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Any, ClassVar

from tokenspeed_router.sim.shapes._core import (
    IdMint,
    Prompt,
    Shape,
    Turn,
    lognormal_int,
    param,
    require,
    run_sessions,
)

__all__ = ["MultiTenantShape"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MultiTenantShape(Shape):
    """Several API tenants, each a system prompt of its own, a rate of its own and on/off bursts.

    Tenant k sends single-turn requests: its system prompt (shared by all of
    its requests, by nobody else's) plus a unique input. Tenants' long-run
    rates split ``rate_per_s`` by a Zipf law (``tenant_skew``). Each tenant
    alternates bursts and silences (exponential durations of mean
    ``burst_on_s_mean`` and ``burst_off_s_mean``); inside a burst it sends at
    its long-run rate * (on + off) / on, as a Poisson process, so its average
    stays its share. The tenants' streams are merged on one clock.

    Grounding: "KVCache Cache in the Wild" (Wang et al., USENIX ATC'25) on
    Alibaba Bailian traces: in the API (to-B) trace 97 % of cache hits come
    from single-turn requests sharing system prompts, under 0.1 % of requests
    are multi-turn, reuse stays mostly within one user, reuses are skewed
    (10 % of blocks take 77 % of them) and 80 % happen within 10 s (all from a
    secondary summary of the paper). BurstGPT (Wang et al., arXiv 2401.17644;
    Azure OpenAI traces) finds real LLM arrivals far burstier than Poisson
    and models them with Gamma inter-arrivals; an on/off modulated Poisson
    process is the choice here. Tenant count, prompt and input lengths,
    burst durations and outputs are choices.
    """

    NAME: ClassVar[str] = "multitenant"
    SUMMARY: ClassVar[str] = ("multi-tenant API mix: 8 tenants with their own system prompts, Zipf-skewed "
                              "rates, on/off bursts, single-turn requests")
    SOURCES: ClassVar[tuple[str, ...]] = (
        "KVCache Cache in the Wild, Wang et al., USENIX ATC'25 (Alibaba Bailian to-B trace): 97 % of hits "
        "from single-turn requests sharing system prompts, < 0.1 % multi-turn, reuse mostly within a user, "
        "10 % of blocks take 77 % of reuses, 80 % of reuses within 10 s (secondary summary)",
        "BurstGPT, Wang et al., arXiv 2401.17644 (Azure OpenAI): arrivals burstier than Poisson, modelled "
        "with Gamma inter-arrivals (secondary summary)",
        "choices: tenants, prompt and input lengths, burst durations, outputs",
    )
    RATE: ClassVar[str] = "rate_per_s"

    tenants: int = param(8, "tenants (count; choice)")
    tenant_skew: float = param(1.0, "Zipf exponent of the tenants' shares of rate_per_s, 0 = equal (choice)")
    rate_per_s: float = param(4.0, "long-run requests per second of all tenants together (1/s; choice)")
    burst_on_s_mean: float = param(20.0, "mean burst length, exponential (s; choice)")
    burst_off_s_mean: float = param(60.0, "mean silence between bursts, exponential (s; choice)")
    system_prompt_tokens_median: int = param(2000, "median tenant system prompt, lognormal (tokens; choice)")
    system_prompt_tokens_sigma: float = param(0.7, "log-space sigma of system prompts (choice)")
    system_prompt_tokens_max: int = param(12000, "longest system prompt (tokens; choice)")
    input_tokens_median: int = param(400, "median unique input after the system prompt, lognormal (tokens; "
                                          "choice)")
    input_tokens_sigma: float = param(1.0, "log-space sigma of inputs (choice)")
    input_tokens_max: int = param(32000, "longest input (tokens; choice)")
    output_tokens_median: int = param(120, "median output, lognormal (tokens; choice)")
    output_tokens_sigma: float = param(0.8, "log-space sigma of outputs (choice)")
    output_tokens_max: int = param(2000, "longest output (tokens; choice)")

    def __post_init__(self) -> None:
        require(self.tenants >= 1, "tenants must be >= 1")
        require(self.tenant_skew >= 0, "tenant_skew must be >= 0")
        require(self.rate_per_s > 0 and self.burst_on_s_mean > 0 and self.burst_off_s_mean >= 0,
                "rate_per_s and burst_on_s_mean must be > 0, burst_off_s_mean >= 0")
        require(1 <= self.system_prompt_tokens_median <= self.system_prompt_tokens_max,
                "need 1 <= system_prompt_tokens_median <= system_prompt_tokens_max")
        require(1 <= self.input_tokens_median <= self.input_tokens_max,
                "need 1 <= input_tokens_median <= input_tokens_max")
        require(1 <= self.output_tokens_median <= self.output_tokens_max,
                "need 1 <= output_tokens_median <= output_tokens_max")
        require(min(self.system_prompt_tokens_sigma, self.input_tokens_sigma, self.output_tokens_sigma) >= 0,
                "sigmas must be >= 0")

    def tenant_rates(self) -> list[float]:
        """Each tenant's long-run request rate (1/s); they sum to ``rate_per_s``."""
        weights = [1.0 / (k + 1) ** self.tenant_skew for k in range(self.tenants)]
        total = sum(weights)
        return [self.rate_per_s * w / total for w in weights]

    def turns(self, rng: random.Random, requests: int, block: int) -> list[Turn]:
        mint = IdMint()
        systems = [Prompt().extended(lognormal_int(rng, self.system_prompt_tokens_median,
                                                   self.system_prompt_tokens_sigma, 1,
                                                   self.system_prompt_tokens_max), block, mint)
                   for _ in range(self.tenants)]
        on, off = self.burst_on_s_mean, self.burst_off_s_mean
        burst_rates = [r * (on + off) / on for r in self.tenant_rates()]

        def advance(k: int, t: float, on_end: float) -> tuple[float, int, float]:
            """Tenant k's next request after time ``t`` inside a burst ending at ``on_end``."""
            while True:
                t_next = t + rng.expovariate(burst_rates[k])
                if t_next <= on_end:
                    return t_next, k, on_end
                t = on_end + (rng.expovariate(1.0 / off) if off > 0 else 0.0)
                on_end = t + rng.expovariate(1.0 / on)

        heap: list[tuple[float, int, float]] = []
        for k in range(self.tenants):
            # Start each tenant in its stationary state: in a burst with probability on / (on + off).
            t0 = 0.0 if rng.random() < on / (on + off) else (rng.expovariate(1.0 / off) if off > 0 else 0.0)
            heap.append(advance(k, t0, t0 + rng.expovariate(1.0 / on)))
        heapq.heapify(heap)

        def next_start() -> tuple[float, Any]:
            t, k, on_end = heapq.heappop(heap)
            heapq.heappush(heap, advance(k, t, on_end))
            return t, k

        def start(t: float, session: int, tenant: Any) -> Turn:
            text = lognormal_int(rng, self.input_tokens_median, self.input_tokens_sigma, 1, self.input_tokens_max)
            output = lognormal_int(rng, self.output_tokens_median, self.output_tokens_sigma, 1,
                                   self.output_tokens_max)
            return Turn(t, systems[tenant].extended(text, block, mint), output, session, tenant)

        return run_sessions(requests, next_start=next_start, start=start, follow=lambda _turn: None)
