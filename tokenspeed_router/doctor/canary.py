"""Canary prompts: unique text no cache holds, and the token-id probe's length.

A canary starts with a random nonce and is made of words that exist nowhere
else (``tsr-doctor-<nonce>-<kind>-<i>``), so its first block cannot hit
anything an engine cached before, and it never matches a real prompt
afterwards: that is how the canary's blocks are kept from polluting routing
(they sit in the engine's cache and the router's index until the engine's
LRU evicts them, and no request can ever match them; the doctor never sends
them through ``/route``, so no load is counted either). No engine API drops
chosen blocks (vLLM's ``/reset_prefix_cache`` drops everything), so they are
marked by uniqueness, not cleaned up.

:data:`PROBE_TOKENS` (1023 = 2**10 - 1) is the token-id probe's length: for
every power-of-two block size up to 512 the full blocks it holds, and the
cached tokens an engine reports for a full hit (``(n - 1) // bs * bs``),
differ, so a reported ``cached_tokens`` names the block size the engine's
cache really uses.
"""

from __future__ import annotations

import random
import secrets
from typing import Any

__all__ = ["PROBE_TOKENS", "Canary"]

PROBE_TOKENS = 1023
#: tokens appended to the probe for the continuation send (the parent-link check)
CONTINUATION_TOKENS = 256


class Canary:
    """The prompts of one engine's checks, all sharing one random nonce."""

    def __init__(self, nonce: str | None = None) -> None:
        self.nonce = nonce or secrets.token_hex(6)

    def words(self, kind: str, count: int) -> list[str]:
        return [f"tsr-doctor-{self.nonce}-{kind}-{i}" for i in range(count)]

    def text(self, kind: str, count: int) -> str:
        """``count`` unique words, the nonce first (so block 0 is unique under any tokenizer)."""
        return " ".join(self.words(kind, count))

    def token_ids(self, kind: str, count: int) -> list[int]:
        """``count`` pseudo-random token ids, fixed by the nonce and ``kind`` (ids every vocabulary has).

        For probes sent as token ids when no tokenizer gave real ones, and for
        the short per-rank canaries.
        """
        rng = random.Random(f"{self.nonce}-{kind}")
        return [rng.randrange(1000, 30000) for _ in range(count)]

    def messages(self, count: int) -> list[dict[str, Any]]:
        """A one-message chat whose content is ``count`` unique words."""
        return [{"role": "user", "content": self.text("chat", count)}]
