"""``tokenspeed-router doctor``: check every engine against the router before traffic arrives (DESIGN §13).

``--router URL`` reads the worker specs from a running router (``GET
/workers``) and asks that router for its tokens (``POST /doctor/expect``,
its own ``--tokenizer``) and predictions (``POST /match``, its live index).
``--worker SPEC... [--tokenizer engine|PATH]`` checks engines directly: the
router's tokenizer classes and index run in this process. Either way the
doctor follows the engines' event streams itself (a PUB socket serves many
subscribers) and sends its canaries to the engines' own APIs.

Exit status: 0 when every check passes, 1 when any fails, 2 on bad usage
(argparse errors, a bad worker spec, an unreachable router).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections import defaultdict

from tokenspeed_router.doctor.engine_run import EngineTarget, Options, check_engine, stream_targets
from tokenspeed_router.doctor.report import DoctorReport
from tokenspeed_router.doctor.views import LocalView, RouterHttpView, RouterView
from tokenspeed_router.doctor.watcher import StreamTarget, Watcher
from tokenspeed_router.errors import ConfigError
from tokenspeed_router.gateway.http1 import Http1Pool, UpstreamError
from tokenspeed_router.gateway.tokenize import load_tokenizer
from tokenspeed_router.gateway.upstream import KEEPALIVE_S
from tokenspeed_router.server.worker_spec import WorkerSpec

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--router", default=None, metavar="URL", help="a running router (its /workers, tokenizer and index)")
    a("--worker", action="append", default=[], metavar="SPEC",
      help="a worker spec as serve takes it (name=...,url=...,events=...[,replay=...,dp_ranks=N]); repeatable")
    a("--tokenizer", default="engine", help="with --worker: the router's --tokenizer choice, engine or PATH "
      "(default engine)")
    a("--json", action="store_true", help="print the report as JSON")
    a("--timeout", type=float, default=10.0, metavar="S", help="longest wait for each answer or event (default 10)")
    a("--max-event-lag", type=float, default=2.0, metavar="S",
      help="BlockStored must arrive within S seconds of the engine's answer (default 2)")
    a("--block-size", type=int, default=None, metavar="N", help="the block size every engine should use")
    a("--model", default=None, help="model name for the canaries (default: the engine's first /v1/models)")
    a("--epp", default=None, metavar="HOST:PORT",
      help="also check the router's endpoint picker (serve --epp): gRPC health, and that a test pick names "
      "one of the engines and that engine answers /health (needs the epp extra)")
    a("--auth-token", default=os.environ.get("TOKENSPEED_ROUTER_AUTH_TOKEN"),
      help="bearer token for --router (env TOKENSPEED_ROUTER_AUTH_TOKEN)")


def _direct_targets(specs: list[str]) -> list[EngineTarget]:
    workers = [WorkerSpec.parse(s) for s in specs]
    names = [w.name for w in workers]
    if len(set(names)) != len(names):
        raise ConfigError("--worker: two workers share a name")
    missing = [w.name for w in workers if w.url is None]
    if missing:  # bad usage, not a failed check: the doctor sends its canaries to url=
        raise ConfigError(f"--worker {', '.join(missing)}: no url= (the engine's OpenAI API, where the doctor "
                          "sends its canaries): give url=http://HOST:PORT")
    return [EngineTarget(w.name, w.url, stream_targets(w.name, w.subscribers())) for w in workers]


#: the doctor's own connection bound (a canary or two per engine at a time, and the router)
DOCTOR_MAX_CONNECTIONS = 64


async def _router_targets(pool: Http1Pool, url: str, headers: dict[str, str],
                          timeout_s: float) -> list[EngineTarget]:
    try:
        status, raw = await pool.fetch(b"GET", url.rstrip("/"), "/workers", headers=headers, timeout_s=timeout_s)
        data = json.loads(raw)
    except (UpstreamError, OSError, ValueError) as err:
        raise ConfigError(f"--router {url}: GET /workers failed: {type(err).__name__}: {err}") from err
    if status != 200 or not isinstance(data, dict):
        raise ConfigError(f"--router {url}: GET /workers answered {status}")
    streams: dict[str, list[StreamTarget]] = defaultdict(list)
    urls: dict[str, str | None] = {}
    problems: dict[str, list[str]] = defaultdict(list)
    for name, entry in sorted(data.items()):
        if not isinstance(entry, dict) or not entry.get("events_endpoint"):
            continue
        worker = entry.get("worker") or name
        streams[worker].append(StreamTarget(
            name=name, worker=worker, dp_rank=int(entry.get("dp_rank") or 0), events=entry["events_endpoint"],
            replay=entry.get("replay_endpoint"), topic=entry.get("topic") or ""))
        urls[worker] = entry.get("url")
        if entry.get("state") not in (None, "live"):
            problems[worker].append(f"the router reports {name} {entry['state']}")
        if entry.get("misaligned"):
            cause = (entry.get("truth") or {}).get("cause")
            problems[worker].append(f"the router flags {name} misaligned: {cause}")
    if not streams:
        raise ConfigError(f"--router {url}: the router has no workers with an events endpoint")
    return [EngineTarget(w, urls[w], tuple(s), tuple(problems[w])) for w, s in streams.items()]


async def _doctor(args: argparse.Namespace) -> DoctorReport:
    headers = {"authorization": f"Bearer {args.auth_token}"} if args.auth_token else {}
    options = Options(timeout_s=args.timeout, max_event_lag_s=args.max_event_lag, block_size=args.block_size,
                      model=args.model)
    pool = Http1Pool(max_connections=DOCTOR_MAX_CONNECTIONS, connect_timeout_s=args.timeout,
                     read_timeout_s=args.timeout, keepalive_s=KEEPALIVE_S)
    try:
        if args.router:
            targets = await _router_targets(pool, args.router, headers, args.timeout)
        else:
            targets = _direct_targets(args.worker)
        watcher = Watcher([s for t in targets for s in t.streams])
        try:
            view: RouterView
            if args.router:
                view = RouterHttpView(pool, args.router, headers=headers, timeout_s=args.timeout)
            else:
                view = LocalView(load_tokenizer(args.tokenizer, lambda: pool), args.tokenizer, watcher,
                                 args.model)
            reports = list(await asyncio.gather(*(check_engine(t, view, watcher, pool, options) for t in targets)))
        finally:
            await asyncio.to_thread(watcher.close)
        if args.epp:
            from tokenspeed_router.doctor.epp_check import check_epp

            urls = [t.url for t in targets if t.url]
            reports.append(await check_epp(args.epp, urls, pool, args.timeout))
    finally:
        await pool.aclose()
    return DoctorReport(reports)


def run(args: argparse.Namespace) -> int:
    if bool(args.router) == bool(args.worker):
        print("tokenspeed-router doctor: error: give --router URL or at least one --worker SPEC (not both)",
              file=sys.stderr)
        return 2
    if args.timeout <= 0 or args.max_event_lag <= 0:
        print("tokenspeed-router doctor: error: --timeout and --max-event-lag must be positive", file=sys.stderr)
        return 2
    if args.block_size is not None and args.block_size <= 0:
        print("tokenspeed-router doctor: error: --block-size must be positive", file=sys.stderr)
        return 2
    report = asyncio.run(_doctor(args))
    print(report.to_json() if args.json else report.to_text())
    return report.exit_code


