"""The engine simulator's HTTP surface: the parts of vLLM's OpenAI server that routers use.

Routes (Starlette): ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` answers as SSE, ``data: {...}`` chunks then
``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with
usage), ``POST /tokenize``, ``POST /v1/completions/render``,
``POST /v1/chat/completions/render``, ``GET /v1/models``, ``GET /health``,
``GET /metrics``. Shapes follow vLLM's: ``usage.prompt_tokens_details.
cached_tokens`` is the engine's real prefix-cache hit; ``engine_timing``
(not vLLM's) is the engine's own TTFT, wall and modelled; ``system_fingerprint``
and the ``x-engine-id`` header name the engine that served the request, so a
load generator can see the spread behind any router. Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``.

With several DP ranks, a request goes to the rank named by the
``x-data-parallel-rank`` header, else to the least loaded rank.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenspeed_router.engine_sim.engine import Engine, SimRequest
from tokenspeed_router.engine_sim.tokenizer import ChatTemplateError, SimTokenizer

__all__ = ["ApiError", "EngineSimApp", "create_app"]

DEFAULT_MAX_TOKENS = 16

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An OpenAI-shaped error answer."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=dict(headers or {}))


class EngineSimApp:
    """Request parsing and answer shaping over one or more :class:`Engine` ranks."""

    def __init__(
        self,
        engines: Sequence[Engine],
        tokenizer: SimTokenizer,
        *,
        model: str,
        kv_host: str,
        kv_port: int,
        report_cached_tokens: bool = True,
    ) -> None:
        self.engines = list(engines)
        #: False (``--fault-no-usage-details``): usage without ``prompt_tokens_details``, as vLLM
        #: answers without ``--enable-prompt-tokens-details``
        self.report_cached_tokens = report_cached_tokens
        self.tokenizer = tokenizer
        self.model = model
        self.name = engines[0].config.name
        self.kv_host = kv_host
        self.kv_port = kv_port
        self.created = int(time.time())
        self.headers = {"x-engine-id": self.name}

    # ------------------------------------------------------------------ parsing

    async def body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise ApiError(400, f"request body is not valid JSON: {err}") from err
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
        return body

    def prompt_tokens(self, prompt: Any) -> list[int]:
        """A completions prompt (string, token ids, or a one-element list of either) as token ids."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63 for t in prompt
        ):
            return list(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError(400, "engine-sim serves one prompt per request; got a batch")
        raise ApiError(400, "prompt must be a string, a list of token ids, or a one-element list of those")

    def chat_tokens(
        self, body: Mapping[str, Any], *, default_generation_prompt: bool = True, shown: bool = False
    ) -> list[int]:
        messages = body.get("messages")
        add = body.get("add_generation_prompt", default_generation_prompt)
        try:
            return self.tokenizer.encode_chat(messages or [], add_generation_prompt=bool(add), shown=shown)
        except ChatTemplateError as err:
            raise ApiError(400, str(err)) from err

    def check_prompt(self, tokens: list[int]) -> None:
        if not tokens:
            raise ApiError(400, "the prompt is empty")
        limit = self.engines[0].config.max_model_len
        if len(tokens) > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {len(tokens)} input tokens.",
            )

    @staticmethod
    def max_tokens(body: Mapping[str, Any], *, chat: bool) -> int:
        value = body.get("max_completion_tokens") if chat else None
        if value is None:
            value = body.get("max_tokens")
        if value is None:
            return DEFAULT_MAX_TOKENS
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ApiError(400, f"max_tokens must be a positive integer, got {value!r}")
        return value

    def pick_engine(self, request: Request) -> Engine:
        header = request.headers.get("x-data-parallel-rank")
        if header is not None:
            try:
                return self.engines[int(header)]
            except (ValueError, IndexError) as err:
                raise ApiError(400, f"bad x-data-parallel-rank {header!r}") from err
        return min(self.engines, key=lambda e: len(e.running) + len(e.waiting))

    # ------------------------------------------------------------------ generation

    async def generate(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await self.body(request)
            if chat:
                tokens = self.chat_tokens(body)
            else:
                if "prompt" not in body:
                    raise ApiError(400, "prompt is required")
                tokens = self.prompt_tokens(body["prompt"])
            self.check_prompt(tokens)
            max_tokens = self.max_tokens(body, chat=chat)
            n = body.get("n", 1)
            if n != 1:
                raise ApiError(400, "engine-sim generates one choice per request (n=1)")
            engine = self.pick_engine(request)
            kv = body.get("kv_transfer_params")
            if kv is not None and not isinstance(kv, dict):
                raise ApiError(400, "kv_transfer_params must be an object")
            kv = kv or {}
            role = engine.config.role
            prefill_only = role == "prefill" and bool(kv.get("do_remote_decode"))
            remote_prefill = role == "decode" and bool(kv.get("do_remote_prefill"))
            stream = bool(body.get("stream", False))
            options = body.get("stream_options") or {}
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        except ApiError as err:
            return err.response(self.headers)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        traceparent = request.headers.get("traceparent")
        if traceparent is not None:  # what a tracing engine would parent its spans on
            logger.debug("engine-sim %s: request %s traceparent=%s", self.name, request_id, traceparent)
        sim = SimRequest(
            request_id=request_id,
            prompt=tokens,
            max_tokens=1 if prefill_only else max_tokens,
            prefill_only=prefill_only,
            remote_prefill=remote_prefill,
        )
        engine.submit(sim)
        if stream:
            return StreamingResponse(
                self._sse(engine, sim, chat=chat, include_usage=include_usage),
                media_type="text/event-stream",
                headers=self.headers,
            )
        try:
            text, finish = await self._collect(engine, sim)
        except ApiError as err:
            return err.response(self.headers)
        return JSONResponse(self._full_answer(sim, text, finish, chat=chat), headers=self.headers)

    async def _collect(self, engine: Engine, sim: SimRequest) -> tuple[str, str]:
        pieces: list[str] = []
        try:
            while True:
                kind, value = await sim.output.get()
                if kind == "token":
                    pieces.append(self.tokenizer.output_text(int(str(value))))
                elif kind == "done":
                    return "".join(pieces), str(value)
                else:
                    raise ApiError(500, str(value), "InternalServerError")
        finally:
            engine.abort(sim)

    async def _sse(
        self, engine: Engine, sim: SimRequest, *, chat: bool, include_usage: bool
    ) -> AsyncIterator[bytes]:
        try:
            if chat:
                yield _sse(self._chunk(sim, {"role": "assistant", "content": ""}, None, chat=True))
            while True:
                kind, value = await sim.output.get()
                if kind == "token":
                    text = self.tokenizer.output_text(int(str(value)))
                    delta: Any = {"content": text} if chat else text
                    yield _sse(self._chunk(sim, delta, None, chat=chat))
                elif kind == "done":
                    last = self._chunk(sim, {} if chat else "", str(value), chat=chat)
                    if sim.prefill_only:
                        last["kv_transfer_params"] = self._kv_params(sim)
                    yield _sse(last)
                    break
                else:
                    err = {"error": {"message": str(value), "type": "InternalServerError",
                                     "param": None, "code": 500}}
                    yield _sse(err)
                    break
            if include_usage:
                usage = self._chunk(sim, None, None, chat=chat)
                usage["choices"] = []
                usage["usage"] = self._usage(sim)
                usage["engine_timing"] = _engine_timing(sim)
                yield _sse(usage)
            yield b"data: [DONE]\n\n"
        finally:
            engine.abort(sim)  # no-op once finished; frees the request on client disconnect

    # ------------------------------------------------------------------ shapes

    def _usage(self, sim: SimRequest) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": len(sim.prompt),
            "completion_tokens": sim.num_output,
            "total_tokens": len(sim.prompt) + sim.num_output,
            "prompt_tokens_details": {"cached_tokens": sim.cached_tokens},
        }
        if not self.report_cached_tokens:
            usage["prompt_tokens_details"] = None
        return usage

    def _kv_params(self, sim: SimRequest) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": sim.block_ids,
            "remote_engine_id": self.name,
            "remote_host": self.kv_host,
            "remote_port": self.kv_port,
            "remote_request_id": sim.request_id,
            "tp_size": 1,
        }

    def _head(self, sim: SimRequest, *, chat: bool, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {
            "id": sim.request_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.model,
            "system_fingerprint": self.name,
        }

    def _chunk(self, sim: SimRequest, delta: Any, finish: str | None, *, chat: bool) -> dict[str, Any]:
        out = self._head(sim, chat=chat, chunk=True)
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None}
        out["choices"] = [choice]
        return out

    def _full_answer(self, sim: SimRequest, text: str, finish: str, *, chat: bool) -> dict[str, Any]:
        out = self._head(sim, chat=chat, chunk=False)
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None, "prompt_logprobs": None}
        out["choices"] = [choice]
        out["usage"] = self._usage(sim)
        out["engine_timing"] = _engine_timing(sim)
        out["kv_transfer_params"] = self._kv_params(sim) if sim.prefill_only else None
        return out

    # ------------------------------------------------------------------ token-only endpoints

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await self.body(request)
            if "messages" in body:
                tokens = self.chat_tokens(body, shown=True)
            elif "prompt" in body and isinstance(body["prompt"], str):
                tokens = self.tokenizer.encode(body["prompt"])
            else:
                raise ApiError(400, "tokenize needs a string prompt or chat messages")
        except ApiError as err:
            return err.response(self.headers)
        shown = self.tokenizer.tokenize(tokens)
        return JSONResponse(
            {"count": len(shown), "max_model_len": self.engines[0].config.max_model_len,
             "tokens": shown, "token_strs": None},
            headers=self.headers,
        )

    def _render_one(self, body: Mapping[str, Any], tokens: list[int], prefix: str) -> dict[str, Any]:
        sampling = {k: body[k] for k in ("temperature", "top_p", "top_k", "frequency_penalty",
                                         "presence_penalty", "seed", "stop") if k in body}
        sampling["max_tokens"] = self.max_tokens(body, chat=prefix == "chatcmpl")
        out: dict[str, Any] = {
            "request_id": f"{prefix}-{uuid.uuid4().hex}",
            "token_ids": self.tokenizer.tokenize(tokens),
            "sampling_params": sampling,
            "model": self.model,
            "stream": bool(body.get("stream", False)),
            "stream_options": body.get("stream_options"),
            "token_offsets": None,
        }
        if "kv_transfer_params" in body:
            out["kv_transfer_params"] = body["kv_transfer_params"]
        return out

    async def render_completions(self, request: Request) -> Response:
        """vLLM's ``/v1/completions/render``: a list of token-in requests, one per prompt."""
        try:
            body = await self.body(request)
            prompt = body.get("prompt")
            prompts = prompt if isinstance(prompt, list) and prompt and all(
                isinstance(p, (str, list)) for p in prompt) else [prompt]
            rendered = [self._render_one(body, self.prompt_tokens(p), "cmpl") for p in prompts]
        except ApiError as err:
            return err.response(self.headers)
        return JSONResponse(rendered, headers=self.headers)

    async def render_chat(self, request: Request) -> Response:
        """vLLM's ``/v1/chat/completions/render``: one token-in request."""
        try:
            body = await self.body(request)
            rendered = self._render_one(body, self.chat_tokens(body, shown=True), "chatcmpl")
        except ApiError as err:
            return err.response(self.headers)
        return JSONResponse(rendered, headers=self.headers)

    # ------------------------------------------------------------------ the rest

    async def models(self, request: Request) -> Response:
        limit = self.engines[0].config.max_model_len
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "engine-sim",
                "root": self.model, "parent": None, "max_model_len": limit}
        return JSONResponse({"object": "list", "data": [card]}, headers=self.headers)

    async def health(self, request: Request) -> Response:
        return Response(status_code=200, headers=self.headers)

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            generate_latest(self.registry).decode(), media_type="text/plain; version=0.0.4"
        )

    @property
    def registry(self) -> CollectorRegistry:
        reg = getattr(self, "_registry", None)
        if reg is None:
            reg = CollectorRegistry(auto_describe=False)
            reg.register(_EngineCollector(self))
            self._registry = reg
        return reg


