"""``tokenspeed-router serve``: subscribers, index, HTTP and ZMQ query API (DESIGN §6).

Start-up order is chosen so that every configuration problem fails before
anything is subscribed: configuration is merged and validated, the state
backend is resolved, the HTTP and ZMQ listeners are *bound* (a port in use is
an error at start, not a log line later), and only then the subscribers
start. SIGTERM and SIGINT stop the listeners, stop ingestion and close the
event log (flushing it); the exit code is 0 after a clean shutdown.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.gateway.config import GatewayConfig
from tokenspeed_router.process import shutdown_signals
from tokenspeed_router.server.config import ServerConfig, load_server_config
from tokenspeed_router.server.explain import ExplainConfig

__all__ = ["add_arguments", "add_epp_arguments", "add_explain_arguments", "add_gateway_arguments",
           "add_listener_arguments", "config_from_args", "epp_config", "run"]

logger = logging.getLogger(__name__)

#: Shorter than CPython's 5 ms default: the ingestion thread, the ZMQ API
#: thread and the HTTP loop take turns on the GIL, and a 5 ms slice would
#: show up directly in query p99 and event-to-visible latency.
GIL_SWITCH_INTERVAL_S = 0.0005


def add_listener_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``serve`` and ``replay --serve``."""
    parser.add_argument(
        "--http", metavar="HOST:PORT",
        help="HTTP API listen address (default 127.0.0.1:8000; 'none' disables; "
        "env TOKENSPEED_ROUTER_HTTP)",
    )
    parser.add_argument(
        "--zmq-api", metavar="ENDPOINT",
        help="ZeroMQ query API bind endpoint, e.g. tcp://127.0.0.1:8001 (env TOKENSPEED_ROUTER_ZMQ_API)",
    )
    parser.add_argument(
        "--auth-token", metavar="TOKEN",
        help="require 'Authorization: Bearer TOKEN' on every API call but /health "
        "(env TOKENSPEED_ROUTER_AUTH_TOKEN; prefer --auth-token-file: argv is visible in ps)",
    )
    parser.add_argument("--auth-token-file", metavar="FILE", help="read the token from FILE")
    parser.add_argument("--max-body-bytes", type=int, metavar="N", help="largest API request body (default 8 MiB)")
    parser.add_argument("--max-tokens", type=int, metavar="N", help="most token ids per request (default 1048576)")
    parser.add_argument("--policy", help="routing policy: kv_aware (default), random, round_robin, least_loaded, approx")
    parser.add_argument(
        "--router-option", action="append", metavar="KEY=VALUE",
        help="a RouterConfig knob other than policy and inflight_timeout_s, e.g. queue_weight=0.5 (repeatable; env "
        "TOKENSPEED_ROUTER_ROUTER_OPTIONS='k=v;k=v'; TOML [router] table)",
    )
    parser.add_argument("--inflight-timeout-s", type=float, metavar="S", help="in-flight entries expire after S seconds")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--worker", action="append", metavar="SPEC",
        help="name=NAME,events=ENDPOINT[,replay=ENDPOINT][,role=prefill|decode|both][,dp_ranks=N][,topic=T]"
        "[,url=http://HOST:PORT][,curve_server_key=RELAY.key,curve_key=OWN.key_secret] "
        "(repeatable; env TOKENSPEED_ROUTER_WORKERS='spec;spec'; TOML [[workers]] tables)",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML config file (env TOKENSPEED_ROUTER_CONFIG)")
    parser.add_argument("--state", metavar="URL", help="shared state backend, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--record", metavar="FILE", help="also write every received message to this event log")
    parser.add_argument(
        "--stale-after-s", type=float, metavar="S",
        help="mark a worker stale after its endpoint has been unreachable for S seconds (default 10)",
    )
    parser.add_argument("--replay-timeout-s", type=float, metavar="S", help="gap replay timeout (default 2)")
    parser.add_argument(
        "--processes", type=int, metavar="N", default=1,
        help="run N gateway processes on the one --http port (SO_REUSEPORT), sharing in-flight work "
        "through --state, or through a private redis-server when --state is not given (docs/replicas.md)",
    )
    parser.add_argument(
        "--reuse-port", action="store_true",
        help="bind the HTTP port with SO_REUSEPORT, so other processes may listen on it too",
    )
    parser.add_argument(
        "--ingest-max-lag-s", type=float, metavar="S",
        help="a worker's stream more than S seconds behind its publisher sheds its backlog and resyncs (default 1)",
    )
    parser.add_argument(
        "--ingest-queue", type=int, metavar="N",
        help="event batches one ingest pass reads at most before applying them (default 4096)",
    )
    add_gateway_arguments(parser)
    add_epp_arguments(parser)
    add_explain_arguments(parser)
    add_listener_arguments(parser)


