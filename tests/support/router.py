"""Stubs shared by the router tests (import as ``from support.router import ...``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenspeed_router.router.router import Router, RouterConfig

PROMPT = list(range(2000))


@dataclass
class StubDetail:
    scores: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    block_size: dict[str, int] = field(default_factory=dict)


class StubIndex:
    """Answers every query with the same preset match."""

    def __init__(self) -> None:
        self.detail = StubDetail()
        self.queries = 0

    def hold(self, worker: str, blocks: int, block_size: int = 16, **tiers: int) -> None:
        self.detail.scores[worker] = blocks
        self.detail.block_size[worker] = block_size
        self.detail.tiers[worker] = tiers or {"gpu": blocks}

    def match_detail(self, token_ids: Any, lora_id: Any = None, salt: Any = None) -> StubDetail:
        self.queries += 1
        return self.detail


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_router(
    index: Any = None,
    *,
    workers: tuple[str, ...] = ("w0", "w1", "w2", "w3"),
    clock: Any = None,
    **options: Any,
) -> Router:
    """A Router over ``index`` with ``workers`` (role both) and a fake clock.

    Predict-on-route is off unless asked for: a stub index is the whole truth
    in these tests (its own tests and the trace tests run the defaults).
    """
    options.setdefault("request_id_prefix", "t")
    options.setdefault("predict_on_route_ttl_s", 0.0)
    router = Router(index, RouterConfig(**options), clock=clock or FakeClock())
    for w in workers:
        router.add_worker(w)
    return router
