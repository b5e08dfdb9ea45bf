"""The ``tokenspeed-router`` command line (DESIGN §6-7).

Each sub-command lives in its own module exposing
``add_arguments(parser)`` and ``run(args) -> int``; this file only knows their
names and one-line help, and imports a module when its command runs, so that
``tokenspeed-router serve`` never imports torch and ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from tokenspeed_router import __version__
from tokenspeed_router.errors import TokenspeedError

#: command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("tokenspeed_router.loadgen.cli_demo",
             "engine-sims + gateway + trace load: our routing against the baselines (~2 min)"),
    "serve": ("tokenspeed_router.server.cli_serve", "run the router: subscribers, index, HTTP/ZMQ API"),
    "record": ("tokenspeed_router.tools.cli_record", "subscribe to workers and write an event log"),
    "replay": ("tokenspeed_router.tools.cli_replay", "rebuild the index from an event log"),
    "inspect": ("tokenspeed_router.tools.cli_inspect", "summarise an event log or a live router"),
    "simulate": ("tokenspeed_router.sim.cli_simulate", "trace-driven evaluation of routing policies"),
    "trace": ("tokenspeed_router.sim.cli_trace",
              "write a seeded synthetic trace of one workload shape (Mooncake format); --list names them"),
    "bench": ("tokenspeed_router.bench.cli_bench", "benchmark ingestion, matching and routing"),
    "loadgen": ("tokenspeed_router.loadgen.cli_loadgen",
                "replay a Mooncake trace against an OpenAI endpoint (TTFT, hit ratio, spread)"),
    "relay": ("tokenspeed_router.relay.cli_relay", "follow one engine's KV events, republish them with snapshots"),
    "doctor": ("tokenspeed_router.doctor.cli_doctor",
               "check that the engines and the router agree (events, block size, tokens, hashes, usage)"),
    "engine-sim": (
        "tokenspeed_router.engine_sim.cli_engine_sim",
        "a simulated vLLM engine: OpenAI API, real prefix cache, real KV events",
    ),
}

#: commands that run real PrefixCaches and therefore need the ``torch`` extra;
#: every other command works from the router-only install (``pip install .``)
NEEDS_TORCH: frozenset[str] = frozenset({"demo", "simulate", "engine-sim"})

TORCH_HINT = (
    "needs torch: pip install 'tokenspeed-router[torch]' "
    "(CPU build: --extra-index-url https://download.pytorch.org/whl/cpu; see docs/install.md)"
)


def _is_missing_torch(err: ModuleNotFoundError) -> bool:
    return (err.name or "").partition(".")[0] == "torch"


def _require_torch() -> None:
    """Fail before any work is done, rather than after a trace has been loaded."""
    importlib.import_module("torch")


#: the names ``--log-level`` accepts (any case), besides a numeric level
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    """An argparse type: a known level name, so a typo is a usage error, not a traceback."""
    level = str(text).strip().upper()
    if level in LOG_LEVELS or level.isdigit():
        return level
    raise argparse.ArgumentTypeError(f"unknown level {text!r}; choose from {', '.join(LOG_LEVELS)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenspeed-router",
        description="Event-streaming KV-cache router for disaggregated LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("TOKENSPEED_ROUTER_LOG_LEVEL", "INFO"),
        type=_log_level,
        help="logging level (default INFO; env TOKENSPEED_ROUTER_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (_module_name, help_text) in COMMANDS.items():
        # Parsers for the command actually invoked are filled in lazily below.
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        # Also accepted after the command (`serve --log-level DEBUG`), as users type it.
        command_parser.add_argument(
            "--log-level", type=_log_level, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    command = next((a for a in argv if a in COMMANDS), None)
    if command is not None:
        try:
            module = importlib.import_module(COMMANDS[command][0])
        except ModuleNotFoundError as err:
            if not _is_missing_torch(err):
                raise
            print(f"tokenspeed-router {command}: error: {TORCH_HINT}", file=sys.stderr)
            return 2
        subparsers = next(
            a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
        )
        module.add_arguments(subparsers.choices[command])
    args = parser.parse_args(argv)
    args.argv = argv  # the command line as given (serve --processes starts children with it)
    logging.basicConfig(
        level=int(args.log_level) if args.log_level.isdigit() else args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if command in NEEDS_TORCH:
            _require_torch()
        return int(module.run(args) or 0)
    except ModuleNotFoundError as err:
        if not _is_missing_torch(err):
            raise
        print(f"tokenspeed-router {command}: error: {TORCH_HINT}", file=sys.stderr)
        return 2
    except TokenspeedError as err:
        print(f"tokenspeed-router {command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
