"""The ``mixed`` workload generator, kept at its old import path.

It lives in :mod:`tokenspeed_router.sim.shapes.mixed` now, as one shape of the
workload family (``tokenspeed-router trace``); this module only re-exports it
so that ``from tokenspeed_router.sim.workload import ...`` keeps working.
"""

from tokenspeed_router.sim.shapes.mixed import WorkloadConfig, generate_workload

__all__ = ["WorkloadConfig", "generate_workload"]
