"""``doctor --epp HOST:PORT``: does the endpoint picker answer, and does its pick name a live engine?

Two checks, reported as one more entry (``epp HOST:PORT``) beside the engines:

* ``epp_health`` — gRPC health checking answers ``liveness``, ``readiness``
  and ``envoy.service.ext_proc.v3.ExternalProcessor`` with SERVING;
* ``epp_pick`` — one request phase as Envoy sends it (full-duplex body, then
  a half-close: the picker releases the pick at once) names an endpoint in
  the ``x-gateway-destination-endpoint`` header and the same value in
  ``envoy.lb`` dynamic metadata, the first of them is one of the engines'
  ``url=`` host:port, and that engine answers ``GET /health`` with 200.

Needs the ``epp`` extra (gRPC and Envoy's generated protos).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tokenspeed_router.doctor.checks import Cause, Check
from tokenspeed_router.doctor.report import EngineReport
from tokenspeed_router.epp.names import EPP_EXTRA_HINT, EXT_PROC_SERVICE
from tokenspeed_router.errors import ConfigError
from tokenspeed_router.gateway.http1 import Http1Pool, UpstreamError

__all__ = ["check_epp"]

#: a prompt of token ids: no tokenizer round trip, routed like any other
_PROBE = json.dumps({"prompt": list(range(1, 65)), "max_tokens": 1}).encode()
_HEALTH_FIX = Cause("the picker is not ready (its log says why on each change: streams not synced yet, "
                    "no worker with url=, every engine down, or a follower under --epp-leader-only)",
                    "wait for the event streams to connect; check `serve --epp` logs and GET /health")
_PICK_FIX = Cause("the picker named no endpoint of a configured engine, or that engine is not answering",
                  "check the workers' url= (the picker names their host:port) and the engine's /health")


async def check_epp(address: str, engine_urls: list[str], pool: Http1Pool, timeout_s: float) -> EngineReport:
    """The two checks of the module docstring against the picker at ``address``."""
    try:
        import grpc

        from tokenspeed_router.epp.client import health, pick_once
    except ImportError as err:
        raise ConfigError(f"doctor --epp: {EPP_EXTRA_HINT} ({err})") from None

    def ask() -> tuple[dict[str, str], object]:
        with grpc.insecure_channel(address) as channel:
            states = {s: health(channel, s, timeout_s) for s in ("liveness", "readiness", EXT_PROC_SERVICE)}
            try:
                answer: object = pick_once(channel, _PROBE, timeout_s=timeout_s)
            except (grpc.RpcError, RuntimeError) as err:
                answer = err
        return states, answer

    states, answer = await asyncio.to_thread(ask)
    checks: list[Check] = []
    shown = ", ".join(f"{s or '(server)'} {v}" for s, v in states.items())
    if all(v == "SERVING" for v in states.values()):
        checks.append(Check.passed("epp_health", shown))
    else:
        checks.append(Check.failed("epp_health", shown, _HEALTH_FIX))
    checks.append(await _pick_check(answer, engine_urls, pool, timeout_s))
    return EngineReport(f"epp {address}", checks)


async def _pick_check(answer: Any, engine_urls: list[str], pool: Http1Pool, timeout_s: float) -> Check:
    from tokenspeed_router.epp.client import destination
    from tokenspeed_router.epp.picker import resolve_endpoint

    if isinstance(answer, Exception):
        return Check.failed("epp_pick", f"no answer: {type(answer).__name__}: {answer}", _PICK_FIX)
    if answer.HasField("immediate_response"):
        imm = answer.immediate_response
        return Check.failed("epp_pick", f"ImmediateResponse {imm.status.code}: {imm.body[:200]!r}", _PICK_FIX)
    header, meta = destination(answer)
    if not header or header != meta:
        return Check.failed("epp_pick", f"header {header!r} and envoy.lb metadata {meta!r} differ", _PICK_FIX)
    first = header.split(",")[0]
    known = {resolve_endpoint(u): u for u in engine_urls}
    url = known.get(first)
    if url is None:
        return Check.failed("epp_pick", f"named {first}, which is none of the engines ({', '.join(known)})",
                            _PICK_FIX)
    try:
        status, _ = await pool.fetch(b"GET", url, "/health", timeout_s=timeout_s)
    except (UpstreamError, OSError) as err:
        return Check.failed("epp_pick", f"named {first}; its GET /health failed: {err}", _PICK_FIX)
    if status != 200:
        return Check.failed("epp_pick", f"named {first}; its GET /health answered {status}", _PICK_FIX)
    return Check.passed("epp_pick", f"named {header} (header = envoy.lb metadata); {first} answers /health")
