"""The ``agentic`` shape: tool-calling agent loops on a few long shared system prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from tokenspeed_router.sim.shapes._core import (
    IdMint,
    Prompt,
    Shape,
    Turn,
    ZipfSampler,
    lognormal_int,
    lognormal_median_for_mean,
    param,
    poisson_clock,
    require,
    run_sessions,
)

__all__ = ["AgenticShape"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AgenticShape(Shape):
    """Agent sessions: a long shared system prompt, then calls that grow by tool observations.

    Each session is one agent task. Its first call is a system prompt (tool
    schemas and instructions; one of ``system_prompts``, picked with Zipf
    popularity) plus the user's task. Every further call's prompt is the
    previous call's prompt + that call's output (the tool call) + the tool's
    observation, so each call of a session extends the previous one. A call
    arrives when the previous answer would be done (``output_tokens *
    decode_s_per_token``) plus the tool's latency: fast turn-backs, unlike
    chat's think times. Sessions start as a Poisson process and interleave,
    so many sessions grow on top of the same few system prompts at once.

    Grounding: Mooncake (Qin et al., FAST'25, Table 2): the tool&agent
    workload has mean input 8,596 and mean output 182 tokens; our defaults
    give mean output 182 (``output_tokens_mean``) and a mean input near
    8.6 k (docs/workloads.md has the measured figure). Its 23,608 requests
    span about an hour (Dynamo's DynoSim replay of it: 60.1 simulated
    minutes, a draft post), 6.5 req/s: 1.7 sessions/s of about 3.9 calls
    give that. The 6-9 k-token system prompts, their number and the loop
    lengths are choices (issue 26's agentic setup; an agent caching study on
    DeepResearchBench used 10,000-token system prompts and 3-50 tool calls,
    "Don't Break the Cache", arXiv 2601.06007, read in a secondary summary).
    Preble (ICLR'25) names tool use and agents as its long-shared-prompt
    workloads.
    """

    NAME: ClassVar[str] = "agentic"
    SUMMARY: ClassVar[str] = ("agent tool loops: a few 6-9k-token shared system prompts, sessions that "
                              "grow by tool observations, interleaved, fast turn-backs")
    SOURCES: ClassVar[tuple[str, ...]] = (
        "Mooncake, Qin et al., USENIX FAST'25, Table 2: tool&agent workload, mean input 8,596 "
        "and mean output 182 tokens, 23,608 requests in about an hour (6.5 req/s; Dynamo's DynoSim "
        "replay: 60.1 simulated minutes)",
        "Preble, Srivatsa et al., ICLR'25: tool use and agents as long, shared-prompt workloads",
        "choices: 6-9k-token system prompts (issue 26), calls per session, tool latency; cf. "
        "'Don't Break the Cache', arXiv 2601.06007 (10k-token system prompts, 3-50 tool calls; "
        "secondary summary)",
    )
    RATE: ClassVar[str] = "session_rate_per_s"

    system_prompts: int = param(4, "distinct system prompts (count; choice)")
    system_prompt_min_tokens: int = param(6000, "shortest system prompt, uniform draw (tokens; choice)")
    system_prompt_max_tokens: int = param(9000, "longest system prompt, uniform draw (tokens; choice)")
    system_prompt_skew: float = param(1.0, "Zipf exponent of the system prompts' popularity, 0 = uniform "
                                           "(choice)")
    session_rate_per_s: float = param(1.7, "new agent sessions per second, Poisson (1/s; gives about the 6.5 "
                                           "req/s of Mooncake tool&agent)")
    task_tokens_median: int = param(250, "median user task after the system prompt, lognormal (tokens; "
                                         "choice)")
    task_tokens_sigma: float = param(0.8, "log-space sigma of the task length (choice)")
    calls_mean: float = param(4.0, "mean LLM calls per session, geometric >= 1 (count; choice)")
    calls_max: int = param(30, "most LLM calls in one session (count; choice)")
    observation_tokens_median: int = param(120, "median tool observation appended per call, lognormal "
                                                "(tokens; choice)")
    observation_tokens_sigma: float = param(1.0, "log-space sigma of the observation length (choice)")
    output_tokens_mean: int = param(182, "mean output per call, lognormal (tokens; Mooncake tool&agent)")
    output_tokens_sigma: float = param(0.8, "log-space sigma of the output length (choice)")
    output_tokens_max: int = param(2000, "longest output (tokens; choice)")
    tool_latency_s_mean: float = param(1.0, "mean tool latency between an answer and the next call, "
                                            "exponential (s; choice)")
    decode_s_per_token: float = param(0.02, "assumed decode time per output token, to place the next "
                                            "call after the answer (s; simulate's default)")
    max_context_tokens: int = param(131072, "a session ends before its prompt would exceed this (tokens; "
                                            "choice)")

    def __post_init__(self) -> None:
        require(self.system_prompts >= 1, "system_prompts must be >= 1")
        require(0 < self.system_prompt_min_tokens <= self.system_prompt_max_tokens,
                "need 0 < system_prompt_min_tokens <= system_prompt_max_tokens")
        require(self.system_prompt_max_tokens < self.max_context_tokens,
                "system prompts must be shorter than max_context_tokens")
        require(self.system_prompt_skew >= 0, "system_prompt_skew must be >= 0")
        require(self.session_rate_per_s > 0, "session_rate_per_s must be > 0")
        require(self.task_tokens_median >= 1 and self.observation_tokens_median >= 1,
                "task and observation medians must be >= 1 token")
        require(self.calls_mean >= 1 and self.calls_max >= 1, "calls_mean and calls_max must be >= 1")
        require(1 <= self.output_tokens_mean <= self.output_tokens_max,
                "need 1 <= output_tokens_mean <= output_tokens_max")
        require(min(self.task_tokens_sigma, self.observation_tokens_sigma, self.output_tokens_sigma) >= 0,
                "sigmas must be >= 0")
        require(self.tool_latency_s_mean > 0 and self.decode_s_per_token >= 0,
                "tool_latency_s_mean must be > 0 and decode_s_per_token >= 0")

    def turns(self, rng: random.Random, requests: int, block: int) -> list[Turn]:
        mint = IdMint()
        systems = [Prompt().extended(rng.randint(self.system_prompt_min_tokens, self.system_prompt_max_tokens),
                                     block, mint)
                   for _ in range(self.system_prompts)]
        pick_system = ZipfSampler(self.system_prompts, self.system_prompt_skew)
        out_median = lognormal_median_for_mean(self.output_tokens_mean, self.output_tokens_sigma)
        continue_p = 1.0 - 1.0 / self.calls_mean

        def output() -> int:
            return lognormal_int(rng, out_median, self.output_tokens_sigma, 1, self.output_tokens_max)

        def start(t: float, session: int, _key: object) -> Turn:
            system = systems[pick_system(rng)]
            task = lognormal_int(rng, self.task_tokens_median, self.task_tokens_sigma, 1,
                                 self.max_context_tokens - system.length)
            return Turn(t, system.extended(task, block, mint), output(), session, 1)

        def follow(turn: Turn) -> Turn | None:
            calls = turn.state
            if calls >= self.calls_max or rng.random() >= continue_p:
                return None
            observation = lognormal_int(rng, self.observation_tokens_median, self.observation_tokens_sigma,
                                        1, self.max_context_tokens)
            add = turn.output_tokens + observation
            if turn.prompt.length + add > self.max_context_tokens:
                return None
            gap = turn.output_tokens * self.decode_s_per_token + rng.expovariate(1.0 / self.tool_latency_s_mean)
            return Turn(turn.arrival_s + gap, turn.prompt.extended(add, block, mint), output(),
                        turn.session, calls + 1)

        return run_sessions(requests, next_start=poisson_clock(rng, self.session_rate_per_s),
                            start=start, follow=follow)
