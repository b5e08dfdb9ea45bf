"""tokenspeed-router: an event-streaming KV-cache router for disaggregated LLM serving.

Subpackages: ``events`` (wire format, ZeroMQ transport, event log),
``cache`` (worker-side paged prefix cache, needs torch), ``router`` (global KV
index and routing policies), ``server`` (the router process), ``state``
(Redis-backed replicas), ``sim`` (simulated cluster). Import what you need from
them; this module stays light so that ``import tokenspeed_router`` costs nothing.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
