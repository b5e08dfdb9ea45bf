"""Trace requests -> OpenAI ``/v1/completions`` request bodies.

A Mooncake trace publishes no text, only ``hash_ids``: one id per block of
``block_tokens`` (512) prompt tokens, chained over the prefix. The prompt's
token ids come from :class:`~tokenspeed_router.sim.traces.TokenSynthesizer`
(the simulator's own expansion, one definition): the same hash id gives the
same tokens in every request, process and run, so a prefix shared in the
trace is a real shared prefix at any engine block size; the last block keeps
its first ``input_length - block_tokens * (n - 1)`` tokens.

Two prompt formats:

* ``tokens`` — ``prompt`` is the list of ints (vLLM and SGLang accept it, and
  a router hashes exactly what the engine caches);
* ``text`` — the same ids written as space-separated decimal words. The
  engine simulator's tokenizer maps a word of digits back to that id, so the
  engine caches the same tokens while a router that only looks at text
  (sglang-router's ``cache_aware``) sees a shared text prefix too. A real
  model's tokenizer would not give these ids back: ``text`` is for engine-sim.

:func:`scale_prompts` shrinks every hash id to fewer tokens (``0.125``: 512
-> 64), input lengths alike: the sharing structure is unchanged while every
process moves 8x fewer token ids, which lets a 2-core machine replay a trace
at a rate where routing matters. Scale the engines' cache capacity and
prefill rate by the same factor and the modelled timings are unchanged.

``max_tokens`` is the trace's ``output_length`` (at least 1; optionally
capped), ``ignore_eos`` asks vLLM-style engines to generate exactly that many
tokens, and ``stream_options.include_usage`` makes the engine report
``cached_tokens``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import msgspec
import numpy as np

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.sim.traces import TokenSynthesizer, TraceRequest

__all__ = ["PromptBuilder", "PromptConfig", "PromptFormat", "scale_prompts"]


class PromptFormat(str, enum.Enum):
    """How a prompt's token ids are written into the request body."""

    TOKENS = "tokens"
    TEXT = "text"


@dataclass(frozen=True, kw_only=True)
class PromptConfig:
    """What every request body carries besides its prompt."""

    model: str
    prompt_format: PromptFormat | str = PromptFormat.TOKENS
    #: Cap on ``max_tokens`` (None: the trace's ``output_length`` as is).
    max_output_tokens: int | None = None
    #: vLLM/SGLang extension: generate exactly ``max_tokens`` tokens.
    ignore_eos: bool = True
    stream: bool = True
    #: Key of the token synthesizer: runs with different keys share no tokens.
    token_key: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_format", PromptFormat(self.prompt_format))
        if not self.model:
            raise ConfigError("model must be a non-empty string")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ConfigError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")


class PromptBuilder:
    """Builds request bodies for trace requests (pure; no I/O)."""

    def __init__(self, config: PromptConfig, *, synthesizer: TokenSynthesizer | None = None) -> None:
        self.config = config
        self._synth = synthesizer or TokenSynthesizer(key=config.token_key)
        self._encoder = msgspec.json.Encoder()

    def token_ids(self, request: TraceRequest) -> np.ndarray:
        """The ``input_length`` prompt token ids of ``request`` (int64)."""
        return self._synth.tokens(request)

    def max_tokens(self, request: TraceRequest) -> int:
        cap = self.config.max_output_tokens
        n = max(1, request.output_length)
        return n if cap is None else min(n, cap)

    def body(self, request: TraceRequest) -> dict[str, object]:
        """The ``/v1/completions`` JSON body as a dict."""
        ids = self.token_ids(request).tolist()
        prompt: object = ids if self.config.prompt_format is PromptFormat.TOKENS else " ".join(map(str, ids))
        out: dict[str, object] = {
            "model": self.config.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens(request),
            "stream": self.config.stream,
        }
        if self.config.stream:
            out["stream_options"] = {"include_usage": True}
        if self.config.ignore_eos:
            out["ignore_eos"] = True
        return out

    def encode(self, request: TraceRequest) -> bytes:
        """The body as JSON bytes, ready to send."""
        return self._encoder.encode(self.body(request))


def scale_prompts(requests: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Requests whose hash ids cover ``factor`` times as many tokens.

    ``block_tokens * factor`` must be a whole number (512 * 0.125 = 64), so
    block boundaries stay where they were; each last (partial) block keeps its
    share, rounded up (at least one token).
    """
    if not 0 < factor <= 1:
        raise ConfigError(f"prompt scale must be in (0, 1], got {factor}")
    out: list[TraceRequest] = []
    for r in requests:
        scaled = r.block_tokens * factor
        block = round(scaled)
        if block < 1 or abs(scaled - block) > 1e-9:
            raise ConfigError(f"prompt scale {factor} turns {r.block_tokens}-token hash blocks into "
                              f"{scaled:g} tokens; choose a factor that gives a whole number")
        n = len(r.hash_ids)
        last = min(block, max(1, math.ceil(r.block_length(n - 1) * factor))) if n else 0
        length = (n - 1) * block + last if n else 0
        out.append(replace(r, block_tokens=block, input_length=length))
    return out
