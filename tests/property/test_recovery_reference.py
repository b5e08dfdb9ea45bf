"""Recovery after lost events, against a reference engine, over random fleets and losses.

Engines are ``support.lru_engine.LruEngine`` caches (prefix-closed, LRU by
leaves, opaque ids); the router is a real RoutingCore. Each example warms
the fleet, loses a random window of one or more engines' batches (a shed, an
unhealable gap), then routes a steady load. Properties:

* after every batch, the index never claims a block an engine does not hold
  (so never one whose BlockRemoved arrived), whatever was lost, named,
  inferred or held back;
* the steady load brings every worker back to ``live``, and the index then
  equals every engine's cache (blocks and leading matches of every prompt).
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.lru_engine import Fleet, LruEngine

from tokenspeed_router.router import RouterConfig
from tokenspeed_router.router.core import RoutingCore
from tokenspeed_router.router.ingest import WorkerState

BS = 4


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    engines=st.integers(1, 3),
    capacity=st.integers(16, 48),
    systems=st.integers(1, 4),
    lost=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 12)), min_size=1, max_size=3),
)
def test_loss_then_steady_load(seed: int, engines: int, capacity: int, systems: int,
                               lost: list[tuple[int, int]]) -> None:
    rng = random.Random(seed)
    heads = [[rng.randrange(1000) for _ in range(rng.randint(1, 4) * BS)] for _ in range(systems)]
    prompts = [rng.choice(heads) + [rng.randrange(1000, 10**6) for _ in range(rng.randint(1, 3) * BS)]
               for _ in range(40)]
    names = [f"w{i}" for i in range(engines)]
    core = RoutingCore(RouterConfig(approx_block_size=BS), recovery_batches=3)
    fleet = Fleet(core, {n: LruEngine(block_size=BS, capacity_blocks=capacity) for n in names})
    for prompt in prompts:
        fleet.request(prompt)
    for which, n in lost:  # a window of one engine's batches never reaches the router
        name = names[which % engines]
        for _ in range(n):
            fleet.request(rng.choice(prompts), to=name, lose=True)
    def step(i: int) -> None:
        prompt = rng.choice(heads) + [rng.randrange(1000, 10**6) for _ in range(rng.randint(1, 3) * BS)]
        prompts[i % len(prompts)] = prompt
        fleet.request(prompt)
        fleet.check_sound(prompts)
        if i % 5 == 0:  # traffic from elsewhere (not routed here) reaches every engine
            for name in names:
                fresh = [rng.randrange(10**6, 10**7) for _ in range(rng.randint(1, 2) * BS)]
                fleet.publish(name, fleet.engines[name].admit(fresh))
                fleet.check_sound(prompts)

    for i in range(300):
        step(i)
    # Every worker comes back live (a later eviction of a block it had inferred may send it
    # back for a while: the index then lacks blocks the engine may hold), and live, it is exact.
    for i in range(300, 1500):
        if all(core.ingestor.state(n) is WorkerState.LIVE for n in names):
            break
        step(i)
    states = {n: core.ingestor.state(n) for n in names}
    assert all(s is WorkerState.LIVE for s in states.values()), states
    assert fleet.exact(prompts)
