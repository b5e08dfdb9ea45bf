"""``tokenspeed-router replay FILE``: rebuild the index from an event log (DESIGN §7).

The log is folded into a :class:`RouterService` through
:meth:`RouterService.apply_record` — the same ingestor, the same index, the
same ``match`` as the live router, with restarts and gaps detected from the
sequence numbers exactly as the live subscriber reports them. That is what
makes the contract hold: replaying a log recorded by ``serve --record``
answers ``--queries`` exactly as the live ``POST /match`` did when recording
stopped. (Not reproduced: a worker the live router had marked ``stale``
because its endpoint vanished; a log has no connections. ``/match`` does not
depend on it.)

Sources: our event logs, one ``.kvcap`` capture or a capture directory
(``events.log.open_event_source``). ``--until T``: T seconds after the first
record, or, when T looks like a Unix timestamp (>= 1e9), that absolute
time. ``--speed X`` paces the replay at X times the recorded rate (default:
as fast as possible). The progress bar goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec

from tokenspeed_router.errors import ConfigError, EventLogError, WireError
from tokenspeed_router.events.codec import BatchDecoder
from tokenspeed_router.events.log import LOG_MAGIC, EventLogReader, LogRecord, open_event_source
from tokenspeed_router.process import shutdown_signals
from tokenspeed_router.router.router import WorkerRole
from tokenspeed_router.server.cli_serve import add_listener_arguments, config_from_args

__all__ = ["EventSource", "ReplayStats", "add_arguments", "answer_queries", "replay_into", "run", "warn_truncated"]

logger = logging.getLogger(__name__)

#: --until values at or above this are absolute Unix timestamps (2001-09-09)
ABSOLUTE_TIME_THRESHOLD_S = 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="event log, .kvcap capture, or capture directory")
    parser.add_argument(
        "--until", type=float, metavar="T",
        help="stop at T seconds after the first record, or at Unix time T when T >= 1e9",
    )
    parser.add_argument("--speed", type=float, metavar="X", help="replay at X times the recorded rate")
    parser.add_argument(
        "--queries", metavar="Q.jsonl",
        help="after replaying, answer each line {token_ids, lora_id?, salt?} as POST /match would "
        "('-' reads stdin); answers go to stdout, one JSON object per line",
    )
    parser.add_argument("--serve", action="store_true", help="serve the rebuilt index over the HTTP API")
    parser.add_argument(
        "--decisions", metavar="FILE",
        help="a decision log (serve --decision-log): rebuild the index as of each decision and decide it "
        "again with --policy/--router-option (default: the logged policy and weights); prints a JSON "
        "summary comparing the two (docs/operations.md)",
    )
    parser.add_argument(
        "--decisions-out", metavar="FILE",
        help="with --decisions: also write one JSON line per decision (logged vs re-decided) to FILE",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_listener_arguments(parser)


@dataclass
class ReplayStats:
    """What a replay went through (also used by ``inspect``)."""

    records: int = 0
    malformed: int = 0
    first_s: float | None = None
    last_s: float | None = None
    per_worker: dict[str, int] = field(default_factory=dict)


class _Progress:
    """A throttled one-line progress bar on stderr."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self._total = total
        self._enabled = enabled
        self._tty = sys.stderr.isatty()
        self._last = 0.0

    def update(self, done: int, *, final: bool = False) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if not final and now - self._last < (0.1 if self._tty else 2.0):
            return
        self._last = now
        if self._total:
            frac = min(1.0, done / self._total)
            bar = "#" * int(frac * 30)
            line = f"replay [{bar:<30}] {done}/{self._total} records {frac * 100:5.1f}%"
        else:
            line = f"replay {done} records"
        end = "\n" if final or not self._tty else ""
        sys.stderr.write(("\r" if self._tty else "") + line + end)
        sys.stderr.flush()


def _until_abs(until: float | None, first_s: float | None) -> float | None:
    if until is None:
        return None
    if until >= ABSOLUTE_TIME_THRESHOLD_S:
        return until
    if until < 0:
        raise ConfigError(f"--until must be >= 0, got {until}")
    return (first_s or 0.0) + until


