"""The ``mixed`` shape: system-prompt requests, chats and agent loops in one stream.

Three request families, mixed by weight, whose sessions start as a Poisson
process:

* **system-prompt** requests: one of ``num_system_prompts`` shared prompts
  (SGLang ``generated-shared-prefix`` style) plus a short unique question;
* **chats**: multi-turn sessions; turn t's prompt is turn t-1's prompt + its
  answer + a new user message, the next turn arriving after a think time;
* **agent loops**: like chats, but turns come back fast (tool latency) and
  append long tool outputs, so context grows quickly.

Each session starts from a shared system prompt. This is the generator
``simulate --trace synthetic`` runs (64-token ids by default, finer sharing
than Mooncake's 512) and the workload of the simulator's and the parity
tests; ``trace --shape mixed`` writes it with 512-token ids. Its defaults are
choices, not fits: the shapes ``agentic``, ``chat`` and ``multitenant`` are
the grounded versions of its three families.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from tokenspeed_router.sim.shapes._core import (
    IdMint,
    Prompt,
    Shape,
    Turn,
    param,
    poisson_clock,
    require,
    run_sessions,
    to_requests,
)
from tokenspeed_router.sim.traces import TraceRequest

__all__ = ["WorkloadConfig", "generate_workload"]

_KINDS = ("system", "chat", "agent")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadConfig(Shape):
    """Knobs of the ``mixed`` shape and :func:`generate_workload` (defaults: a mixed chat/agent load).

    Lengths are in tokens, times in seconds. ``session_rate_per_s`` is the
    arrival rate of *new sessions*; follow-up turns of chats and agent loops
    come on top, so the request rate is several times higher (see
    :func:`~tokenspeed_router.sim.traces.trace_summary`). ``num_requests``,
    ``seed`` and ``block_tokens`` are used by :func:`generate_workload`
    only; ``trace`` passes its own.
    """

    NAME: ClassVar[str] = "mixed"
    SUMMARY: ClassVar[str] = ("system-prompt requests, chats and agent loops mixed by weight "
                              "(the built-in `simulate --trace synthetic` generator)")
    SOURCES: ClassVar[tuple[str, ...]] = (
        "SGLang bench_serving --dataset-name generated-shared-prefix (groups of requests on one "
        "shared system prompt); the chat and agent families are the `chat` and `agentic` shapes' "
        "patterns. Every default here is a choice, not a fit.",
    )
    RATE: ClassVar[str] = "session_rate_per_s"

    num_requests: int = param(2000, "requests generate_workload returns (trace: --requests)")
    session_rate_per_s: float = param(1.0, "new sessions per second, Poisson (1/s)")
    seed: int = param(0, "seed of generate_workload (trace: --seed)")
    block_tokens: int = param(64, "tokens per block id in generate_workload (trace: 512)")
    weight_system_prompt: float = param(0.4, "weight of single system-prompt requests (relative)")
    weight_chat: float = param(0.4, "weight of chat sessions (relative)")
    weight_agent: float = param(0.2, "weight of agent loops (relative)")
    num_system_prompts: int = param(16, "distinct shared system prompts (count)")
    system_prompt_tokens: int = param(3000, "length of each system prompt (tokens)")
    question_tokens: int = param(300, "mean user question, exponential (tokens)")
    answer_tokens: int = param(250, "mean answer, exponential (tokens)")
    chat_turns: int = param(6, "turns of every chat (count)")
    chat_think_s: float = param(30.0, "mean gap between chat turns, exponential (s)")
    agent_steps: int = param(12, "steps of every agent loop (count)")
    agent_tool_tokens: int = param(1500, "mean tool output appended per step, exponential (tokens)")
    agent_step_s: float = param(2.0, "mean gap between agent steps, exponential (s)")

    def __post_init__(self) -> None:
        require(self.num_requests > 0 and self.session_rate_per_s > 0 and self.block_tokens > 0,
                "num_requests, session_rate_per_s and block_tokens must be > 0")
        weights = (self.weight_system_prompt, self.weight_chat, self.weight_agent)
        require(min(weights) >= 0 and sum(weights) > 0,
                f"workload weights must be >= 0 and not all 0, got {weights}")
        require(self.num_system_prompts >= 1 and self.chat_turns >= 1 and self.agent_steps >= 1,
                "num_system_prompts, chat_turns and agent_steps must be >= 1")
        require(min(self.system_prompt_tokens, self.question_tokens, self.answer_tokens,
                    self.agent_tool_tokens) >= 1, "token lengths must be >= 1")
        require(self.chat_think_s > 0 and self.agent_step_s > 0, "chat_think_s and agent_step_s must be > 0")

    def turns(self, rng: random.Random, requests: int, block: int) -> list[Turn]:
        mint = IdMint()
        systems = [Prompt().extended(self.system_prompt_tokens, block, mint)
                   for _ in range(self.num_system_prompts)]
        weights = [self.weight_system_prompt, self.weight_chat, self.weight_agent]

        def jitter(mean: int) -> int:
            return max(1, int(rng.expovariate(1.0 / mean)))

        def start(t: float, session: int, _key: object) -> Turn:
            kind = rng.choices(_KINDS, weights)[0]
            system = systems[rng.randrange(len(systems))]
            prompt = system.extended(jitter(self.question_tokens), block, mint)
            turns = {"system": 1, "chat": self.chat_turns, "agent": self.agent_steps}[kind]
            return Turn(t, prompt, jitter(self.answer_tokens), session, (kind, turns))

        def follow(turn: Turn) -> Turn | None:
            kind, left = turn.state
            if left <= 1:
                return None
            chat = kind == "chat"
            gap = rng.expovariate(1.0 / (self.chat_think_s if chat else self.agent_step_s))
            add = turn.output_tokens + jitter(self.question_tokens if chat else self.agent_tool_tokens)
            return Turn(turn.arrival_s + gap, turn.prompt.extended(add, block, mint),
                        jitter(self.answer_tokens), turn.session, (kind, left - 1))

        return run_sessions(requests, next_start=poisson_clock(rng, self.session_rate_per_s),
                            start=start, follow=follow)


def generate_workload(config: WorkloadConfig) -> list[TraceRequest]:
    """``config.num_requests`` requests sorted by arrival time, ``config.block_tokens`` per id."""
    turns = config.turns(random.Random(config.seed), config.num_requests, config.block_tokens)
    return to_requests(turns, config.block_tokens)
