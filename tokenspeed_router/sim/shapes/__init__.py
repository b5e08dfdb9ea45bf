"""A family of seeded workload shapes, written as Mooncake traces (DESIGN §11 ``trace``).

Each shape is a frozen dataclass of documented parameters (units in every
field's doc) whose defaults come from a published characterization, named in
its ``SOURCES``; where a default is a choice, the doc says so. One engine
(``_core.py``) builds them all: prompts that grow by minting block ids,
sessions that interleave on one clock, one ``random.Random(seed)``.

:func:`generate_trace` gives exactly ``requests`` requests, arrivals rounded
to the millisecond and re-based to 0, so that the trace read back from the
file :func:`~tokenspeed_router.sim.traces.write_mooncake` wrote equals the
one generated. :func:`generate_at_load` finds the arrival rate at which a
shape's trace puts a given prefill load on a cluster (``trace --load``).
``docs/workloads.md`` has the table of shapes, parameters and
sources.
"""

from __future__ import annotations

import dataclasses
import math
import random
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.sim.shapes._core import Shape, Turn, to_requests
from tokenspeed_router.sim.shapes.agentic import AgenticShape
from tokenspeed_router.sim.shapes.chat import ChatShape
from tokenspeed_router.sim.shapes.cold import ColdShape
from tokenspeed_router.sim.shapes.docqa import DocQAShape
from tokenspeed_router.sim.shapes.mixed import WorkloadConfig, generate_workload
from tokenspeed_router.sim.shapes.multitenant import MultiTenantShape
from tokenspeed_router.sim.shapes.rag import RagShape
from tokenspeed_router.sim.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, ideal_load

__all__ = [
    "SHAPES",
    "AgenticShape",
    "ChatShape",
    "ColdShape",
    "DocQAShape",
    "GeneratedTrace",
    "MultiTenantShape",
    "RagShape",
    "Shape",
    "WorkloadConfig",
    "generate_at_load",
    "generate_trace",
    "generate_workload",
    "make_shape",
    "shape_parameters",
]

#: ``trace --shape`` name -> shape class, in the order ``trace --list`` prints them
SHAPES: dict[str, type[Shape]] = {
    cls.NAME: cls
    for cls in (AgenticShape, ChatShape, RagShape, DocQAShape, MultiTenantShape, ColdShape, WorkloadConfig)
}

#: fields of ``mixed`` that ``trace`` sets itself (--requests, --seed, 512-token ids)
_RESERVED = frozenset({"num_requests", "seed", "block_tokens"})


@dataclass(frozen=True, slots=True)
class GeneratedTrace:
    """A generated trace: its requests and, for each one, the session it belongs to.

    Sessions are numbered 0, 1, ... in order of their first request in the
    trace; a single-turn shape has one session per request. The Mooncake
    format has no session field, so this is known here only.
    """

    requests: list[TraceRequest]
    sessions: list[int]

    @property
    def num_sessions(self) -> int:
        return len(set(self.sessions))


def shape_parameters(shape: type[Shape] | Shape) -> list[dataclasses.Field[Any]]:
    """The parameters ``--param`` may set, with their defaults and docs (``field.metadata["doc"]``)."""
    return [f for f in dataclasses.fields(shape) if f.name not in _RESERVED]


def _parse_value(name: str, kind: Any, text: str) -> Any:
    try:
        if kind is int:
            return int(text)
        if kind is float:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError(text)
            return value
    except ValueError:
        raise ConfigError(f"parameter {name} expects a finite {kind.__name__}, got {text!r}") from None
    return text


def make_shape(name: str, params: Mapping[str, str] | None = None, *, rate_per_s: float | None = None) -> Shape:
    """The shape called ``name`` with ``params`` (``field -> text``) and ``rate_per_s`` applied.

    Unknown names and parameters are a :class:`ConfigError` that lists the
    valid ones; values are converted to the field's type and checked by the
    shape.
    """
    cls = SHAPES.get(name)
    if cls is None:
        raise ConfigError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in shape_parameters(cls)}
    values: dict[str, Any] = {}
    for key, text in (params or {}).items():
        if key not in known:
            raise ConfigError(f"shape {name} has no parameter {key!r}; it has {', '.join(sorted(known))}")
        values[key] = _parse_value(key, hints[key], text)
    if rate_per_s is not None:
        values[cls.RATE] = rate_per_s
    if cls is WorkloadConfig:
        values["block_tokens"] = MOONCAKE_BLOCK_TOKENS
    return cls(**values)


