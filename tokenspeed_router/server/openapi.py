"""The OpenAPI 3 document of the HTTP API ``serve`` answers (DESIGN §6, §10, §13): ``GET /openapi.json``.

Generated, not written: request bodies are the msgspec structs the server
decodes them into (``server/api.py``: :class:`MatchRequest`,
:class:`RouteRequest`, :class:`ReleaseRequest`), and the answers are the
structs below, turned into JSON Schema by ``msgspec.json.schema_components``.
The answers' structs list every field the server sends and forbid others
(``additionalProperties: false``), so a field added to an answer without
being added here fails the schemathesis run in CI
(``tests/integration/test_http_schemathesis.py``), which also checks every
answer against this document.

The package ships the document as ``server/openapi.json`` (for tools that
want the file without running a router); it is this module's output,
written by :func:`write_openapi` and kept equal to it by a test
(``tests/unit/test_openapi.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from tokenspeed_router.gateway.app import ChatMessage, DoctorExpectRequest
from tokenspeed_router.server.api import MAX_TOKEN_ID, MatchRequest, ReleaseRequest, RouteRequest

__all__ = ["openapi_document", "openapi_json", "write_openapi"]

TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
Tier = Literal["gpu", "cpu", "storage"]


# --- answers of the router's API (DESIGN §6) ---------------------------------------------


class ErrorAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """Every refusal of the router's API: a 4xx (or 5xx) with the problem named."""

    error: str


class MatchAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /match``: leading blocks each worker holds on any tier, its block size, per tier."""

    scores: dict[str, int]
    block_size: dict[str, int]
    tiers: dict[str, dict[str, int]]


class CandidateAnswer(msgspec.Struct):
    """One candidate of an explained decision (DESIGN §13); more terms may follow these."""

    worker: str
    matched_tokens: int
    uncached_tokens: int
    queue_tokens: float
    cost: float
    reason: str | None = None


class ExplainAnswer(msgspec.Struct):
    """Why ``worker`` was chosen (DESIGN §13): every candidate, in evaluation order."""

    worker: str
    candidates: list[CandidateAnswer]


class RouteAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /route``: the chosen worker; the request now counts in flight there."""

    worker: str
    matched_blocks: int
    matched_tokens: int
    scores: dict[str, int]
    prefill_worker: str | None
    decode_worker: str | None
    request_id: str | None
    #: present when the request asked for it (``"explain": true``) or was sampled
    explain: ExplainAnswer | None = None


class EmptyAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /release``: ``{}`` (an unknown or expired request id too: releasing is idempotent)."""


class TruthAnswer(msgspec.Struct):
    """The gateway's truth loop for one worker: predicted vs engine-reported cached tokens."""

    misaligned: bool


class EngineBeliefAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """What the cost model believes of one engine (``EngineEstimate``, docs/routing.md)."""

    queue_s: float
    queued_prefills: int
    prefill_tokens_per_s: float
    prefill_overhead_s: float
    fit_samples: int
    capacity_tokens: int | None
    predictions: int
    resident_new_tokens: int
    residence_s: float


class WorkerAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """One stream (a worker, or one DP rank of it) in ``GET /workers``."""

    worker: str
    dp_rank: int | None
    role: Literal["prefill", "decode", "both"]
    state: Literal["live", "resyncing", "stale"]
    blocks: int
    blocks_held: int
    blocks_by_tier: dict[str, int]
    block_size: int | None
    index_core: Literal["native", "reference"]
    last_seq: int | None
    epoch: int
    batches_applied: int
    events_applied: int
    events_rejected: int
    resyncs: int
    restarts: int
    #: recovery after lost events (docs/faults.md, "What is trusted when"): blocks held back under
    #: unknown parents now, held-back blocks applied later, lost parents named from this router's
    #: routes, blocks held under inferred ids now, times every inferred block was dropped
    orphan_blocks: int
    adopted_blocks: int
    named_parents: int
    inferred_blocks: int
    inferred_drops: int
    replayed_batches: int
    gaps: int
    malformed_frames: int
    #: skipped before sequencing, by cause (frame_count, seq_length, topic, payload_size, payload_decode,
    #: no_known_events, replay_frame): none of them moved the sequence state
    malformed_by_cause: dict[str, int]
    duplicates: int
    lag_s: float | None
    lag: float | None
    ingest_delay_s: float | None
    in_flight: int
    queued_prefill_tokens: int
    in_flight_peers: int
    connected: bool | None
    #: why the stream delivers nothing: a failed handshake (wrong CURVE key, refused client key,
    #: mechanism mismatch) or a foreign topic; None when there is no named cause
    stream_problem: str | None
    lagging: bool
    ingest_queued: int
    apply_delay_s: float | None
    shed_batches: int
    events_endpoint: str | None
    replay_endpoint: str | None
    topic: str | None
    # the gateway's part (DESIGN §10)
    url: str | None
    reachable: bool
    misaligned: bool
    truth: TruthAnswer
    #: with ``--state``: ``shared`` or ``degraded`` (Redis down: this replica's view only)
    in_flight_sharing: Literal["shared", "degraded"] | None = None
    #: the cost model's belief about this engine; None until this router routed there
    engine_belief: EngineBeliefAnswer | None = None


class HealthAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """``GET /health``: 200 when ``ok`` or ``degraded`` (serving), 503 otherwise; ``problems`` says why."""

    status: Literal["ok", "degraded", "unavailable", "stopping"]
    problems: list[str]
    uptime_s: float
    workers: int
    index_core: Literal["native", "reference"]
    ingesting: bool
    subscribed: bool
    lagging: list[str]
    #: per stream, why it delivers nothing (as in ``GET /workers``); any makes ``ok`` ``degraded``
    stream_problems: dict[str, str]
    misaligned: dict[str, str]
    down: list[str]
    #: with ``--state``: the state backend's own view
    state: dict[str, Any] | None = None


class WorkerSpecBody(msgspec.Struct, forbid_unknown_fields=True):
    """``PUT /workers/{name}``: a worker spec as ``--worker`` takes it (docs/service.md); the path
    names the worker (a ``name`` in the body must be the same)."""

    events: str
    replay: str | None = None
    role: Literal["prefill", "decode", "both"] = "both"
    dp_ranks: Annotated[int, Meta(ge=1)] | str = 1
    topic: str = ""
    url: str | None = None
    curve_server_key: str | None = None
    curve_key: str | None = None


class WorkerSpecAnswer(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    events: str
    replay: str | None
    role: Literal["prefill", "decode", "both"]
    dp_ranks: int
    topic: str
    url: str | None
    curve_server_key: str | None
    curve_key: str | None


class PutWorkerAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """``PUT /workers/{name}``: 201 when added, 200 when replaced or unchanged."""

    worker: WorkerSpecAnswer
    streams: list[str]
    created: bool


class DeleteWorkerAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """``DELETE /workers/{name}``: the streams unsubscribed."""

    removed: list[str]


# --- the gateway (DESIGN §10) and the doctor's view (§13) ------------------------------------


class OpenAIErrorDetail(msgspec.Struct):
    """The gateway's own refusals carry exactly these; an engine's, relayed unchanged, may add
    fields, and vLLM's ``code`` is the HTTP status as an integer."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class OpenAIErrorAnswer(msgspec.Struct):
    """Every refusal of ``/v1/*`` and ``/doctor/expect``, in OpenAI's error shape (an engine's
    refusal is relayed as the engine sent it)."""

    error: OpenAIErrorDetail


class CompletionBody(msgspec.Struct):
    """``POST /v1/completions``: forwarded to the engine unchanged (unknown fields pass through).

    ``prompt`` is a string, a list of token ids (routed as is), or a batch of
    either (routed by its first prompt).
    """

    prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[TokenId | str | list[TokenId]], Meta(min_length=1)]
    model: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None


class ChatBody(msgspec.Struct):
    """``POST /v1/chat/completions``: forwarded unchanged; the chat template renders ``messages``."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    model: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None


class ModelsAnswer(msgspec.Struct):
    """``GET /v1/models``: the union of the workers' models, by ``id``."""

    object: Literal["list"]
    data: list[dict[str, Any]]


class DoctorExpectAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """What this router computes for the prompt: its tokens and the index's match. No side effects."""

    token_ids: list[int]
    scores: dict[str, int]
    block_size: dict[str, int]


# --- the document -----------------------------------------------------------------------------

_COMPONENTS: tuple[type, ...] = (
    MatchRequest, RouteRequest, ReleaseRequest, ErrorAnswer, MatchAnswer, RouteAnswer, EmptyAnswer,
    WorkerAnswer, HealthAnswer, WorkerSpecBody, PutWorkerAnswer, DeleteWorkerAnswer, OpenAIErrorAnswer,
    CompletionBody, ChatBody, ModelsAnswer, DoctorExpectRequest, DoctorExpectAnswer,
)
_REF = "#/components/schemas/{name}"


def _ref(t: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=t.__name__)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(t: type) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(t)}}}


def _errors(shape: type, *codes: int) -> dict[str, Any]:
    why = {400: "bad input, named", 401: "missing or wrong bearer token (with --auth-token)",
           404: "unknown worker", 409: "conflicts with the configured workers",
           413: "body over max_body_bytes, or token_ids over max_tokens",
           502: "the engine failed", 503: "no worker can take it", 504: "the engine timed out"}
    return {str(c): _json(_ref(shape), why[c]) for c in codes}


def _op(summary: str, responses: dict[str, Any], body: type | None = None, *, auth: bool = True,
        tag: str = "router") -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "tags": [tag], "responses": responses}
    if body is not None:
        op["requestBody"] = _body(body)
    if not auth:
        op["security"] = []
    return op


def openapi_document() -> dict[str, Any]:
    """The whole document (a fresh dict each call)."""
    from tokenspeed_router import __version__

    _, schemas = msgspec.json.schema_components(_COMPONENTS, ref_template=_REF)
    name = {"name": "name", "in": "path", "required": True, "description": "a worker name",
            "schema": {"type": "string"}}
    text = {"text/plain": {"schema": {"type": "string"}}}
    engine_answer = {"application/json": {"schema": {"type": "object"}},
                     # with stream: true, one server-sent event per chunk, relayed as the engine sent it
                     "text/event-stream": {"schema": {"type": "object", "properties": {
                         "data": {"type": "string"}, "event": {"type": "string"}}}}}
    gateway_errors = {**_errors(OpenAIErrorAnswer, 400, 401, 413, 502, 503, 504),
                      "4XX": _json(_ref(OpenAIErrorAnswer), "the engine's refusal, relayed as it sent it "
                                                            "(e.g. 404: it serves no such model)")}
    paths: dict[str, Any] = {
        "/match": {"post": _op("Leading blocks each worker holds for a prompt (no side effects)",
                               {"200": _json(_ref(MatchAnswer), "the match"),
                                **_errors(ErrorAnswer, 400, 401, 413)}, MatchRequest)},
        "/route": {"post": _op("Choose a worker and count the request in flight there",
                               {"200": _json(_ref(RouteAnswer), "the decision"),
                                **_errors(ErrorAnswer, 400, 401, 413, 503)}, RouteRequest)},
        "/release": {"post": _op("The request finished: it no longer counts in flight",
                                 {"200": _json(_ref(EmptyAnswer), "released (or already gone)"),
                                  **_errors(ErrorAnswer, 400, 401, 413)}, ReleaseRequest)},
        "/workers": {"get": _op("Every stream: role, state, blocks held, last seq, lag, ...",
                                {"200": _json({"type": "object", "additionalProperties": _ref(WorkerAnswer)},
                                              "by stream name"), **_errors(ErrorAnswer, 401)})},
        "/workers/{name}": {
            "parameters": [name],
            "put": _op("Add or replace a worker at run time",
                       {"200": _json(_ref(PutWorkerAnswer), "replaced, or unchanged"),
                        "201": _json(_ref(PutWorkerAnswer), "added"),
                        **_errors(ErrorAnswer, 400, 401, 404, 409, 413)}, WorkerSpecBody),
            "delete": _op("Unsubscribe and forget a worker",
                          {"200": _json(_ref(DeleteWorkerAnswer), "removed"),
                           **_errors(ErrorAnswer, 401, 404, 409)}),
        },
        "/health": {"get": _op("Whether the router serves, and why not", {
            "200": _json(_ref(HealthAnswer), "ok, or degraded (still serving)"),
            "503": _json(_ref(HealthAnswer), "unavailable or stopping")}, auth=False)},
        "/metrics": {"get": _op("Prometheus text format", {"200": {"description": "metrics", "content": text},
                                                          **_errors(ErrorAnswer, 401)})},
        "/openapi.json": {"get": _op("This document", {"200": _json({"type": "object"}, "OpenAPI 3.1")},
                                     auth=False)},
        "/v1/completions": {"post": _op(
            "OpenAI completions, routed and forwarded unchanged; SSE relayed with stream: true",
            {"200": {"description": "the engine's answer (header x-tokenspeed-worker)",
                     "content": engine_answer}, **gateway_errors}, CompletionBody, tag="gateway")},
        "/v1/chat/completions": {"post": _op(
            "OpenAI chat completions, routed and forwarded unchanged; SSE relayed with stream: true",
            {"200": {"description": "the engine's answer (header x-tokenspeed-worker)",
                     "content": engine_answer}, **gateway_errors}, ChatBody, tag="gateway")},
        "/v1/models": {"get": _op("The union of the workers' models", {
            "200": _json(_ref(ModelsAnswer), "models"), **_errors(OpenAIErrorAnswer, 401, 502, 503)},
            tag="gateway")},
        "/doctor/expect": {"post": _op(
            "What this router computes for a canary: its tokens and the index's match (no side effects)",
            {"200": _json(_ref(DoctorExpectAnswer), "tokens and match"),
             **_errors(OpenAIErrorAnswer, 400, 401, 413, 502)}, DoctorExpectRequest, tag="doctor")},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "tokenspeed-router",
            "version": __version__,
            "description": "KV-aware router: the query API (DESIGN §6), the OpenAI-compatible gateway "
                           "(§10) and the doctor's view (§13). Every refusal names the problem.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "serve --auth-token; every path but /health and "
                                                          "/openapi.json needs it when set"}},
        },
        "security": [{"bearer": []}],
    }


def openapi_json() -> bytes:
    """The document as ``GET /openapi.json`` answers it (stable key order, one line per key)."""
    return msgspec.json.format(msgspec.json.encode(openapi_document()), indent=1) + b"\n"



def write_openapi(path: str) -> None:
    """Write :func:`openapi_json` to ``path`` (how ``server/openapi.json`` is regenerated)."""
    with open(path, "wb") as f:
        f.write(openapi_json())
