"""``tokenspeed-router relay``: the event relay sidecar (DESIGN §12).

    tokenspeed-router relay --engine tcp://127.0.0.1:5557 [--engine-replay tcp://127.0.0.1:5558] \\
      --publish tcp://0.0.0.0:6557 --replay tcp://0.0.0.0:6558 \\
      [--curve-secret-key FILE --curve-allow PUBKEY_FILE...] [--hashes-only]
    tokenspeed-router relay --gen-keys DIR [--key-name NAME]

Once its sockets are bound it prints one line ``relay publish=... replay=...``
(with OS-chosen ports resolved) on stdout; it runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", metavar="ENDPOINT", help="the engine's KV event PUB endpoint (connect)")
    parser.add_argument("--engine-replay", metavar="ENDPOINT", help="the engine's replay ROUTER endpoint")
    parser.add_argument("--publish", metavar="ENDPOINT", help="our PUB endpoint (bind; port 0 = any)")
    parser.add_argument("--replay", metavar="ENDPOINT", help="our replay/snapshot ROUTER endpoint (bind)")
    parser.add_argument(
        "--curve-secret-key", metavar="FILE",
        help="our CURVE secret certificate (NAME.key_secret): encrypt and authenticate both sockets",
    )
    parser.add_argument(
        "--curve-allow", metavar="PUBKEY_FILE", nargs="+", action="extend", default=[],
        help="public certificate(s) of the routers allowed to connect (repeatable)",
    )
    parser.add_argument(
        "--hashes-only", action="store_true",
        help="publish the router's content hashes instead of token ids (no token id leaves this host)",
    )
    parser.add_argument("--topic", default="", help="the engine's topic, republished under it "
                        "(default: any topic, republished under the one the engine's messages carry)")
    parser.add_argument(
        "--buffer-steps", type=int, default=10_000, metavar="N",
        help="batches our replay ring keeps; older history is served as a snapshot (default 10000)",
    )
    parser.add_argument("--wire-format", choices=("map", "array"), default="map", help="encoding we publish")
    parser.add_argument("--replay-timeout-s", type=float, default=2.0, metavar="S", help="engine replay timeout")
    parser.add_argument(
        "--metrics", metavar="HOST:PORT", help="serve Prometheus metrics on http://HOST:PORT/metrics"
    )
    parser.add_argument("--gen-keys", metavar="DIR", help="write a CURVE key pair into DIR and exit")
    parser.add_argument("--key-name", default="relay", help="file name stem for --gen-keys (default relay)")


def run(args: argparse.Namespace) -> int:
    from tokenspeed_router.endpoints import parse_endpoint, parse_host_port
    from tokenspeed_router.errors import ConfigError
    from tokenspeed_router.events.curve import generate_key_files
    from tokenspeed_router.process import shutdown_signals
    from tokenspeed_router.relay.relay import EventRelay, RelayConfig

    if args.gen_keys:
        public, secret = generate_key_files(args.gen_keys, args.key_name)
        print(f"public key (give to peers): {public}\nsecret key (keep here):     {secret}")
        return 0
    for flag in ("engine", "publish", "replay"):
        if not getattr(args, flag):
            raise ConfigError(f"relay: --{flag} is required")
    parse_endpoint(args.engine, what="--engine", connect=True)
    if args.engine_replay:
        parse_endpoint(args.engine_replay, what="--engine-replay", connect=True)
    parse_endpoint(args.publish, what="--publish", allow_wildcard_port=True)
    parse_endpoint(args.replay, what="--replay", allow_wildcard_port=True)
    if args.replay_timeout_s is not None and not args.replay_timeout_s > 0:
        raise ConfigError(f"--replay-timeout-s must be positive, got {args.replay_timeout_s}")
    metrics_at = parse_host_port(args.metrics, what="--metrics") if args.metrics else None
    if not args.curve_secret_key and not _loopback_only(args.publish, args.replay):
        logger.warning(
            "relay: binding beyond loopback without --curve-secret-key: any host can subscribe%s",
            "" if args.hashes_only else " and read prompts' token ids (consider --hashes-only)",
        )
    config = RelayConfig(
        engine=args.engine,
        engine_replay=args.engine_replay or None,
        publish=args.publish,
        replay=args.replay,
        topic=args.topic,
        buffer_steps=args.buffer_steps,
        wire_format=args.wire_format,
        hashes_only=args.hashes_only,
        curve_secret_key=args.curve_secret_key,
        curve_allow=tuple(args.curve_allow),
        replay_timeout_s=args.replay_timeout_s,
    )
    stop = threading.Event()
    with EventRelay(config) as relay:
        http = None
        if metrics_at is not None:
            from prometheus_client import start_http_server

            from tokenspeed_router.relay.metrics import relay_registry

            http, _ = start_http_server(metrics_at.port, metrics_at.host, registry=relay_registry(relay.statistics))
        line = f"relay publish={relay.endpoint} replay={relay.replay_endpoint}"
        if http is not None:
            line += f" metrics=http://{metrics_at.host if metrics_at else ''}:{http.server_port}/metrics"
        print(line, flush=True)
        try:
            with shutdown_signals(stop.set):
                relay.run(stop)
        finally:
            if http is not None:
                http.shutdown()
                http.server_close()
        stats = relay.statistics()
    logger.info(
        "relay stopped: batches in=%d out=%d snapshots=%d restarts=%d resyncs=%d curve_rejected=%d",
        stats.batches_in, stats.batches_out, stats.ring.snapshots_served, stats.restarts,
        stats.resyncs, stats.curve_rejected,
    )
    sys.stdout.flush()
    return 0


def _loopback_only(*endpoints: str) -> bool:
    from tokenspeed_router.endpoints import is_loopback_host

    for endpoint in endpoints:
        if endpoint.startswith(("ipc://", "inproc://")):
            continue
        host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
        if not is_loopback_host(host):
            return False
    return True
