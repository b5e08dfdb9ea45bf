"""The HTTP loop's lag monitor (server/loop_lag.py) sees a loop that is held."""

from __future__ import annotations

import asyncio
import time

from tokenspeed_router.server.loop_lag import LoopLag, LoopLagCollector


def test_a_held_loop_shows_as_one_long_lag_sample() -> None:
    lag = LoopLag(interval_s=0.005)

    async def main() -> None:
        lag.start()
        while lag.samples < 3:  # a few on-time samples first
            await asyncio.sleep(0.005)
        time.sleep(0.08)  # the stall being measured: the loop is held, no timer can run
        seen = lag.samples
        while lag.samples <= seen:
            await asyncio.sleep(0.005)
        lag.stop()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert lag.longest_s >= 0.07
    assert sum(lag.histogram.counts) == lag.samples
    families = {f.name: f for f in LoopLagCollector(lag).collect()}
    samples = {(s.name, s.labels.get("le")): s.value for s in families["tokenspeed_http_loop_lag_seconds"].samples}
    assert samples[("tokenspeed_http_loop_lag_seconds_bucket", "+Inf")] == lag.samples
    assert samples[("tokenspeed_http_loop_lag_seconds_bucket", "0.05")] < lag.samples  # the stall is above 50 ms
    assert families["tokenspeed_http_loop_longest_lag_seconds"].samples[0].value == lag.longest_s
