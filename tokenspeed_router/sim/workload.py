"""Synthetic workloads with known prefix structure, for a seed.

Three request families, mixed by weight, arriving as a Poisson process:

* **system-prompt** requests: one of ``num_system_prompts`` shared prompts
  (SGLang ``generated-shared-prefix`` style) plus a short unique question;
* **chats**: multi-turn sessions; turn t's prompt is turn t-1's prompt + its
  answer + a new user message, the next turn arriving after a think time;
* **agent loops**: like chats, but turns come back fast (tool latency) and
  append long tool outputs, so context grows quickly.

Each session starts from a shared system prompt. Requests are emitted in the
same :class:`~tokenspeed_router.sim.traces.TraceRequest` form as the Mooncake
loader (prefix-chained block ids), so the simulator has one input type. A new
block id is minted whenever a block's content changes (including the block
that straddles the end of the previous turn), which keeps prefix semantics
exact. The RNG is a ``random.Random(seed)`` owned by the generator.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.sim.traces import TraceRequest

__all__ = ["WorkloadConfig", "generate_workload"]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadConfig:
    """Knobs of :func:`generate_workload` (defaults: a mixed chat/agent load).

    Lengths are in tokens, times in seconds. ``block_tokens`` is the id
    granularity; 64 lets sharing be finer than Mooncake's 512.
    ``session_rate_per_s`` is the arrival rate of *new sessions*; follow-up
    turns of chats and agent loops come on top, so the request rate is
    several times higher (see :func:`~tokenspeed_router.sim.traces.trace_summary`).
    """

    num_requests: int = 2000
    session_rate_per_s: float = 1.0
    seed: int = 0
    block_tokens: int = 64
    weight_system_prompt: float = 0.4
    weight_chat: float = 0.4
    weight_agent: float = 0.2
    num_system_prompts: int = 16
    system_prompt_tokens: int = 3000
    question_tokens: int = 300
    answer_tokens: int = 250
    chat_turns: int = 6
    chat_think_s: float = 30.0
    agent_steps: int = 12
    agent_tool_tokens: int = 1500
    agent_step_s: float = 2.0

    def __post_init__(self) -> None:
        if self.num_requests <= 0 or self.session_rate_per_s <= 0 or self.block_tokens <= 0:
            raise ConfigError("num_requests, session_rate_per_s and block_tokens must be > 0")
        weights = (self.weight_system_prompt, self.weight_chat, self.weight_agent)
        if min(weights) < 0 or sum(weights) <= 0:
            raise ConfigError(f"workload weights must be >= 0 and not all 0, got {weights}")


class _Prompt:
    """A growing prompt: block ids plus length, minting ids on change."""

    __slots__ = ("ids", "length")

    def __init__(self, ids: list[int], length: int) -> None:
        self.ids = ids
        self.length = length

    def extended(self, add: int, block: int, mint: list[int]) -> _Prompt:
        ids = list(self.ids)
        length = self.length
        if length % block and ids:
            ids.pop()  # the straddling block gets new content, hence a new id
        new_len = length + add
        while len(ids) * block < new_len:
            mint[0] += 1
            ids.append(mint[0])
        return _Prompt(ids, new_len)


def generate_workload(config: WorkloadConfig) -> list[TraceRequest]:
    """Generate ``config.num_requests`` requests sorted by arrival time."""
    rng = random.Random(config.seed)
    block = config.block_tokens
    mint = [0]
    systems = [_Prompt([], 0).extended(config.system_prompt_tokens, block, mint)
               for _ in range(config.num_system_prompts)]
    kinds = ["system", "chat", "agent"]
    weights = [config.weight_system_prompt, config.weight_chat, config.weight_agent]
    # (arrival, order, prompt, remaining turns, kind)
    heap: list[tuple[float, int, _Prompt, int, str, int]] = []
    order = 0
    t = 0.0
    sessions = 0
    out: list[TraceRequest] = []

    def jitter(mean: int) -> int:
        return max(1, int(rng.expovariate(1.0 / mean)))

    while len(out) < config.num_requests:
        t += rng.expovariate(config.session_rate_per_s)
        # Release follow-up turns that are due before the next new session.
        while heap and heap[0][0] <= t and len(out) < config.num_requests:
            arr, _, prompt, left, kind, out_len = heapq.heappop(heap)
            out.append(_request(len(out), arr, prompt, out_len, block))
            if left > 1:
                gap = rng.expovariate(1.0 / (config.chat_think_s if kind == "chat" else config.agent_step_s))
                add = out_len + (jitter(config.question_tokens) if kind == "chat"
                                 else jitter(config.agent_tool_tokens))
                order += 1
                heapq.heappush(heap, (arr + gap, order, prompt.extended(add, block, mint),
                                      left - 1, kind, jitter(config.answer_tokens)))
        if len(out) >= config.num_requests:
            break
        kind = rng.choices(kinds, weights)[0]
        sessions += 1
        system = systems[rng.randrange(len(systems))]
        prompt = system.extended(jitter(config.question_tokens), block, mint)
        turns = {"system": 1, "chat": config.chat_turns, "agent": config.agent_steps}[kind]
        order += 1
        heapq.heappush(heap, (t, order, prompt, turns, kind, jitter(config.answer_tokens)))
    out.sort(key=lambda r: r.arrival_s)
    return [
        TraceRequest(request_id=f"s{i}", arrival_s=r.arrival_s, input_length=r.input_length,
                     output_length=r.output_length, hash_ids=r.hash_ids, block_tokens=block)
        for i, r in enumerate(out)
    ]


def _request(i: int, arrival: float, prompt: _Prompt, out_len: int, block: int) -> TraceRequest:
    return TraceRequest(request_id=f"s{i}", arrival_s=arrival, input_length=prompt.length,
                        output_length=out_len, hash_ids=tuple(prompt.ids), block_tokens=block)
