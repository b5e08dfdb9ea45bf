"""A family of seeded workload shapes, written as Mooncake traces (DESIGN §11 ``trace``).

Each shape is a frozen dataclass of documented parameters (units in every
field's doc) whose defaults come from a published characterization, named in
its ``SOURCES``; where a default is a choice, the doc says so. One engine
(``_core.py``) builds them all: prompts that grow by minting block ids,
sessions that interleave on one clock, one ``random.Random(seed)``.

:func:`generate_trace` gives exactly ``requests`` requests, arrivals rounded
to the millisecond and re-based to 0, so that the trace read back from the
file :func:`~tokenspeed_router.sim.traces.write_mooncake` wrote equals the
one generated. ``docs/workloads.md`` has the table of shapes, parameters and
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
from tokenspeed_router.sim.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

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