def add_epp_arguments(parser: argparse.ArgumentParser) -> None:
    """The endpoint picker for Kubernetes inference gateways (DESIGN §10; docs/epp.md). Each is
    also a TOML key and a TOKENSPEED_ROUTER_<KEY> variable, spelled with '_'."""
    g = parser.add_argument_group("Endpoint Picker (Envoy ext_proc, Gateway API Inference Extension)")
    g.add_argument("--epp", metavar="HOST:PORT",
                   help="serve the endpoint picker (gRPC ext_proc and health) here, on the same routing core; "
                   "needs the epp extra (pip install 'tokenspeed-router[epp]')")
    g.add_argument("--epp-fallbacks", type=int, metavar="N",
                   help="fallback endpoints named after the chosen one, cheapest first (default 2; 0 for an Envoy "
                   "ORIGINAL_DST cluster on the header, which reads one address)")
    g.add_argument("--epp-max-in-flight", type=int, metavar="N",
                   help="answer 429 to new picks while N requests are in flight through the picker (default 0: never)")
    g.add_argument("--epp-leader-only", action="store_true", default=None,
                   help="readiness NOT_SERVING on every replica but the lease holder of --state ...?ingest=stream "
                   "(default: every replica picks, active-active)")


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    """Why this worker (DESIGN §13; docs/operations.md). Each is also a TOML key and a
    TOKENSPEED_ROUTER_<KEY> variable, spelled with '_'."""
    g = parser.add_argument_group("why this worker (explained decisions)")
    g.add_argument("--decision-log", metavar="FILE",
                   help="append explained routing decisions to FILE as JSON lines (read back by "
                   "replay/simulate --decisions)")
    g.add_argument("--explain-sample", metavar="RATE",
                   help="explain this fraction of decisions unasked, in [0, 1], deterministically (every "
                   "1/RATE-th); they get the x-tokenspeed-route header / explain field and go to the "
                   "decision log (default 1 with --decision-log, else 0)")
    g.add_argument("--decision-log-max-bytes", metavar="N",
                   help="rotate the decision log to FILE.1 at N bytes (default 268435456)")


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """The OpenAI gateway's flags (DESIGN §10; docs/gateway.md). Each is also a TOML key and
    a TOKENSPEED_ROUTER_<KEY> variable, spelled with '_'."""
    g = parser.add_argument_group("OpenAI gateway (workers with url=)")
    g.add_argument(
        "--tokenizer", metavar="engine|PATH",
        help="how text and chat prompts become token ids: 'engine' (default) asks the worker's "
        "POST /tokenize; PATH loads a Hugging Face tokenizer.json (+ tokenizer_config.json chat template)",
    )
    g.add_argument("--upstream-timeout-s", type=float, metavar="S",
                   help="longest wait on an engine for its first byte or between two stream chunks (default 600)")
    g.add_argument("--upstream-connect-timeout-s", type=float, metavar="S",
                   help="connect timeout to an engine (default 5)")
    g.add_argument("--upstream-max-connections", type=int, metavar="N",
                   help="pooled connections to engines, all workers together (default 1024)")
    g.add_argument("--upstream-retries", type=int, metavar="N",
                   help="other workers tried when one refuses or drops the connection before answering (default 2)")
    g.add_argument("--worker-down-cooldown-s", type=float, metavar="S",
                   help="a down worker is routed to again when its /health answers, or after S seconds (default 30)")
    g.add_argument("--truth-window", type=int, metavar="N",
                   help="judge each worker's reported cached tokens over its last N informative requests (default 16)")
    g.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="export one OpenTelemetry span per gateway request (the routing decision as attributes) "
                   "to this OTLP/HTTP endpoint, e.g. http://collector:4318/v1/traces; needs the otel extra")


def config_from_args(args: argparse.Namespace, **overrides: Any) -> ServerConfig:
    """Merge flags > environment > TOML file (see ``server/config.py``)."""
    flags = {
        "workers": getattr(args, "worker", None),
        "http": args.http,
        "zmq_api": args.zmq_api,
        "auth_token": args.auth_token,
        "auth_token_file": args.auth_token_file,
        "state": getattr(args, "state", None),
        "record": getattr(args, "record", None),
        "policy": args.policy,
        "router": args.router_option,
        "stale_after_s": getattr(args, "stale_after_s", None),
        "replay_timeout_s": getattr(args, "replay_timeout_s", None),
        "ingest_max_lag_s": getattr(args, "ingest_max_lag_s", None),
        "ingest_queue": getattr(args, "ingest_queue", None),
        "inflight_timeout_s": args.inflight_timeout_s,
        "max_body_bytes": args.max_body_bytes,
        "max_tokens": args.max_tokens,
        "epp": getattr(args, "epp", None),
        "epp_fallbacks": getattr(args, "epp_fallbacks", None),
        "epp_max_in_flight": getattr(args, "epp_max_in_flight", None),
        "epp_leader_only": getattr(args, "epp_leader_only", None),
    }
    for key in GatewayConfig.setting_names():
        flags[key] = getattr(args, key, None)
    for key in ExplainConfig.setting_names():
        flags[key] = getattr(args, key, None)
    flags.update(overrides)
    return load_server_config(flags, os.environ, getattr(args, "config", None))


