"""What the router computes for a canary: its tokens, and its prediction from the index.

Two sources, one interface (:class:`RouterView`):

* :class:`LocalView` (``doctor --worker SPEC... --tokenizer engine|PATH``):
  the gateway's own tokenizer classes (the same ``--tokenizer`` choice a
  ``serve`` would make) and the watcher's :class:`KvIndex`, fed by the
  router's own subscriber code;
* :class:`RouterHttpView` (``doctor --router URL``): the running router
  itself, through ``POST /doctor/expect`` (its tokenizer, against that
  worker's engine) and ``POST /match`` (its live index).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from tokenspeed_router.doctor.watcher import Watcher
from tokenspeed_router.gateway.http1 import Http1Pool, UpstreamError
from tokenspeed_router.gateway.tokenize import PromptTokenizer, TokenizeError

__all__ = ["LocalView", "Prediction", "RouterHttpView", "RouterView", "ViewError"]

#: (matched leading blocks, that stream's block size or None when it never stored a block)
Prediction = tuple[int, int | None]


class ViewError(Exception):
    """The router (or the tokenizer) could not answer; the message says why."""


class RouterView(Protocol):
    description: str

    async def text_tokens(self, worker: str, url: str | None, text: str) -> list[int]: ...

    async def chat_tokens(self, worker: str, url: str | None, messages: list[dict[str, Any]]) -> list[int]: ...

    async def prediction(self, stream: str, token_ids: list[int]) -> Prediction: ...


class LocalView:
    """The ``--tokenizer`` in this process, and the watcher's index."""

    def __init__(self, tokenizer: PromptTokenizer, setting: str, watcher: Watcher, model: str | None) -> None:
        self._tokenizer = tokenizer
        self._watcher = watcher
        self._model = model
        self.description = f"--tokenizer {setting}"

    def _body(self, **fields: Any) -> dict[str, Any]:
        return {**fields, **({"model": self._model} if self._model is not None else {})}

    async def text_tokens(self, worker: str, url: str | None, text: str) -> list[int]:
        try:
            return await self._tokenizer.completion_tokens(text, self._body(prompt=text), url)
        except TokenizeError as err:
            raise ViewError(str(err)) from err

    async def chat_tokens(self, worker: str, url: str | None, messages: list[dict[str, Any]]) -> list[int]:
        try:
            return await self._tokenizer.chat_tokens(self._body(messages=messages), url)
        except TokenizeError as err:
            raise ViewError(str(err)) from err

    async def prediction(self, stream: str, token_ids: list[int]) -> Prediction:
        detail = self._watcher.match(token_ids)
        return detail.scores.get(stream, 0), detail.block_size.get(stream)


class RouterHttpView:
    """A running router: ``POST /doctor/expect`` and ``POST /match``."""

    def __init__(self, pool: Http1Pool, url: str, *, headers: dict[str, str],
                 timeout_s: float) -> None:
        self._pool = pool
        self._url = url.rstrip("/")
        self._headers = headers
        self._timeout_s = timeout_s
        self.description = f"the router at {self._url} (its --tokenizer)"

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            status, raw = await self._pool.fetch(b"POST", self._url, path, json.dumps(body).encode(), self._headers,
                                                 timeout_s=self._timeout_s)
            data = json.loads(raw)
        except (UpstreamError, OSError, ValueError) as err:
            raise ViewError(f"POST {self._url}{path}: {type(err).__name__}: {err}") from err
        if status != 200 or not isinstance(data, dict):
            raise ViewError(f"POST {self._url}{path} answered {status}: {str(data)[:300]}")
        return data

    async def _tokens(self, body: dict[str, Any]) -> list[int]:
        data = await self._post("/doctor/expect", body)
        tokens = data.get("token_ids")
        if not isinstance(tokens, list):
            raise ViewError("POST /doctor/expect answered without token_ids")
        return tokens

    async def text_tokens(self, worker: str, url: str | None, text: str) -> list[int]:
        return await self._tokens({"worker": worker, "prompt": text})

    async def chat_tokens(self, worker: str, url: str | None, messages: list[dict[str, Any]]) -> list[int]:
        return await self._tokens({"worker": worker, "messages": messages})

    async def prediction(self, stream: str, token_ids: list[int]) -> Prediction:
        data = await self._post("/match", {"token_ids": token_ids})
        scores = data.get("scores") or {}
        sizes = data.get("block_size") or {}
        return int(scores.get(stream, 0)), sizes.get(stream)
