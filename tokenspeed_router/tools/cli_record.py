"""``tokenspeed-router record``: subscribe to workers and write an event log (DESIGN §7).

It runs the same subscriber machinery as ``serve`` (gap replay, restart
detection, staleness) with a sink that builds no index, so a log recorded
here and one recorded by ``serve --record`` are the same thing. Stops after
``--duration`` seconds or at SIGINT/SIGTERM; the log is flushed either way.
A live count goes to stderr (one line, rewritten in place on a terminal).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

from tokenspeed_router.process import shutdown_signals
from tokenspeed_router.server.config import check_output_path, load_server_config

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--worker", action="append", metavar="SPEC",
        help="name=NAME,events=ENDPOINT[,replay=ENDPOINT][,dp_ranks=N][,topic=T] (repeatable; "
        "env TOKENSPEED_ROUTER_WORKERS)",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML config file (its workers are used)")
    parser.add_argument("--out", required=True, metavar="FILE", help="event log to write (replaced)")
    parser.add_argument("--duration", type=float, metavar="S", help="stop after S seconds (default: until Ctrl-C)")
    parser.add_argument("--replay-timeout-s", type=float, metavar="S", help="gap replay timeout (default 2)")
    parser.add_argument("--quiet", action="store_true", help="no live count on stderr")


def run(args: argparse.Namespace) -> int:
    import os

    from tokenspeed_router.errors import ConfigError
    from tokenspeed_router.server.app import NullIngestSink, RouterService

    if args.duration is not None and not args.duration > 0:
        raise ConfigError(f"--duration must be positive, got {args.duration}")
    check_output_path(args.out, "--out")
    config = load_server_config(
        {"workers": args.worker, "record": args.out, "http": "none", "replay_timeout_s": args.replay_timeout_s},
        os.environ,
        args.config,
    )
    if not config.workers:
        raise ConfigError("record: no workers given (--worker, --config or TOKENSPEED_ROUTER_WORKERS)")
    service = RouterService(
        config, sink_factory=lambda _service: NullIngestSink(), record_source="tokenspeed-router record"
    )
    stop = threading.Event()
    started = time.monotonic()
    deadline = None if args.duration is None else started + args.duration
    tty = sys.stderr.isatty()
    print_every_s = 0.5 if tty else 5.0
    last_print = started
    with shutdown_signals(stop.set):
        service.start()
        try:
            while not stop.is_set():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                wait_s = 0.5 if deadline is None else max(0.0, min(0.5, deadline - now))
                stop.wait(wait_s)
                if not args.quiet and time.monotonic() - last_print >= print_every_s:
                    last_print = time.monotonic()
                    _print_count(service.recorder.records if service.recorder else 0, now - started, tty)
        finally:
            service.stop()
    records = service.recorder.records if service.recorder else 0
    if not args.quiet:
        if tty:
            sys.stderr.write("\n")
        sys.stderr.write(f"recorded {records} batches to {args.out} in {time.monotonic() - started:.1f}s\n")
    return 0


def _print_count(records: int, elapsed_s: float, tty: bool) -> None:
    line = f"recording: {records} batches in {elapsed_s:.1f}s"
    sys.stderr.write(("\r" + line) if tty else (line + "\n"))
    sys.stderr.flush()