class EventSource:
    """The records of ``path`` (``open_event_source``), remembering whether the log was cut short.

    After a full pass, :attr:`truncated` is true when our event log ends in a
    torn or damaged record (a writer killed mid-append): the records before it
    were yielded, the rest is lost, and the user should be told.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.truncated = False

    def _is_event_log(self) -> bool:
        p = Path(self.path)
        if not p.is_file():
            return False
        with open(p, "rb") as fh:
            return fh.read(len(LOG_MAGIC)) == LOG_MAGIC

    def __iter__(self) -> Iterator[LogRecord]:
        if self._is_event_log():
            with EventLogReader(self.path) as reader:
                yield from reader.records()
                self.truncated = reader.truncated
        else:
            yield from open_event_source(self.path)


def warn_truncated(command: str, path: str) -> None:
    """One warning line on stderr for a log that ends in a truncated record."""
    sys.stderr.write(
        f"tokenspeed-router {command}: warning: {path} ends in a truncated or damaged record "
        "(its writer stopped mid-write?); only the complete records before it were read\n"
    )
    sys.stderr.flush()


def _first_time(path: str) -> tuple[float | None, int, bool]:
    """First receive time, record count, truncated? (one cheap pass, for --until and the bar)."""
    first: float | None = None
    count = 0
    source = EventSource(path)
    for rec in source:
        if first is None:
            first = rec.recv_time_s
        count += 1
    return first, count, source.truncated


def replay_into(
    service: Any,
    records: Iterable[LogRecord],
    *,
    until_s: float | None = None,
    speed: float | None = None,
    progress: _Progress | None = None,
    stop: threading.Event | None = None,
) -> ReplayStats:
    """Apply ``records`` (in order) to ``service`` up to absolute time ``until_s``."""
    decoder = BatchDecoder()
    stats = ReplayStats()
    wall0 = time.monotonic()
    waiter = stop or threading.Event()
    for rec in records:
        if until_s is not None and rec.recv_time_s > until_s:
            break
        if stats.first_s is None:
            stats.first_s = rec.recv_time_s
        if speed is not None:
            due = wall0 + (rec.recv_time_s - stats.first_s) / speed
            delay = due - time.monotonic()
            if delay > 0 and waiter.wait(delay):
                break
        stats.last_s = rec.recv_time_s
        stats.records += 1
        stats.per_worker[rec.worker] = stats.per_worker.get(rec.worker, 0) + 1
        try:
            batch = decoder.decode(rec.payload)
        except WireError as err:
            stats.malformed += 1
            logger.debug("worker=%s seq=%d undecodable payload: %s", rec.worker, rec.seq, err)
            continue
        service.apply_record(rec.worker, rec.seq, batch, rec.recv_time_s, payload=rec.payload)
        if progress is not None:
            progress.update(stats.records)
    if progress is not None:
        progress.update(stats.records, final=True)
    return stats




def answer_queries(service: Any, lines: Iterable[str], out: IO[str]) -> int:
    """Answer each JSON line as ``POST /match`` would; bad lines get ``{"error": ...}``."""
    from tokenspeed_router.errors import TokenspeedError
    from tokenspeed_router.server.api import MatchRequest, api_error, decode_json, validate_request

    decoder = msgspec.json.Decoder(MatchRequest)
    encoder = msgspec.json.Encoder()
    n = 0
    for lineno, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        n += 1
        try:
            req = decode_json(decoder, text.encode())
            validate_request(req, service.config.limits)
            answer: dict[str, Any] = service.match(req.token_ids, lora_id=req.lora_id, salt=req.salt).to_dict()
        except TokenspeedError as err:
            answer = {"error": f"line {lineno}: {api_error(err).message}"}
        out.write(encoder.encode(answer).decode() + "\n")
    out.flush()
    return n


def _roles_from_meta(path: str) -> dict[str, WorkerRole]:
    """Worker roles recorded by ``serve --record`` in the log header (else empty)."""
    from tokenspeed_router.server.config import WorkerSpec

    p = Path(path)
    if p.is_dir():
        return {}
    try:
        with EventLogReader(p) as reader:
            meta = reader.meta
    except (EventLogError, OSError):
        return {}
    roles: dict[str, WorkerRole] = {}
    for data in meta.get("workers", []) or []:
        try:
            spec = WorkerSpec.from_mapping(data)
        except ConfigError:
            continue
        for sub in spec.subscribers():
            roles[sub.name] = sub.role
    return roles


def _iter_lines(path: str) -> Iterator[str]:
    if path == "-":
        yield from sys.stdin
        return
    try:
        with open(path, encoding="utf-8") as fh:
            yield from fh
    except OSError as err:
        raise ConfigError(f"--queries {path}: {err}") from err


def _replay_decisions(args: argparse.Namespace, service: Any, until_s: float | None) -> int:
    """``replay LOG --decisions FILE``: see ``tools/decision_replay.py``."""
    from tokenspeed_router.server.config import parse_router_options
    from tokenspeed_router.server.decision_log import DecisionLogReader
    from tokenspeed_router.tools.decision_replay import redecide_config, replay_decisions

    reader = DecisionLogReader(args.decisions)
    first = next(iter(reader), None)
    options = parse_router_options(args.router_option or [], "--router-option")
    config = redecide_config(first, args.policy, options, logged_view=False)
    out: IO[str] | None = None
    if args.decisions_out:
        try:
            out = open(args.decisions_out, "w", encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as err:
            raise ConfigError(f"--decisions-out {args.decisions_out}: {err}") from err
    try:
        reader.malformed = 0  # the peek above read the first decision once
        comparison = replay_decisions(service, open_event_source(args.file), reader, config, out=out,
                                      until_s=until_s)
    finally:
        if out is not None:
            out.close()
    summary = {**comparison.to_dict(), "malformed_lines": reader.malformed}
    sys.stdout.write(json.dumps(summary, sort_keys=True) + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    from tokenspeed_router.server.app import RouterService
    from tokenspeed_router.server.http import HttpServer

    if args.speed is not None and not args.speed > 0:
        raise ConfigError(f"--speed must be positive, got {args.speed}")
    if not Path(args.file).exists():
        raise ConfigError(f"{args.file}: no such file or directory")
    if args.decisions_out and not args.decisions:
        raise ConfigError("--decisions-out needs --decisions FILE")
    if args.decisions and (args.queries or args.serve):
        raise ConfigError("--decisions replays the log decision by decision: not with --queries or --serve")
    if args.queries and args.queries != "-" and not Path(args.queries).is_file():
        # Checked up front: a long replay must not end in "file not found".
        raise ConfigError(f"--queries {args.queries}: no such file")
    config = config_from_args(args, workers=(), record=None, state=None)
    try:
        first_s, total, truncated = _first_time(args.file)
    except EventLogError as err:
        raise ConfigError(str(err)) from err
    if truncated:
        warn_truncated("replay", args.file)
    service = RouterService(config)
    roles = _roles_from_meta(args.file)
    if roles:
        service.preset_roles(roles)
    if args.decisions:
        try:
            return _replay_decisions(args, service, _until_abs(args.until, first_s))
        finally:
            service.stop()
    stop = threading.Event()
    progress = _Progress(total, enabled=not args.no_progress)
    with shutdown_signals(stop.set):
        stats = replay_into(
            service,
            open_event_source(args.file),
            until_s=_until_abs(args.until, first_s),
            speed=args.speed,
            progress=progress,
            stop=stop,
        )
    if stats.malformed:
        logger.warning("%d undecodable records skipped", stats.malformed)
    if args.queries:
        answer_queries(service, _iter_lines(args.queries), sys.stdout)
    if args.serve:
        if config.http is None:
            raise ConfigError("--serve needs an HTTP address (--http HOST:PORT)")
        http = HttpServer(service, config.http)
        with shutdown_signals(http.request_shutdown):
            http.run()
    elif not args.queries:
        summary = {
            "records": stats.records,
            "workers": {w: service.index.num_blocks(w) for w in service.index.workers()},
        }
        sys.stdout.write(json.dumps(summary, sort_keys=True) + "\n")
    service.stop()
    return 0
