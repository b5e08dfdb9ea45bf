"""``tokenspeed-router inspect FILE|URL``: summary of an event log or a live router.

For a file (our log, a ``.kvcap`` or a capture directory): per worker the
records, events by kind, time span, sequence range, gaps / restarts /
duplicates as the sequence numbers show them, and the blocks per tier the
worker holds at the end (the log is replayed into a throwaway index through
the same path as ``replay``). For a URL (``http://host:port``, optionally
ending in ``/workers`` or ``/health``): the live router's ``GET /workers`` as
a table. ``--json`` prints the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenspeed_router.errors import ConfigError, EventLogError, RouterApiError, WireError
from tokenspeed_router.events.codec import BatchDecoder
from tokenspeed_router.events.log import LogRecord
from tokenspeed_router.events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from tokenspeed_router.events.sequencing import SequenceTracker, VerdictKind
from tokenspeed_router.tools.cli_replay import EventSource, warn_truncated

__all__ = ["add_arguments", "inspect_records", "router_base_url", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="FILE|URL", help="event log, capture, or http://router:port")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--auth-token", metavar="TOKEN", help="bearer token for a live router")


class _Worker:
    __slots__ = ("batches", "duplicates", "events", "first_s", "gaps", "last_s", "malformed",
                 "max_seq", "min_seq", "missing", "restarts", "tracker")

    def __init__(self) -> None:
        self.batches = 0
        self.events = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.min_seq: int | None = None
        self.max_seq: int | None = None
        self.gaps = 0
        self.missing = 0
        self.restarts = 0
        self.duplicates = 0
        self.malformed = 0
        self.tracker = SequenceTracker()


def inspect_records(records: Iterable[LogRecord]) -> dict[str, Any]:
    """Summarise records; also rebuilds the final index to report blocks per tier."""
    from tokenspeed_router.server.app import RouterService
    from tokenspeed_router.server.config import ServerConfig

    service = RouterService(ServerConfig(http=None))
    decoder = BatchDecoder()
    workers: dict[str, _Worker] = {}
    total = 0
    for rec in records:
        total += 1
        w = workers.get(rec.worker)
        if w is None:
            w = workers[rec.worker] = _Worker()
        w.first_s = rec.recv_time_s if w.first_s is None else min(w.first_s, rec.recv_time_s)
        w.last_s = rec.recv_time_s if w.last_s is None else max(w.last_s, rec.recv_time_s)
        w.min_seq = rec.seq if w.min_seq is None else min(w.min_seq, rec.seq)
        w.max_seq = rec.seq if w.max_seq is None else max(w.max_seq, rec.seq)
        verdict = w.tracker.observe(rec.seq, rec.payload)
        if verdict.kind is VerdictKind.GAP:
            w.gaps += 1
            w.missing += verdict.missing
        elif verdict.kind is VerdictKind.RESTART:
            w.restarts += 1
        elif verdict.kind is VerdictKind.DUPLICATE:
            w.duplicates += 1
        try:
            batch = decoder.decode(rec.payload)
        except WireError:
            w.malformed += 1
            continue
        w.batches += 1
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                w.events["BlockStored"] += 1
            elif isinstance(ev, BlockRemoved):
                w.events["BlockRemoved"] += 1
            elif isinstance(ev, AllBlocksCleared):
                w.events["AllBlocksCleared"] += 1
        service.apply_record(rec.worker, rec.seq, batch, rec.recv_time_s, payload=rec.payload)
    state = service.workers()
    service.stop()
    firsts = [w.first_s for w in workers.values() if w.first_s is not None]
    lasts = [w.last_s for w in workers.values() if w.last_s is not None]
    return {
        "records": total,
        "start_s": min(firsts) if firsts else None,
        "end_s": max(lasts) if lasts else None,
        "duration_s": (max(lasts) - min(firsts)) if firsts else 0.0,
        "workers": {
            name: {
                "batches": w.batches,
                "events": dict(w.events),
                "first_s": w.first_s,
                "last_s": w.last_s,
                "seq_range": [w.min_seq, w.max_seq],
                "gaps": w.gaps,
                "missing_batches": w.missing,
                "restarts": w.restarts,
                "duplicates": w.duplicates,
                "malformed": w.malformed,
                "state": state.get(name, {}).get("state"),
                "blocks": state.get(name, {}).get("blocks", 0),
                "blocks_by_tier": state.get(name, {}).get("blocks_by_tier", {}),
            }
            for name, w in sorted(workers.items())
        },
    }


def _inspect_url(url: str, token: str | None) -> dict[str, Any]:
    from tokenspeed_router.server.client import HttpRouterClient

    try:
        with HttpRouterClient(url, auth_token=token) as client:
            return {"url": url, "health": client.health(), "workers": client.workers()}
    except RouterApiError:
        raise
    except Exception as err:  # httpx transport errors: name the URL
        raise ConfigError(f"cannot reach router at {url}: {err}") from err


def _print_file_summary(summary: dict[str, Any]) -> None:
    out = sys.stdout
    out.write(f"records: {summary['records']}  span: {summary['duration_s']:.3f}s\n")
    header = (f"{'worker':<20} {'batches':>8} {'stored':>7} {'removed':>7} {'cleared':>7} "
              f"{'seqs':>13} {'gaps':>4} {'restart':>7} {'state':>9} {'blocks':>7}  tiers\n")
    out.write(header)
    for name, w in summary["workers"].items():
        seqs = f"{w['seq_range'][0]}..{w['seq_range'][1]}"
        tiers = ",".join(f"{k}={v}" for k, v in sorted(w["blocks_by_tier"].items())) or "-"
        out.write(
            f"{name:<20} {w['batches']:>8} {w['events']['BlockStored']:>7} {w['events']['BlockRemoved']:>7} "
            f"{w['events']['AllBlocksCleared']:>7} {seqs:>13} {w['gaps']:>4} {w['restarts']:>7} "
            f"{w['state'] or '-':>9} {w['blocks']:>7}  {tiers}\n"
        )


def _print_url_summary(summary: dict[str, Any]) -> None:
    out = sys.stdout
    out.write(f"router {summary['url']}: {summary['health'].get('status')}\n")
    out.write(f"{'worker':<20} {'role':>7} {'state':>9} {'blocks':>7} {'last_seq':>9} "
              f"{'events':>9} {'lag_s':>8}  tiers\n")
    for name, w in summary["workers"].items():
        lag = "-" if w.get("lag_s") is None else f"{w['lag_s']:.3f}"
        tiers = ",".join(f"{k}={v}" for k, v in sorted((w.get("blocks_by_tier") or {}).items())) or "-"
        last_seq = "-" if w.get("last_seq") is None else str(w["last_seq"])
        out.write(f"{name:<20} {w.get('role', '-'):>7} {w.get('state', '-'):>9} {w.get('blocks', 0):>7} "
                  f"{last_seq:>9} {w.get('events_applied', 0):>9} {lag:>8}  {tiers}\n")


def router_base_url(url: str) -> str:
    """``http://h:p``, ``http://h:p/``, ``http://h:p/workers`` or ``.../health`` -> ``http://h:p``."""
    base = url.rstrip("/")
    for suffix in ("/workers", "/health"):
        if base.endswith(suffix):
            base = base[: -len(suffix)].rstrip("/")
            break
    return base


def run(args: argparse.Namespace) -> int:
    target: str = args.target
    if target.startswith(("http://", "https://")):
        # one INFO line per request from httpx would drown the table
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
        summary = _inspect_url(router_base_url(target), args.auth_token)
        printer = _print_url_summary
    else:
        if not Path(target).exists():
            raise ConfigError(f"{target}: no such file or directory")
        source = EventSource(target)
        try:
            summary = inspect_records(source)
        except EventLogError as err:
            raise ConfigError(str(err)) from err
        summary["source"] = target
        summary["truncated"] = source.truncated
        if source.truncated:
            warn_truncated("inspect", target)
        printer = _print_file_summary
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    else:
        printer(summary)
    return 0