def generate_trace(shape: Shape, *, seed: int, requests: int,
                   block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> GeneratedTrace:
    """Exactly ``requests`` requests of ``shape`` for ``seed``: same inputs, same trace.

    Arrivals are rounded to whole milliseconds (the Mooncake format's unit)
    and re-based so the first request arrives at 0.
    """
    if requests < 1:
        raise ConfigError(f"requests must be >= 1, got {requests}")
    turns: list[Turn] = sorted(shape.turns(random.Random(seed), requests, block_tokens),
                               key=lambda t: t.arrival_s)
    if len(turns) != requests:  # every shape's engine stops at exactly this many
        raise AssertionError(f"shape {shape.NAME} made {len(turns)} requests, not {requests}")
    renumber: dict[int, int] = {}
    sessions = [renumber.setdefault(t.session, len(renumber)) for t in turns]
    return GeneratedTrace(to_requests(turns, block_tokens, prefix=shape.NAME, whole_ms=True), sessions)


#: how close to the asked load :func:`generate_at_load` stops (relative), and how many rates it tries
LOAD_TOLERANCE = 0.02
LOAD_MAX_STEPS = 32


def generate_at_load(shape: Shape, *, seed: int, requests: int, load: float, capacity_tokens_per_s: float,
                     block_tokens: int = MOONCAKE_BLOCK_TOKENS, tolerance: float = LOAD_TOLERANCE,
                     max_steps: int = LOAD_MAX_STEPS) -> tuple[GeneratedTrace, Shape]:
    """:func:`generate_trace` at the arrival rate that puts ``load`` on the cluster; and that shape.

    ``load`` is the trace's prefill demand with ideal reuse as a fraction of
    ``capacity_tokens_per_s`` (:func:`~tokenspeed_router.sim.traces.ideal_load`).
    Only the shape's rate field (``shape.RATE``) changes; seed, requests and
    every other parameter stay. A single-turn shape's load is close to linear
    in its rate, a session shape's is not (more sessions in a window of
    ``requests`` means fewer of their follow-ups in it, so less reuse), so the
    rate is found by secant steps on ``ideal_load(rate) - load``, starting
    from the shape's own rate and a proportional guess, until the load is
    within ``tolerance`` (relative) of ``load``, at most ``max_steps`` traces.
    A :class:`ConfigError` names the closest load reached when it cannot get
    there (e.g. a shape without reuse structure to speak of at that size).
    """
    if not (math.isfinite(load) and load > 0):
        raise ConfigError(f"load must be a finite number > 0, got {load}")
    if not (math.isfinite(capacity_tokens_per_s) and capacity_tokens_per_s > 0):
        raise ConfigError(f"capacity_tokens_per_s must be a finite number > 0, got {capacity_tokens_per_s}")
    if requests < 2:
        raise ConfigError(f"a trace at a load needs at least 2 requests (a span), got {requests}")
    if not 0 < tolerance < 1 or max_steps < 2:
        raise ConfigError(f"tolerance must be in (0, 1) and max_steps >= 2, got {tolerance}, {max_steps}")

    def at(rate: float) -> tuple[GeneratedTrace, Shape, float]:
        here = dataclasses.replace(shape, **{shape.RATE: rate})  # type: ignore[type-var]
        trace = generate_trace(here, seed=seed, requests=requests, block_tokens=block_tokens)
        return trace, here, ideal_load(trace.requests, capacity_tokens_per_s)

    rate = float(getattr(shape, shape.RATE))
    tried: list[tuple[float, float]] = []  # (rate, load reached)
    best: tuple[GeneratedTrace, Shape, float] | None = None
    for _ in range(max_steps):
        trace, here, reached = at(rate)
        tried.append((rate, reached))
        if best is None or abs(reached - load) < abs(best[2] - load):
            best = (trace, here, reached)
        if abs(reached - load) <= tolerance * load:
            return trace, here
        rate = _next_rate(tried, load)
        if not (math.isfinite(rate) and rate > 0):
            break
    assert best is not None
    steps = ", ".join(f"{r:.4g}/s -> {x:.3f}" for r, x in tried)
    raise ConfigError(f"shape {shape.NAME}: no {shape.RATE} puts load {load:g} on {capacity_tokens_per_s:g} "
                      f"tokens/s within {tolerance * 100:.3g} % in {len(tried)} steps (closest {best[2]:.3f}; "
                      f"rate -> load: {steps}); its load jumps with the rate here: try another seed or more requests")


def _next_rate(tried: list[tuple[float, float]], load: float) -> float:
    """The next rate to try, from every (rate, load reached) so far: a secant step in log-log space.

    The first step is proportional (``rate * load / reached``: exact when
    load is linear in rate). Then the line ``log load = a + b log rate``
    through the points tried (least squares, the secant when there are two;
    slope held in [0.25, 4]) gives the rate where it crosses ``load``. A
    session or burst shape's load jitters with its rate by several per cent
    (another rate draws another trace), so a secant through two points can
    bounce around the crossing; the fit averages the jitter out. A rate
    already tried (within 0.1 %) is nudged by 1 % steps, alternating sides,
    so that every step draws a new trace near the crossing.
    """
    rate, reached = tried[-1]
    points = [(math.log(r), math.log(x)) for r, x in tried if x > 0]
    if len(points) < 2 or len({p[0] for p in points}) < 2:
        guess = rate * load / reached if reached > 0 else rate * 10.0
    else:
        # weigh the points near the target most: the line is a local one
        weights = [1.0 / (abs(lx - math.log(load)) + 0.05) ** 2 for _, lx in points]
        total = sum(weights)
        mr = sum(w * lr for w, (lr, _) in zip(weights, points, strict=True)) / total
        mx = sum(w * lx for w, (_, lx) in zip(weights, points, strict=True)) / total
        var = sum(w * (lr - mr) ** 2 for w, (lr, _) in zip(weights, points, strict=True))
        cov = sum(w * (lr - mr) * (lx - mx) for w, (lr, lx) in zip(weights, points, strict=True))
        slope = min(4.0, max(0.25, cov / var)) if var > 0 else 1.0
        guess = math.exp(mr + (math.log(load) - mx) / slope)
    for j in range(1, 2 * len(tried) + 2):
        if all(abs(guess / r - 1.0) > 1e-3 for r, _ in tried):
            break
        guess *= 1.0 + 0.01 * ((j + 1) // 2) * (1 if j % 2 else -1)
    return guess
