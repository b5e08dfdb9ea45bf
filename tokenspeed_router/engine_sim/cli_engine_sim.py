"""``tokenspeed-router engine-sim``: an inference engine without a model (DESIGN §11).

Serves vLLM's OpenAI API on ``--host:--port`` (see :mod:`.api`), decides
prefix-cache hits and evictions with the project's real ``PrefixCache`` and
publishes its KV events on ``--events`` (``--replay`` for the replay socket),
timed by the shared model (:mod:`tokenspeed_router.timing`, ``--timing``). Port 0 lets the OS choose (HTTP and events); the
first stdout line is JSON with the resolved ``url``, ``events`` and
``replay`` endpoints (lists of one per DP rank for events and replay), so
tests and scripts never guess ports. SIGTERM/SIGINT stop it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys

import uvicorn

from tokenspeed_router.endpoints import HostPort, bind_socket
from tokenspeed_router.engine_sim.api import EngineSimApp, create_app
from tokenspeed_router.engine_sim.engine import Engine, EngineConfig
from tokenspeed_router.engine_sim.publishing import EventOutlet, OutletConfig
from tokenspeed_router.engine_sim.tokenizer import SimTokenizer
from tokenspeed_router.errors import ConfigError
from tokenspeed_router.process import shutdown_signals
from tokenspeed_router.timing import PROFILES, TimingModel

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="HTTP listen address (default 127.0.0.1)")
    a("--port", type=int, required=True, help="HTTP port (0: OS-chosen, printed on stdout)")
    a("--events", required=True, help="KV event PUB endpoint to bind, e.g. tcp://127.0.0.1:5557")
    a("--replay", default=None, help="KV event replay ROUTER endpoint to bind (optional)")
    a("--role", choices=["both", "prefill", "decode"], default="both", help="P/D role (default both)")
    a("--block-size", type=int, default=16, help="KV block (page) size in tokens (default 16)")
    a("--capacity-tokens", type=int, default=262_144, help="prefix cache size in tokens (default 262144)")
    a("--timing", choices=PROFILES, default="chunked",
      help="scheduler profile (the one simulate --timing uses too): fifo = one prefill at a time, "
           "overhead + uncached tokens / rate, decode without contention; chunked = vLLM-style "
           "steps with a token budget (default chunked)")
    a("--prefill-tokens-per-s", type=float, default=20_000.0, help="prefill throughput (default 20000)")
    a("--prefill-overhead-ms", type=float, default=None,
      help="fixed cost per prefill (fifo) or per step that prefills (chunked); "
           "default 20 ms for fifo, 0 for chunked")
    a("--decode-s-per-token", type=float, default=0.02,
      help="decode step time with one running sequence (default 0.02 s)")
    a("--decode-batch-cost", type=float, default=0.02,
      help="each extra decoding sequence adds this fraction of --decode-s-per-token (default 0.02)")
    a("--max-batched-tokens", type=int, default=2048, help="token budget per step (default 2048)")
    a("--max-num-seqs", type=int, default=64, help="requests running at once (default 64)")
    a("--max-model-len", type=int, default=131_072, help="longest prompt accepted (default 131072)")
    a("--time-scale", type=float, default=1.0, help="divide modelled times by K (0 = instant)")
    a("--instant", action="store_true", help="answer without modelled delays (same as --time-scale 0)")
    a("--wire-format", choices=["map", "array"], default="map", help="KV event encoding (default map)")
    a("--dp-ranks", type=int, default=1, help="data-parallel ranks; rank r publishes on port + r")
    a("--model", default="tokenspeed-sim", help="served model name (default tokenspeed-sim)")
    a("--name", default=None, help="engine id in answers (system_fingerprint, x-engine-id); "
      "default engine-sim-PORT")
    a("--seed", type=int, default=0, help="seed of the fault knobs' RNG (default 0)")
    a("--fault-restart-after-requests", type=int, default=None, metavar="N",
      help="once N requests finished, restart: fresh cache, fresh publisher at seq 0")
    a("--fault-drop-events", type=float, default=0.0, metavar="RATIO",
      help="drop this fraction of event batches before they are numbered (silent loss)")
    a("--fault-publish-block-size", type=int, default=None, metavar="N",
      help="publish events as if the block size were N (a misconfigured engine)")
    a("--fault-tokenizer-skew", action="store_true",
      help="/tokenize and /render answers differ from the tokens cached (an extra leading token)")
    # Misconfigurations `tokenspeed-router doctor` must name (docs/operations.md lists them):
    a("--fault-chat-template", action="store_true",
      help="/tokenize renders chat messages with another template than chat requests are cached under")
    a("--fault-hash-seed", type=int, default=None, metavar="N",
      help="publish block ids hashed with seed N while parent links keep the cache's ids "
      "(processes hashing with different seeds, vLLM without one PYTHONHASHSEED)")
    a("--fault-no-events", action="store_true",
      help="publish no KV events at all (an engine started without --kv-events-config)")
    a("--fault-no-usage-details", action="store_true",
      help="answer usage without prompt_tokens_details.cached_tokens "
      "(vLLM without --enable-prompt-tokens-details)")
    a("--fault-event-delay", type=float, default=0.0, metavar="S",
      help="publish each event batch S seconds after the step that made it (a backed-up publisher)")
    a("--fault-dp-rank", type=int, default=None, metavar="R",
      help="batches claim DP rank R instead of their own (rank and port disagree)")
    a("--fault-lora-id", type=int, default=None, metavar="ID",
      help="tag every BlockStored with this LoRA id although no request names one")


def build(args: argparse.Namespace) -> tuple[EngineSimApp, list[Engine], list[EventOutlet]]:
    """Engines (one per DP rank), their publishers and the HTTP app; raises ConfigError."""
    if not 0.0 <= args.fault_drop_events <= 1.0:
        raise ConfigError(f"--fault-drop-events must be in [0, 1], got {args.fault_drop_events}")
    if args.dp_ranks < 1:
        raise ConfigError(f"--dp-ranks must be >= 1, got {args.dp_ranks}")
    if args.fault_publish_block_size is not None and args.fault_publish_block_size <= 0:
        raise ConfigError("--fault-publish-block-size must be positive")
    if not 0.0 <= args.fault_event_delay <= 3600.0:
        raise ConfigError(f"--fault-event-delay must be in [0, 3600] seconds, got {args.fault_event_delay}")
    if args.fault_dp_rank is not None and args.fault_dp_rank < 0:
        raise ConfigError("--fault-dp-rank must be >= 0")
    timing = TimingModel(
        profile=args.timing,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        prefill_overhead_s=None if args.prefill_overhead_ms is None else args.prefill_overhead_ms / 1000.0,
        decode_s_per_token=args.decode_s_per_token,
        decode_batch_cost=args.decode_batch_cost,
        max_batched_tokens=args.max_batched_tokens,
        time_scale=0.0 if args.instant else args.time_scale,
    )
    name = args.name or f"engine-sim-{args.port}"
    outlets: list[EventOutlet] = []
    engines: list[Engine] = []
    try:
        for rank in range(args.dp_ranks):
            outlet = EventOutlet(OutletConfig(
                events_endpoint=args.events,
                replay_endpoint=args.replay,
                dp_rank=rank,
                wire_format=args.wire_format,
                drop_ratio=1.0 if args.fault_no_events else args.fault_drop_events,
                publish_block_size=args.fault_publish_block_size,
                seed=args.seed + rank,
                hash_seed=args.fault_hash_seed,
                dp_rank_override=args.fault_dp_rank,
                lora_id=args.fault_lora_id,
                delay_s=args.fault_event_delay,
            ))
            outlets.append(outlet)
            config = EngineConfig(
                name=name,
                role=args.role,
                block_size=args.block_size,
                capacity_tokens=args.capacity_tokens,
                max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len,
                timing=timing,
                restart_after_requests=args.fault_restart_after_requests,
                seed=args.seed,
            )
            engines.append(Engine(config, outlet))
    except Exception:
        for outlet in outlets:
            outlet.close()
        raise
    app = EngineSimApp(
        engines, SimTokenizer(skew=args.fault_tokenizer_skew, chat_template_skew=args.fault_chat_template),
        model=args.model, kv_host=args.host, kv_port=args.port,
        report_cached_tokens=not args.fault_no_usage_details,
    )
    return app, engines, outlets


def run(args: argparse.Namespace) -> int:
    sock = bind_socket(HostPort(args.host, args.port))
    port = sock.getsockname()[1]
    if args.port == 0:
        args.port = port
    try:
        sim_app, engines, outlets = build(args)
    except Exception:
        sock.close()
        raise
    sim_app.kv_port = port
    config = uvicorn.Config(
        create_app(sim_app), log_level="warning", access_log=False, lifespan="off",
        server_header=False, date_header=False, timeout_keep_alive=30,
        timeout_graceful_shutdown=3, limit_concurrency=8192, backlog=2048,
    )
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]

    async def main() -> None:
        loops = [asyncio.ensure_future(e.run()) for e in engines]
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.005)
        if server.started:
            info = {
                "url": f"http://{args.host}:{port}",
                "name": sim_app.name,
                "model": sim_app.model,
                "events": [o.endpoint for o in outlets],
                "replay": [o.replay_endpoint for o in outlets],
            }
            sys.stdout.write(json.dumps(info) + "\n")
            sys.stdout.flush()
            logger.info("engine-sim %s serving on http://%s:%d", sim_app.name, args.host, port)
        try:
            await serving
        finally:
            for e in engines:
                e.close()
            await asyncio.gather(*loops, return_exceptions=True)

    def stop() -> None:
        server.should_exit = True

    try:
        with shutdown_signals(stop):
            asyncio.run(main())
    finally:
        sock.close()
        for outlet in outlets:
            outlet.close()
    return 0
