"""Open-loop replay of trace requests against an OpenAI-compatible endpoint.

Open loop: request *i* is sent at ``arrival_s[i]`` after the start whether or
not earlier requests have answered, as users do; a closed loop (wait, then
send) hides queueing, which is exactly what a router changes. Each request is
its own asyncio task on one ``httpx.AsyncClient`` (pooled keep-alive
connections). The next body is encoded *before* sleeping until its arrival
time, so building a 40k-token prompt does not delay the send; how late sends
still were is reported (``max_send_lateness_s``): a loaded load generator
must say so rather than silently turn the trace into a slower one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import msgspec

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.loadgen.client import RequestRecord, send_request
from tokenspeed_router.loadgen.prompts import PromptBuilder
from tokenspeed_router.sim.traces import TraceRequest

__all__ = [
    "ReplayConfig",
    "ReplayOutcome",
    "completions_url",
    "discover_model",
    "fetch_model",
    "replay",
    "replay_async",
    "warm_up",
]

logger = logging.getLogger(__name__)

#: ``progress(done, total, note)``, e.g. :class:`tokenspeed_router.sim.runner.ProgressBar`.
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """Where to send and how patiently.

    ``extra_targets``: more endpoints of the same service (router replicas);
    request *i* goes to target ``i mod n``, so replicas split the traffic.
    ``pinned``: instead, request *i* goes to target ``pinned[i]`` (replaying
    another run's placement, e.g. straight to the engines a router chose).
    """

    target: str
    extra_targets: tuple[str, ...] = ()
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_connections: int = 1024
    pinned: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(not 0 <= p < len(self.targets) for p in self.pinned):
            raise ConfigError(f"pinned target indices must be in [0, {len(self.targets)})")
        for target in self.targets:
            if not target.startswith(("http://", "https://")):
                raise ConfigError(f"target must be an http(s) URL, got {target!r}")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ConfigError("timeouts must be > 0")
        if self.max_connections < 1:
            raise ConfigError(f"max_connections must be >= 1, got {self.max_connections}")

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.target, *self.extra_targets)


@dataclass
class ReplayOutcome:
    records: list[RequestRecord]
    wall_s: float
    max_send_lateness_s: float = 0.0
    model: str = ""
    extra: dict[str, object] = field(default_factory=dict)


def _base(target: str) -> str:
    base = target.rstrip("/")
    for suffix in ("/v1/completions", "/v1"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def completions_url(target: str) -> str:
    """``http://host:port`` (or ``.../v1``, ``.../v1/completions``) -> the completions URL."""
    return _base(target) + "/v1/completions"


def _client(config: ReplayConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
        limits=httpx.Limits(max_connections=config.max_connections,
                            max_keepalive_connections=config.max_connections),
    )


async def fetch_model(client: httpx.AsyncClient, target: str) -> str:
    """The first model id of ``GET /v1/models`` (raises ConfigError when there is none)."""
    url = _base(target) + "/v1/models"
    try:
        resp = await client.get(url)
        resp.raise_for_status()
        data = resp.json().get("data") or []
        model = data[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
        raise ConfigError(f"cannot read a model from {url} ({err}); pass --model") from err
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{url} answered no usable model id; pass --model")
    return model


async def replay_async(
    requests: Sequence[TraceRequest],
    builder: PromptBuilder,
    config: ReplayConfig,
    *,
    progress: Progress | None = None,
) -> ReplayOutcome:
    """Send every request at its arrival time; wait for all; return the records."""
    loop = asyncio.get_running_loop()
    urls = [completions_url(t) for t in config.targets]
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[RequestRecord]] = []
    done = errors = 0
    total = len(requests)
    lateness = 0.0

    def finished(task: asyncio.Task[RequestRecord]) -> None:
        nonlocal done, errors
        done += 1
        if task.cancelled() or task.exception() is not None or not task.result().ok:
            errors += 1
        if progress is not None:
            progress(done, total, f"in flight {len(tasks) - done}, errors {errors}")

    async with _client(config) as client:
        start = loop.time()
        for i, req in enumerate(requests):
            body = builder.encode(req)
            record = RequestRecord(index=i, request_id=req.request_id, scheduled_s=req.arrival_s,
                                   input_length=req.input_length, max_tokens=builder.max_tokens(req))
            records.append(record)
            delay = start + req.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                lateness = max(lateness, -delay)
            url = urls[config.pinned[i]] if i < len(config.pinned) else urls[i % len(urls)]
            task = loop.create_task(send_request(client, url, body, record, start_t=start,
                                                 stream=builder.config.stream))
            task.add_done_callback(finished)
            tasks.append(task)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        wall_s = loop.time() - start
    for task, record in zip(tasks, records, strict=True):
        if not task.cancelled() and task.exception() is not None:
            record.error = record.error or f"loadgen error: {task.exception()!r}"[:300]
    if progress is not None and total == 0:
        progress(0, 0, "")
    return ReplayOutcome(records=records, wall_s=wall_s, max_send_lateness_s=lateness,
                         model=builder.config.model)


def replay(
    requests: Sequence[TraceRequest],
    builder: PromptBuilder,
    config: ReplayConfig,
    *,
    progress: Progress | None = None,
) -> ReplayOutcome:
    """Blocking wrapper of :func:`replay_async` (runs its own event loop)."""
    return asyncio.run(replay_async(requests, builder, config, progress=progress))


async def _warm_up(config: ReplayConfig, model: str, requests: int, text: bool) -> int:
    urls = [completions_url(t) for t in config.targets]
    failed = 0
    async with _client(config) as client:
        loop = asyncio.get_running_loop()
        for i in range(requests):
            # short prompts of their own token ids (no trace prefix), two tokens each
            ids = [7, 11, 13, 17 + i] * 8
            prompt: object = " ".join(map(str, ids)) if text else ids
            body = msgspec.json.encode({"model": model, "prompt": prompt, "max_tokens": 2,
                                        "stream": True, "stream_options": {"include_usage": True}})
            record = RequestRecord(index=-1, request_id=f"warm-up-{i}", scheduled_s=0.0, input_length=32,
                                   max_tokens=2)
            await send_request(client, urls[i % len(urls)], body, record, start_t=loop.time())
            failed += not record.ok
    return failed


def warm_up(config: ReplayConfig, model: str, *, requests: int = 8, text: bool = False) -> int:
    """Send ``requests`` short requests one at a time, before a measured replay; returns failures.

    A fresh router, engine or client pays one-time costs on its first
    requests (lazy imports, the first tensor operations, connection pools),
    up to hundreds of milliseconds on a loaded machine: measured, they would
    be the p99 of a short run. The prompts share nothing with a trace's;
    ``text`` writes them as digit words (the ``text`` prompt format).
    """
    return asyncio.run(_warm_up(config, model, requests, text))


async def _model_of(config: ReplayConfig) -> str:
    async with _client(config) as client:
        return await fetch_model(client, config.target)


def discover_model(config: ReplayConfig) -> str:
    """Blocking :func:`fetch_model` for the CLI."""
    return asyncio.run(_model_of(config))
