"""The engine's own OpenAI API, as the doctor uses it: one answer's usage and timing.

Requests ask for one output token (``max_tokens: 1``): the prompt is what is
being checked. ``cached_tokens`` is ``usage.prompt_tokens_details.cached_tokens``
(None when the engine does not report it: vLLM without
``--enable-prompt-tokens-details``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from tokenspeed_router.gateway.http1 import Http1Pool, UpstreamError

__all__ = ["Answer", "EngineApi", "EngineApiError"]


class EngineApiError(Exception):
    """The engine refused or failed a request (the message says which and why)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """One answered request."""

    sent_s: float
    """``time.monotonic()`` when the request was sent."""
    answered_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    usage: dict[str, Any] | None


def _cached_tokens(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class EngineApi:
    """``POST /v1/completions`` and ``/v1/chat/completions`` of one engine (``url``)."""

    def __init__(self, pool: Http1Pool, url: str, *, model: str | None,
                 timeout_s: float, headers: dict[str, str] | None = None) -> None:
        self._pool = pool
        self.url = url.rstrip("/")
        self.model = model
        self._timeout_s = timeout_s
        self._headers = headers or {}

    async def first_model(self) -> str | None:
        """The first model ``GET /v1/models`` lists (None if the engine does not say)."""
        try:
            status, raw = await self._pool.fetch(b"GET", self.url, "/v1/models", timeout_s=self._timeout_s)
            data = json.loads(raw) if status == 200 else None
        except (UpstreamError, OSError, ValueError):
            return None
        models = data.get("data") if isinstance(data, dict) else None
        if isinstance(models, list) and models and isinstance(models[0], dict):
            model = models[0].get("id")
            return model if isinstance(model, str) else None
        return None

    async def complete(self, prompt: str | list[int], *, dp_rank: int | None = None) -> Answer:
        """``dp_rank``: send it to that data-parallel rank (vLLM's ``X-data-parallel-rank`` header)."""
        headers = None if dp_rank is None else {"x-data-parallel-rank": str(dp_rank)}
        return await self._post("/v1/completions", {"prompt": prompt, "max_tokens": 1}, headers)

    async def chat(self, messages: list[dict[str, Any]]) -> Answer:
        return await self._post("/v1/chat/completions", {"messages": messages, "max_tokens": 1})

    async def _post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Answer:
        body = {**body, "stream": False, "temperature": 0}
        if self.model is not None:
            body["model"] = self.model
        sent = time.monotonic()
        try:
            status, raw = await self._pool.fetch(b"POST", self.url, path, json.dumps(body).encode(),
                                                 {**self._headers, **(headers or {})}, timeout_s=self._timeout_s)
        except (UpstreamError, OSError) as err:
            raise EngineApiError(f"POST {self.url}{path}: {type(err).__name__}: {err}") from err
        answered = time.monotonic()
        if status != 200:
            raise EngineApiError(f"POST {self.url}{path} answered {status}: {raw[:300]!r}")
        try:
            data = json.loads(raw)
        except ValueError as err:
            raise EngineApiError(f"POST {self.url}{path} answered invalid JSON") from err
        usage = data.get("usage") if isinstance(data, dict) else None
        usage = usage if isinstance(usage, dict) else None
        prompt_tokens = usage.get("prompt_tokens") if usage is not None else None
        return Answer(
            sent_s=sent, answered_s=answered,
            prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
            cached_tokens=_cached_tokens(usage), usage=usage,
        )