def resolve_state_sink(url: str) -> Callable[[Any], Any]:
    """The state backend's sink factory for ``--state URL`` (see ``server/app.py``)."""
    try:
        from tokenspeed_router import state
    except ImportError as err:  # pragma: no cover - the package always ships it
        raise ConfigError(f"--state {url}: state backend unavailable: {err}") from err
    factory = getattr(state, "create_ingest_sink", None)
    if factory is None:
        raise ConfigError(f"--state {url}: this build's state backend has no create_ingest_sink()")
    def create(service: Any) -> Any:
        try:
            return factory(url, service)
        except ValueError as err:  # a URL redis-py refuses, past the checks in server/config.py
            raise ConfigError(f"--state {url}: {err}") from err

    return create


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    processes = getattr(args, "processes", 1)
    if processes != 1:
        return _supervise(args, config, processes)
    if not config.workers:
        logger.warning("no workers configured: add them with PUT /workers/{name} or --worker")
    sink_factory = resolve_state_sink(config.state) if config.state else None
    previous_interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        return _serve(config, sink_factory, reuse_port=getattr(args, "reuse_port", False))
    finally:
        sys.setswitchinterval(previous_interval)


def _supervise(args: argparse.Namespace, config: ServerConfig, processes: int) -> int:
    """``--processes N``: N ``serve`` children on one port (``server/processes.py``)."""
    from tokenspeed_router.server.processes import supervise_from_args

    if processes < 1:
        raise ConfigError(f"--processes must be at least 1, got {processes}")
    if config.zmq_api is not None:
        raise ConfigError("--processes N cannot share one --zmq-api endpoint: use the HTTP API")
    if config.epp is not None:
        raise ConfigError("--processes N cannot share one --epp port: run one picker per replica "
                          "(--state shares their in-flight work; docs/epp.md)")
    if config.record is not None:
        raise ConfigError("--processes N cannot write one --record log from N processes")
    if config.state is not None:
        resolve_state_sink(config.state)  # a bad URL fails here, not N times in the children
    argv = getattr(args, "argv", None) or sys.argv[1:]
    return supervise_from_args(argv, processes, config.http, config.state)


def epp_config(config: ServerConfig) -> Any:
    """The endpoint picker's settings (``epp/server.py``), or None without ``--epp``."""
    if config.epp is None:
        return None
    from tokenspeed_router.epp.picker import PickerSettings
    from tokenspeed_router.epp.server import EppConfig

    return EppConfig(address=config.epp, leader_only=config.epp_leader_only, picker=PickerSettings(
        fallbacks=config.epp_fallbacks, max_in_flight=config.epp_max_in_flight))


def _serve(config: ServerConfig, sink_factory: Callable[[Any], Any] | None, *, reuse_port: bool = False) -> int:
    from tokenspeed_router.server import gc_policy
    from tokenspeed_router.server.app import RouterService
    from tokenspeed_router.server.http import HttpServer, new_event_loop
    from tokenspeed_router.server.zmq_api import ZmqApiServer

    service = RouterService(config, sink_factory=sink_factory)
    http: HttpServer | None = None
    zmq_api: ZmqApiServer | None = None
    picker_alone: Any = None
    stop = threading.Event()

    def request_stop() -> None:
        stop.set()
        if http is not None:
            http.request_shutdown()

    try:
        epp = epp_config(config)
        if config.http is not None:
            http = HttpServer(service, config.http, reuse_port=reuse_port, epp=epp)
        elif epp is not None:  # the picker without the HTTP API: the gateway's parts, on a loop of its own
            from tokenspeed_router.epp.server import EppServer
            from tokenspeed_router.gateway.app import Gateway

            picker_alone = EppServer(service, Gateway(service, config.gateway), epp)
        if config.zmq_api is not None:
            zmq_api = ZmqApiServer(service, config.zmq_api)
        with shutdown_signals(request_stop):
            service.start()
            if zmq_api is not None:
                zmq_api.start()
            # everything made so far lives as long as the process: out of every collection
            # (settled first, so the pause metrics count serving, not this one deliberate pass)
            gc_policy.settle()
            gc_policy.configure()
            if http is not None:
                http.run()
            elif picker_alone is not None:
                from tokenspeed_router.epp.server import run_alone

                run_alone(picker_alone, stop, new_event_loop)
            else:
                while not stop.wait(1.0):
                    pass
    finally:
        if zmq_api is not None:
            zmq_api.stop()
        if http is not None:
            http.close()
        service.stop()
    if service.recorder is not None:
        logger.info("event log %s: %d records", config.record, service.recorder.records)
    return 0
