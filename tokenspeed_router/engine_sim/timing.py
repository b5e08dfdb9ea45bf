"""The engine simulator's timing model: how long one scheduler step takes.

The engine runs a loop of steps, like vLLM's scheduler with chunked prefill:

* Each step has a token budget, ``max_batched_tokens`` (default 2048). Every
  running request that is decoding takes one token of it; the rest goes to
  prefill, first come first served, in chunks (a long prompt is prefilled
  over several steps). Requests that get no budget wait (FIFO).
* Only *uncached* prompt tokens are prefilled: a request whose prefix is in
  the prefix cache skips those tokens, so its time to first token is shorter.
  A decode-role engine receiving a remote prefill (P/D) prefills nothing.
* A step costs ``prefill_tokens / prefill_tokens_per_s`` plus, when any
  request is decoding, a decode cost that grows with the running batch:
  ``decode_s_per_token * (1 + decode_batch_cost * (num_decoding - 1))``.
* A request's first token comes out at the end of the step that finishes its
  prefill; each later step yields one more token.
* ``time_scale`` K divides every modelled duration (K=10 runs ten times
  faster than modelled); K=0 (or ``--instant``) makes steps take no time,
  which measures everything around the engine (a router's overhead).

The model is deliberately small: it ignores attention cost growing with
context length and the KV memory that generated tokens take.
"""

from __future__ import annotations

import dataclasses

from tokenspeed_router.errors import ConfigError

__all__ = ["TimingModel"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimingModel:
    """Modelled durations (seconds, before ``time_scale``) of prefill and decode."""

    prefill_tokens_per_s: float = 20_000.0
    decode_s_per_token: float = 0.02
    decode_batch_cost: float = 0.02
    max_batched_tokens: int = 2048
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ConfigError(f"prefill_tokens_per_s must be positive, got {self.prefill_tokens_per_s}")
        if self.decode_s_per_token < 0 or self.decode_batch_cost < 0:
            raise ConfigError("decode_s_per_token and decode_batch_cost must be >= 0")
        if self.max_batched_tokens <= 0:
            raise ConfigError(f"max_batched_tokens must be positive, got {self.max_batched_tokens}")
        if self.time_scale < 0:
            raise ConfigError(f"time_scale must be >= 0 (0 = instant), got {self.time_scale}")

    @property
    def instant(self) -> bool:
        return self.time_scale == 0

    def step_s(self, num_prefill_tokens: int, num_decoding: int) -> float:
        """Wall-clock seconds of one step (already divided by ``time_scale``; 0 when instant)."""
        if self.instant:
            return 0.0
        modelled = num_prefill_tokens / self.prefill_tokens_per_s
        if num_decoding > 0:
            modelled += self.decode_s_per_token * (1.0 + self.decode_batch_cost * (num_decoding - 1))
        return modelled / self.time_scale