class _EngineCollector(Collector):
    """Reads every engine rank's statistics at scrape time (one source of truth)."""

    def __init__(self, app: EngineSimApp) -> None:
        self.app = app

    def collect(self) -> list[Metric]:
        labels = ["engine", "model_name", "rank"]
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

        def fam(name: str, doc: str, counter: bool) -> CounterMetricFamily | GaugeMetricFamily:
            if name not in families:
                families[name] = (
                    CounterMetricFamily(name, doc, labels=labels)
                    if counter
                    else GaugeMetricFamily(name, doc, labels=labels)
                )
            return families[name]

        for rank, engine in enumerate(self.app.engines):
            s = engine.statistics()
            lv = [self.app.name, self.app.model, str(rank)]
            usage = s.cache_tokens / s.cache_capacity_tokens if s.cache_capacity_tokens else 0.0
            rows: list[tuple[str, str, bool, float]] = [
                ("tokenspeed_engine_sim_requests", "requests finished", True, s.num_finished),
                ("tokenspeed_engine_sim_aborted_requests", "requests aborted", True, s.num_aborted),
                ("tokenspeed_engine_sim_prompt_tokens", "prompt tokens admitted", True, s.prompt_tokens),
                ("tokenspeed_engine_sim_cached_prompt_tokens", "prompt tokens served from the prefix cache",
                 True, s.cached_tokens),
                ("tokenspeed_engine_sim_computed_prompt_tokens", "prompt tokens prefilled", True,
                 s.computed_prompt_tokens),
                ("tokenspeed_engine_sim_generation_tokens", "tokens generated", True, s.generation_tokens),
                ("tokenspeed_engine_sim_restarts", "restart faults fired", True, s.num_restarts),
                ("tokenspeed_engine_sim_events_dropped", "event batches dropped by the fault knob", True,
                 s.num_events_dropped),
                ("tokenspeed_engine_sim_requests_running", "requests running", False, s.num_running),
                ("tokenspeed_engine_sim_requests_waiting", "requests waiting", False, s.num_waiting),
                ("tokenspeed_engine_sim_cache_tokens", "tokens in the prefix cache", False, s.cache_tokens),
                ("tokenspeed_engine_sim_cache_usage_ratio", "prefix cache fill (0-1)", False, usage),
                # vLLM's names, for routers and dashboards that scrape engines.
                ("vllm:num_requests_running", "requests running", False, s.num_running),
                ("vllm:num_requests_waiting", "requests waiting", False, s.num_waiting),
                ("vllm:kv_cache_usage_perc", "KV cache usage (0-1)", False, usage),
                ("vllm:gpu_cache_usage_perc", "KV cache usage (0-1)", False, usage),
                ("vllm:prompt_tokens", "prompt tokens", True, s.prompt_tokens),
                ("vllm:generation_tokens", "generated tokens", True, s.generation_tokens),
                ("vllm:prefix_cache_queries", "prompt tokens queried in the prefix cache", True,
                 s.prompt_tokens),
                ("vllm:prefix_cache_hits", "prompt tokens hit in the prefix cache", True, s.cached_tokens),
            ]
            for name, doc, counter, value in rows:
                fam(name, doc, counter).add_metric(lv, float(value))
        return list(families.values())


