"""``tokenspeed-router loadgen``: replay a Mooncake trace against an OpenAI endpoint (DESIGN §11).

Prints one summary table on stdout, a progress line on stderr, and writes
``results.json`` (config, trace statistics, summary, one row per request) and
``loadgen.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.loadgen.prompts import (
    PromptBuilder,
    PromptConfig,
    PromptFormat,
    scale_prompts,
)
from tokenspeed_router.loadgen.replay import ReplayConfig, ReplayOutcome, discover_model, replay
from tokenspeed_router.loadgen.report import (
    format_runs_table,
    summarize,
    write_plots,
    write_results,
)
from tokenspeed_router.sim.runner import ProgressBar
from tokenspeed_router.sim.traces import TraceWindow, load_mooncake, trace_summary

__all__ = ["add_arguments", "results_document", "run"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake-format .jsonl trace")
    parser.add_argument("--target", required=True, action="append",
                        help="OpenAI-compatible base URL (http://HOST:PORT), e.g. a router or an engine; "
                             "repeat for router replicas (requests alternate between them)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="divide the trace's timestamps by K (default 1: real time)")
    parser.add_argument("--limit", type=int, default=None, help="send only the first N requests")
    parser.add_argument("--start-s", type=float, default=0.0,
                        help="skip requests before this trace time (s, before scaling)")
    parser.add_argument("--duration-s", type=float, default=None,
                        help="only requests within this much trace time after --start-s")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for results.json and plots (default: a temp dir)")
    parser.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    parser.add_argument("--prompt-format", choices=[f.value for f in PromptFormat], default="tokens",
                        help="tokens: prompt as token ids; text: ids as digit words (engine-sim "
                             "maps them back), for routers that only read text (default tokens)")
    parser.add_argument("--tokens-per-hash-id", type=int, default=512,
                        help="prompt tokens covered by one trace hash id (Mooncake: 512)")
    parser.add_argument("--scale-prompts", type=float, default=1.0, metavar="F",
                        help="each hash id covers F times as many tokens (0.125: 512 -> 64); same "
                             "prefix sharing, F times less data to move (default 1)")
    parser.add_argument("--max-output-tokens", type=int, default=None,
                        help="cap each request's max_tokens (default: the trace's output_length)")
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="do not send ignore_eos (for endpoints that reject unknown fields)")
    parser.add_argument("--token-key", type=int, default=0,
                        help="key of the hash id -> tokens expansion (runs with different keys share nothing)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout (default 600)")
    parser.add_argument("--max-connections", type=int, default=1024,
                        help="connection pool size (default 1024; open loop needs one per request in flight)")
    parser.add_argument("--label", default=None, help="name of this run in the table and results")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def results_document(
    outcome: ReplayOutcome, summary: dict[str, Any], *, config: dict[str, Any],
    trace_stats: dict[str, float],
) -> dict[str, Any]:
    """``results.json``: what was run, the summary, and one row per request."""
    return {
        "config": config,
        "trace_stats": trace_stats,
        "max_send_lateness_s": outcome.max_send_lateness_s,
        "summary": summary,
        "requests": [r.as_dict() for r in outcome.records],
    }


def run(args: argparse.Namespace) -> int:
    # One line per request at INFO would drown the progress line.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.time_scale <= 0:
        raise ConfigError(f"--time-scale must be > 0, got {args.time_scale}")
    if args.tokens_per_hash_id <= 0:
        raise ConfigError(f"--tokens-per-hash-id must be > 0, got {args.tokens_per_hash_id}")
    requests = load_mooncake(
        args.trace,
        TraceWindow(start_s=args.start_s, duration_s=args.duration_s, max_requests=args.limit,
                    rate_scale=args.time_scale),
        block_tokens=args.tokens_per_hash_id,
    )
    if not requests:
        raise ConfigError(f"{args.trace}: no requests in the chosen window")
    if args.scale_prompts != 1.0:
        requests = scale_prompts(requests, args.scale_prompts)
    replay_config = ReplayConfig(target=args.target[0], extra_targets=tuple(args.target[1:]),
                                 timeout_s=args.timeout_s,
                                 max_connections=args.max_connections)
    model = args.model or discover_model(replay_config)
    builder = PromptBuilder(PromptConfig(
        model=model, prompt_format=args.prompt_format, max_output_tokens=args.max_output_tokens,
        ignore_eos=not args.no_ignore_eos, token_key=args.token_key,
    ))
    stats = trace_summary(requests)
    label = args.label or ",".join(args.target)
    print(f"loadgen: {len(requests)} requests from {args.trace.name} over {stats['span_s']:.0f} s "
          f"({stats['req_per_s']:.1f} req/s) -> {label} model {model!r}", file=sys.stderr)
    bar = None
    if not args.quiet:
        bar = ProgressBar()
        bar.start("loadgen")
    outcome = replay(requests, builder, replay_config, progress=bar)
    summary = summarize(outcome.records, wall_s=outcome.wall_s)
    out_dir = args.out or Path(tempfile.gettempdir()) / "tokenspeed-router-loadgen"
    config = {
        "trace": str(args.trace), "targets": args.target, "label": label, "model": model,
        "time_scale": args.time_scale, "limit": args.limit, "start_s": args.start_s,
        "duration_s": args.duration_s, "prompt_format": PromptFormat(builder.config.prompt_format).value,
        "tokens_per_hash_id": args.tokens_per_hash_id, "scale_prompts": args.scale_prompts, "max_output_tokens": args.max_output_tokens,
        "ignore_eos": builder.config.ignore_eos, "token_key": args.token_key,
    }
    path = write_results(results_document(outcome, summary, config=config, trace_stats=stats), out_dir)
    plots = write_plots({label: outcome.records}, out_dir, title=f"loadgen: {args.trace.name} -> {label}")
    print(format_runs_table({label: summary}, label="target"))
    if outcome.max_send_lateness_s > 0.5:
        print(f"note: sends ran up to {outcome.max_send_lateness_s:.2f} s behind the trace "
              "(the load generator was the bottleneck)", file=sys.stderr)
    if summary["errors"]:
        print(f"errors: {summary['errors']} ({summary['error_kinds']})", file=sys.stderr)
    print(f"results: {path}")
    if plots:
        print(f"plot: {plots[0]}")
    else:
        print("plots skipped: matplotlib is not installed (pip install 'tokenspeed-router[plot]')")
    return 0 if summary["ok"] else 1
