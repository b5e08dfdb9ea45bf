"""One timed request: send a body, read the SSE stream, record what happened.

Times are taken on the event loop's monotonic clock when bytes arrive:

* ``ttft_s`` — from sending to the first chunk that carries a choice (a token);
* ``itl_s`` — the gaps between successive token-carrying chunks;
* ``e2e_s`` — from sending to the end of the stream;
* ``engine_ttft_s`` — the engine's own TTFT, when it reports one
  (engine-sim's ``engine_timing.ttft_s``, beside ``usage``), so ``router_added_s`` =
  ``ttft_s - engine_ttft_s`` is what everything between the client and the
  engine added: the router, the network, the load generator's own loop.

The worker that served the request is read, in this order, from the
``x-tokenspeed-worker`` header (our gateway), the ``x-engine-id`` header
(engine-sim), or the ``system_fingerprint`` of the chunks (engine-sim puts its
name there, which survives peers' proxies that drop headers).

Nothing here raises on a bad answer: HTTP errors, broken streams, SSE error
events and timeouts become ``error`` strings on the record, counted by the
report; a load generator that dies on the first 503 measures nothing.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["RequestRecord", "send_request"]

WORKER_HEADERS = ("x-tokenspeed-worker", "x-engine-id")


@dataclass(slots=True)
class RequestRecord:
    """What one request measured (seconds; ``None`` where it never happened)."""

    index: int
    request_id: str
    scheduled_s: float
    input_length: int
    max_tokens: int
    sent_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    engine_ttft_s: float | None = None
    #: the engine's TTFT in its timing model's seconds (engine-sim: immune to its own loop's lateness)
    engine_modelled_ttft_s: float | None = None
    worker: str | None = None
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def router_added_s(self) -> float | None:
        """Client TTFT minus the engine's own TTFT (None unless both are known)."""
        if self.ttft_s is None or self.engine_ttft_s is None:
            return None
        return self.ttft_s - self.engine_ttft_s

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready row (inter-token gaps summarised, not listed)."""
        gaps = self.itl_s
        return {
            "index": self.index,
            "request_id": self.request_id,
            "scheduled_s": round(self.scheduled_s, 6),
            "sent_s": None if self.sent_s is None else round(self.sent_s, 6),
            "input_length": self.input_length,
            "max_tokens": self.max_tokens,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "itl_mean_s": sum(gaps) / len(gaps) if gaps else None,
            "output_chunks": self.output_chunks,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "engine_ttft_s": self.engine_ttft_s,
            "engine_modelled_ttft_s": self.engine_modelled_ttft_s,
            "router_added_s": self.router_added_s,
            "worker": self.worker,
            "status": self.status,
            "error": self.error,
        }


def _read_usage(record: RequestRecord, usage: Any, timing: Any = None) -> None:
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("prompt_tokens"), int):
        record.prompt_tokens = usage["prompt_tokens"]
    if isinstance(usage.get("completion_tokens"), int):
        record.completion_tokens = usage["completion_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        record.cached_tokens = details["cached_tokens"]
    if isinstance(timing, dict):
        if isinstance(timing.get("ttft_s"), (int, float)):
            record.engine_ttft_s = float(timing["ttft_s"])
        if isinstance(timing.get("modelled_ttft_s"), (int, float)):
            record.engine_modelled_ttft_s = float(timing["modelled_ttft_s"])


def _error_text(payload: Any) -> str:
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err if err is not None else payload)[:300]


class _StreamReader:
    """Folds SSE ``data:`` payloads into a record, timing token chunks.

    The load generator is the measuring instrument, so it must stay cheap:
    at 10k streamed tokens a second, decoding every chunk's JSON is a large
    share of a core on a busy machine, and a late loop inflates every TTFT
    it measures (for every router alike). So after the first token only the
    chunks that can say something new are decoded (usage, errors, anything
    that is not plainly a token); plain token chunks are counted and timed.
    """

    def __init__(self, record: RequestRecord, loop: asyncio.AbstractEventLoop, t_sent: float) -> None:
        self.record = record
        self._loop = loop
        self._t_sent = t_sent
        self._last_token_t: float | None = None
        self.done = False

    def feed_line(self, line: bytes) -> None:
        """One SSE line (bytes, without its newline)."""
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if (self.record.ttft_s is not None and data.startswith(b"{") and b'"choices":[{' in data
                and b'"usage"' not in data and b'"error"' not in data):
            self._token(self._loop.time())  # a plain token chunk after the first: count, time
            return
        self.feed(data.decode("utf-8", "replace"))

    def _token(self, now: float) -> None:
        rec = self.record
        rec.output_chunks += 1
        if rec.ttft_s is None:
            rec.ttft_s = now - self._t_sent
        elif self._last_token_t is not None:
            rec.itl_s.append(now - self._last_token_t)
        self._last_token_t = now

    def feed(self, data: str) -> None:
        rec = self.record
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            rec.error = rec.error or f"undecodable SSE data: {data[:120]!r}"
            return
        if not isinstance(chunk, dict):
            rec.error = rec.error or f"SSE data is not an object: {data[:120]!r}"
            return
        if "error" in chunk:
            rec.error = rec.error or f"stream error: {_error_text(chunk)}"
            return
        now = self._loop.time()
        if rec.worker is None and isinstance(chunk.get("system_fingerprint"), str):
            rec.worker = chunk["system_fingerprint"]
        _read_usage(rec, chunk.get("usage"), chunk.get("engine_timing"))
        choices = chunk.get("choices")
        if isinstance(choices, list) and choices:
            self._token(now)


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    record: RequestRecord,
    *,
    start_t: float,
    stream: bool = True,
) -> RequestRecord:
    """POST ``body`` to ``url`` and fill ``record``; never raises for a bad answer.

    ``start_t`` is the run's origin on the loop clock (``sent_s`` is relative
    to it). A non-streamed answer is timed as one chunk (TTFT = e2e).
    """
    loop = asyncio.get_running_loop()
    t_sent = loop.time()
    record.sent_s = t_sent - start_t
    try:
        async with client.stream(
            "POST", url, content=body, headers={"content-type": "application/json"}
        ) as resp:
            record.status = resp.status_code
            for name in WORKER_HEADERS:
                if resp.headers.get(name):
                    record.worker = resp.headers[name]
                    break
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                try:
                    detail = _error_text(json.loads(text))
                except ValueError:
                    detail = text[:300]
                record.error = f"HTTP {resp.status_code}: {detail}"
                return record
            if stream:
                reader = _StreamReader(record, loop, t_sent)
                rest = b""
                async for piece in resp.aiter_bytes():
                    if b"\n" not in piece:
                        rest += piece
                        continue
                    *lines, rest = (rest + piece).split(b"\n")
                    for line in lines:
                        reader.feed_line(line.rstrip(b"\r"))
                if rest:
                    reader.feed_line(rest.rstrip(b"\r"))
                if not reader.done and record.error is None:
                    record.error = "stream ended without [DONE]"
            else:
                payload = json.loads(await resp.aread())
                record.ttft_s = loop.time() - t_sent
                record.output_chunks = 1
                if record.worker is None and isinstance(payload.get("system_fingerprint"), str):
                    record.worker = payload["system_fingerprint"]
                _read_usage(record, payload.get("usage"), payload.get("engine_timing"))
    except httpx.TimeoutException as err:
        record.error = f"timeout: {type(err).__name__}"
    except httpx.HTTPError as err:
        record.error = f"{type(err).__name__}: {err}"[:300]
    except ValueError as err:
        record.error = f"bad answer: {err}"[:300]
    record.e2e_s = loop.time() - t_sent
    return record