def _engine_timing(sim: SimRequest) -> dict[str, Any]:
    """The engine's own share of the request's latency (``engine_timing``, beside ``usage``:
    ``usage`` itself stays exactly vLLM's shape).

    ``ttft_s``: wall seconds from the engine getting the request to its first
    token (a client's TTFT minus this is what everything in between added:
    the router, the network). ``modelled_*``: the same in the timing model's
    seconds (before ``--time-scale``), what ``simulate`` computes.
    """
    queued = None if sim.admitted_s is None else sim.admitted_s - sim.arrival_s
    modelled = None if sim.first_token_s is None else sim.first_token_s - sim.arrival_s
    return {"ttft_s": sim.engine_ttft_s, "modelled_ttft_s": modelled, "modelled_queue_s": queued}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def create_app(app: EngineSimApp) -> Starlette:
    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return ApiError(status, f"{request.method} {request.url.path}: not found", "NotFoundError").response()

    async def completions(request: Request) -> Response:
        return await app.generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await app.generate(request, chat=True)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/tokenize", app.tokenize, methods=["POST"]),
        Route("/v1/completions/render", app.render_completions, methods=["POST"]),
        Route("/v1/chat/completions/render", app.render_chat, methods=["POST"]),
        Route("/v1/models", app.models, methods=["GET"]),
        Route("/health", app.health, methods=["GET"]),
        Route("/metrics", app.metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})
