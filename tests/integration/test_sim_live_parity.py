"""Sim-to-live parity: one small slice through ``simulate`` and through engine-sims + the gateway.

Both sides run the shared engine model (``tokenspeed_router/engine_model.py``)
with the FIFO timing profile; the live side is three ``engine-sim`` processes
behind a ``serve`` gateway, replayed by loadgen at four times real speed. The
workload is reuse-heavy (shared system prompts, growing sessions) under
memory pressure, so a live path that accounted load, prefill completion or
predictions differently from the router in process would route differently
and show here. Tolerances: ``loadgen.parity.Tolerances`` (docs/compare-routers.md),
around the range of simulated runs under the live path's timing noise
(``simulate_spread``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenspeed_router.loadgen.parity import (
    ParitySetup,
    Tolerances,
    compare,
    format_comparison,
    live_side,
    prepare,
    simulate_side,
    simulate_spread,
)
from tokenspeed_router.sim.shapes import WorkloadConfig, generate_workload

pytestmark = pytest.mark.serial  # its live side's figures are wall-clock: another test beside it moves them


def test_simulate_predicts_the_gateway(tmp_path: Path) -> None:
    workload = generate_workload(WorkloadConfig(
        num_requests=80, seed=3, session_rate_per_s=1.0, block_tokens=32, system_prompt_tokens=1500,
        question_tokens=150, answer_tokens=120, agent_tool_tokens=600, chat_think_s=3.0, agent_step_s=0.5))
    setup = ParitySetup(num_workers=3, capacity_tokens=6000, timing="fifo", time_scale=4.0,
                        prefill_tokens_per_s=5000.0)
    requests = prepare(workload, setup)
    sim = simulate_side(requests, setup)
    live = live_side(requests, setup, tmp_path)
    # 80 requests: their p99 is the slowest one; the tail compared is p90
    result = compare(sim, live, setup.worker_names(), Tolerances(tail_quantile=90),
                     spread=simulate_spread(requests, setup))
    assert result["ok"], format_comparison(result)
    # the slice exercises what parity is about: reuse under memory pressure, every worker used
    assert 0.3 < sim.hit_ratio() < 0.9
    assert min(sim.per_worker(setup.worker_names()).values()) > 10
