"""The ``chat`` shape: multi-turn conversations with think times and growing context."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from tokenspeed_router.sim.shapes._core import (
    IdMint,
    Prompt,
    Shape,
    Turn,
    lognormal,
    lognormal_int,
    param,
    poisson_clock,
    require,
    run_sessions,
)

__all__ = ["ChatShape"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatShape(Shape):
    """Chat sessions: turn t's prompt is turn t-1's prompt + its answer + a new user message.

    Every conversation starts with one short system prompt shared by all,
    then the user's first message (long-tailed: pasted documents). A session
    goes on to another turn with probability ``continue_probability``; the
    next turn arrives a think time after the previous one (at least the time
    the answer takes). Most follow-up messages are short, some attach a
    document. Sessions start as a Poisson process; the clock starts
    ``warmup_s`` early so the trace opens on running traffic, as a window of
    production does, rather than on a burst of first turns.

    Grounding, the Mooncake FAST'25 conversation trace (one hour of Kimi
    traffic; statistics computed by ``benchmarks/trace_sessions.py``,
    docs/workloads.md): every request shares its first 512-token block and no
    more (a shared prefix of 512-1,023 tokens: 700 is a choice inside that);
    first-turn inputs are lognormal with median 5,384 and log-sd 1.26; the
    arrival gap between a session's turns has median 132 s, log-sd 0.98;
    a follow-up adds the previous answer plus a message that is > 1,000
    tokens in 19 % of turns (median 4,462, p90 12,436) and otherwise short
    (median 22, p90 342); outputs have median 350, p99 1,120 (Mooncake Table
    2: mean 343); 12,031 requests form 8,056 sessions (1.49 turns each). The
    chance of a further turn, 0.4, is calibrated so that a 3,000-request
    window has about that many turns per session and an ideal hit ratio near
    the trace's 37.4 %. ShareGPT conversations run longer (73 % are
    multi-turn: CachedAttention, Gao et al., USENIX ATC'24, secondary
    summary); raise ``continue_probability`` to model them.
    """

    NAME: ClassVar[str] = "chat"
    SUMMARY: ClassVar[str] = ("multi-turn chat: a short shared system prompt, long-tailed first messages, "
                              "minutes of think time, context that grows by answers and messages")
    SOURCES: ClassVar[tuple[str, ...]] = (
        "Mooncake FAST'25 conversation trace (Kimi, 12,031 requests): first-turn input median 5,384 "
        "(log-sd 1.26), turn gap median 132 s (log-sd 0.98), follow-up messages 19 % > 1k tokens, "
        "output median 350 / p99 1,120, 1.49 turns per session (our statistics, "
        "benchmarks/trace_sessions.py); Table 2 mean output 343",
        "calibrated: continue_probability 0.4 reproduces the trace's turns per session and ideal hit "
        "ratio (37.4 %) within a few points; ShareGPT is more multi-turn (73 %: CachedAttention, "
        "Gao et al., USENIX ATC'24, secondary summary)",
    )
    RATE: ClassVar[str] = "session_rate_per_s"

    system_prompt_tokens: int = param(700, "system prompt every conversation shares (tokens; choice within "
                                           "Mooncake's 512-1,023)")
    session_rate_per_s: float = param(2.0, "new conversations per second, Poisson (1/s; gives about the "
                                           "3.40 req/s of Mooncake conversation)")
    first_input_tokens_median: int = param(5384, "median first-turn prompt incl. the system prompt, lognormal "
                                                 "(tokens; Mooncake conversation)")
    first_input_tokens_sigma: float = param(1.26, "log-space sigma of the first-turn prompt (Mooncake "
                                                  "conversation)")
    continue_probability: float = param(0.4, "chance of each further turn, geometric turns (calibrated on "
                                             "Mooncake conversation)")
    turns_max: int = param(30, "most turns in one conversation (count; choice)")
    gap_s_median: float = param(132.0, "median arrival gap between turns, lognormal (s; Mooncake "
                                       "conversation)")
    gap_s_sigma: float = param(0.98, "log-space sigma of the turn gap (Mooncake conversation)")
    message_tokens_median: int = param(22, "median short follow-up message, lognormal (tokens; Mooncake "
                                           "conversation)")
    message_tokens_sigma: float = param(2.14, "log-space sigma of short messages (p90 342; Mooncake "
                                              "conversation)")
    message_tokens_max: int = param(1000, "longest short message (tokens; the split used for the fit)")
    attachment_probability: float = param(0.19, "chance a follow-up attaches a document (Mooncake "
                                                "conversation)")
    attachment_tokens_median: int = param(4462, "median attachment, lognormal (tokens; Mooncake conversation)")
    attachment_tokens_sigma: float = param(0.80, "log-space sigma of attachments (p90 12,436; Mooncake "
                                                 "conversation)")
    output_tokens_median: int = param(350, "median answer, lognormal (tokens; Mooncake conversation)")
    output_tokens_sigma: float = param(0.5, "log-space sigma of answers (p99 about 1,120; Mooncake "
                                            "conversation)")
    output_tokens_max: int = param(2000, "longest answer (tokens; Mooncake conversation max)")
    decode_s_per_token: float = param(0.02, "assumed decode time per output token: a turn never arrives "
                                            "before the last answer is done (s; simulate's default)")
    max_context_tokens: int = param(131072, "a conversation ends before its prompt would exceed this "
                                            "(tokens; choice, Mooncake's longest prompt is 126,195)")
    warmup_s: float = param(1800.0, "the clock starts this long before the trace (s; choice)")

    def __post_init__(self) -> None:
        require(self.system_prompt_tokens >= 1, "system_prompt_tokens must be >= 1")
        require(self.session_rate_per_s > 0, "session_rate_per_s must be > 0")
        require(self.first_input_tokens_median >= 1 and self.message_tokens_median >= 1
                and self.attachment_tokens_median >= 1 and self.output_tokens_median >= 1,
                "token medians must be >= 1")
        require(0 <= self.continue_probability < 1, "continue_probability must be in [0, 1)")
        require(0 <= self.attachment_probability <= 1, "attachment_probability must be in [0, 1]")
        require(self.turns_max >= 1 and self.message_tokens_max >= 1, "turns_max and message_tokens_max >= 1")
        require(self.gap_s_median > 0 and self.warmup_s >= 0 and self.decode_s_per_token >= 0,
                "gap_s_median must be > 0, warmup_s and decode_s_per_token >= 0")
        require(min(self.first_input_tokens_sigma, self.gap_s_sigma, self.message_tokens_sigma,
                    self.attachment_tokens_sigma, self.output_tokens_sigma) >= 0, "sigmas must be >= 0")
        require(self.output_tokens_median <= self.output_tokens_max, "output_tokens_median > output_tokens_max")
        require(self.system_prompt_tokens < self.max_context_tokens,
                "system_prompt_tokens must be below max_context_tokens")

    def turns(self, rng: random.Random, requests: int, block: int) -> list[Turn]:
        mint = IdMint()
        system = Prompt().extended(self.system_prompt_tokens, block, mint)

        def output() -> int:
            return lognormal_int(rng, self.output_tokens_median, self.output_tokens_sigma, 1,
                                 self.output_tokens_max)

        def start(t: float, session: int, _key: object) -> Turn:
            first = lognormal_int(rng, self.first_input_tokens_median, self.first_input_tokens_sigma,
                                  system.length + 1, self.max_context_tokens)
            return Turn(t, system.extended(first - system.length, block, mint), output(), session, 1)

        def follow(turn: Turn) -> Turn | None:
            turn_no = turn.state
            if turn_no >= self.turns_max or rng.random() >= self.continue_probability:
                return None
            if rng.random() < self.attachment_probability:
                message = lognormal_int(rng, self.attachment_tokens_median, self.attachment_tokens_sigma, 1,
                                        self.max_context_tokens)
            else:
                message = lognormal_int(rng, self.message_tokens_median, self.message_tokens_sigma, 1,
                                        self.message_tokens_max)
            add = turn.output_tokens + message
            if turn.prompt.length + add > self.max_context_tokens:
                return None
            gap = max(lognormal(rng, self.gap_s_median, self.gap_s_sigma),
                      turn.output_tokens * self.decode_s_per_token)
            return Turn(turn.arrival_s + gap, turn.prompt.extended(add, block, mint), output(),
                        turn.session, turn_no + 1)

        clock = poisson_clock(rng, self.session_rate_per_s, start_s=-self.warmup_s)
        return run_sessions(requests, next_start=clock, start=start, follow=follow)
