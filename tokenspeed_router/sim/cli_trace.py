"""``tokenspeed-router trace``: write a seeded synthetic trace of one workload shape (DESIGN §11).

``trace --shape NAME --seed N --requests N --out FILE`` writes a Mooncake
``.jsonl`` (512-token hash ids) for ``simulate``, ``loadgen`` and the
benchmarks, and prints one summary line on stderr. ``trace --list`` names the
shapes and the sources they are grounded in; with ``--shape`` it lists that
shape's parameters too. ``--rate`` and ``--param KEY=VALUE`` change a shape's
arrival rate and parameters; ``--load F`` instead finds the rate at which the
trace's prefill demand with ideal reuse is ``F`` of ``--capacity-tokens-per-s``
(default ``DEFAULT_CAPACITY_TOKENS_PER_S``: 8 engines x 10,000 tokens/s)
(docs/workloads.md).
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from pathlib import Path

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.sim.shapes import (
    SHAPES,
    generate_at_load,
    generate_trace,
    make_shape,
    shape_parameters,
)
from tokenspeed_router.sim.traces import ideal_load, trace_summary, write_mooncake

__all__ = ["DEFAULT_CAPACITY_TOKENS_PER_S", "add_arguments", "format_shape_list", "run"]

#: ``--capacity-tokens-per-s`` default: the headline fleet of docs/compare-routers.md, 8 engines that
#: prefill 10,000 tokens/s each (full-size prompt tokens)
DEFAULT_CAPACITY_TOKENS_PER_S = 8 * 10_000.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", metavar="NAME", help=f"workload shape: {', '.join(SHAPES)}")
    parser.add_argument("--seed", type=int, default=0, help="seed: the same seed writes the same file (default 0)")
    parser.add_argument("--requests", type=int, help="exactly this many requests")
    parser.add_argument("--out", help="the .jsonl file to write ('-' for stdout)")
    parser.add_argument("--list", action="store_true",
                        help="name the shapes and their sources (with --shape: its parameters too)")
    parser.add_argument("--rate", type=float, default=None, metavar="PER_S",
                        help="the shape's arrival rate: new sessions per second for session shapes, "
                             "requests per second otherwise (default: the shape's)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="set a shape parameter (repeatable), e.g. --param system_prompts=2")
    parser.add_argument("--load", type=float, default=None, metavar="F",
                        help="find the arrival rate at which the trace's prefill demand with ideal reuse "
                             "(one infinite cache) is F x --capacity-tokens-per-s, e.g. 0.35 (within 2 %%); "
                             "instead of --rate")
    parser.add_argument("--capacity-tokens-per-s", type=float, default=DEFAULT_CAPACITY_TOKENS_PER_S,
                        metavar="C", help="the cluster's prefill capacity that --load and the summary's "
                                          "ideal load refer to (default 80000: 8 engines x 10,000 tokens/s)")


def _params(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--param expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def format_shape_list(only: str | None = None) -> str:
    """The text of ``trace --list``: each shape, what it models, its sources (and parameters for ``only``)."""
    lines: list[str] = []
    for name, cls in SHAPES.items():
        if only is not None and name != only:
            continue
        lines.append(f"{name}: {cls.SUMMARY}")
        lines.append(f"  --rate sets {cls.RATE}")
        for source in cls.SOURCES:
            lines.extend(textwrap.wrap(source, width=100, initial_indent="  source: ",
                                       subsequent_indent="          "))
        if only is not None:
            lines.append("  parameters (--param KEY=VALUE):")
            for f in shape_parameters(cls):
                lines.append(f"    {f.name} = {f.default!r}: {f.metadata['doc']}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def run(args: argparse.Namespace) -> int:
    if args.list:
        if args.shape is not None and args.shape not in SHAPES:
            raise ConfigError(f"unknown shape {args.shape!r}; choose from {', '.join(SHAPES)}")
        sys.stdout.write(format_shape_list(args.shape))
        return 0
    if args.shape is None or args.requests is None or args.out is None:
        raise ConfigError("trace needs --shape NAME --requests N --out FILE (or --list)")
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise ConfigError(f"--rate must be a finite number > 0, got {args.rate}")
    capacity = args.capacity_tokens_per_s
    if not (math.isfinite(capacity) and capacity > 0):
        raise ConfigError(f"--capacity-tokens-per-s must be a finite number > 0, got {capacity}")
    params = _params(args.param)
    shape = make_shape(args.shape, params, rate_per_s=args.rate)
    if args.load is not None:
        if not (math.isfinite(args.load) and args.load > 0):
            raise ConfigError(f"--load must be a finite number > 0, got {args.load}")
        if args.rate is not None or shape.RATE in params:
            given = "--rate" if args.rate is not None else f"--param {shape.RATE}="
            raise ConfigError(f"--load sets the arrival rate ({shape.RATE}) itself; give {given} or --load, "
                              "not both")
        trace, shape = generate_at_load(shape, seed=args.seed, requests=args.requests, load=args.load,
                                        capacity_tokens_per_s=capacity)
    else:
        trace = generate_trace(shape, seed=args.seed, requests=args.requests)
    if args.out == "-":
        write_mooncake(trace.requests, sys.stdout)
        where = "stdout"
    else:
        out = Path(args.out)
        if out.is_dir():
            raise ConfigError(f"--out {out} is a directory; give a file name")
        write_mooncake(trace.requests, out)
        where = str(out)
    s = trace_summary(trace.requests)
    print(f"trace {args.shape} seed {args.seed}: {len(trace.requests)} requests over {s['span_s']:.0f} s "
          f"({s['req_per_s']:.2f}/s), {trace.num_sessions} sessions, input mean {s['input_mean']:.0f} "
          f"p50 {s['input_p50']:.0f} p99 {s['input_p99']:.0f} tokens, output mean {s['output_mean']:.0f}, "
          f"ideal hit {s['ideal_hit_ratio']:.1%} of tokens, {s['ideal_block_hit_ratio']:.1%} of blocks, "
          f"ideal load {ideal_load(trace.requests, capacity):.3f} of {capacity:g} tokens/s "
          f"({s['ideal_prefill_tokens_per_s']:.0f} tokens/s to prefill) at {shape.RATE} "
          f"{getattr(shape, shape.RATE):.4g} -> {where}", file=sys.stderr)
    return 0
