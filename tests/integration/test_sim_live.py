"""Live mode (real publishers + a real ``serve`` subprocess) agrees with fast mode."""

from __future__ import annotations

import threading

import pytest

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.router.config import RouterConfig
from tokenspeed_router.sim.cluster import Simulator
from tokenspeed_router.sim.demo import RECOMMENDED_ROUTER_OPTIONS, demo_cluster, demo_requests
from tokenspeed_router.sim.live import (
    HttpRouterBackend,
    LiveCluster,
    RealTimePacer,
    wall_clock_router_options,
)
from tokenspeed_router.sim.report import policy_metrics
from tokenspeed_router.sim.runner import run_policy


def test_real_time_pacer_waits_on_the_injected_clock() -> None:
    now = [100.0]
    waits: list[float] = []

    def wait(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds

    pacer = RealTimePacer(4.0, clock=lambda: now[0], wait=wait)
    pacer.wait_until(0.0)
    pacer.wait_until(2.0)  # 2 simulated s = 0.5 wall s
    now[0] += 1.0
    pacer.wait_until(4.0)  # already late by 0.5 wall s: no wait
    assert waits == [0.5]
    assert pacer.max_lateness_s == pytest.approx(0.5)


@pytest.mark.slow
def test_wall_clock_options_give_the_live_router_the_fast_one_s_beliefs() -> None:
    opts = wall_clock_router_options({"prefill_tokens_per_s": 20_000.0}, 8.0)
    assert opts["prefill_tokens_per_s"] == 160_000.0  # the engines' speed per wall second
    assert opts["prefill_overhead_s"] == RouterConfig().prefill_overhead_s / 8
    assert opts["predict_on_route_ttl_s"] == RouterConfig().predict_on_route_ttl_s / 8
    with pytest.raises(ConfigError):
        wall_clock_router_options({}, 0.0)


def test_live_and_fast_agree_on_hit_ratio() -> None:
    requests = demo_requests(rate_scale=8.0, max_requests=60)
    cluster = demo_cluster(3)
    with LiveCluster(cluster.worker_names(), router_options=RECOMMENDED_ROUTER_OPTIONS, time_scale=8.0) as live:
        sim = Simulator(cluster, pacer=RealTimePacer(8.0, wait=threading.Event().wait))
        live_run = sim.run(requests, HttpRouterBackend(live))
    fast_run = run_policy("kv_aware", requests, demo_cluster(3, event_delay_s=0.005),
                          router_options=RECOMMENDED_ROUTER_OPTIONS, signal_prefill_done=False)
    live_m, fast_m = policy_metrics(live_run), policy_metrics(fast_run)
    # Same slice, same caches, same router config (its time knobs in wall time for the live
    # one, which runs 8x faster than simulated time): only the event path differs (real ZMQ +
    # HTTP timing vs a 5 ms in-process delay).
    assert live_m["hit_ratio"] > 0.2, live_m
    assert live_m["hit_ratio"] == pytest.approx(fast_m["hit_ratio"], abs=0.05), (live_m, fast_m)
