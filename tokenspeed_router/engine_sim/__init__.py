"""An inference engine without a model, for tests, demos and benchmarks (DESIGN §11).

``tokenspeed-router engine-sim`` serves vLLM's OpenAI API (:mod:`.api`), with
the project's real :class:`~tokenspeed_router.cache.PrefixCache` deciding
prefix hits and evictions and publishing real KV events (:mod:`.publishing`),
the scheduler ``simulate`` runs too (:mod:`tokenspeed_router.engine_model`,
driven in real time by :mod:`.engine`) timed by the shared model
(:mod:`tokenspeed_router.timing`, profiles ``fifo`` and ``chunked``), a deterministic word tokenizer (:mod:`.tokenizer`) and fault
knobs that exercise a router's truth loop. Needs torch (the cache does).
"""

from tokenspeed_router.engine_sim.engine import Engine, EngineConfig, EngineStatistics, SimRequest
from tokenspeed_router.engine_sim.publishing import EventOutlet, OutletConfig
from tokenspeed_router.engine_sim.tokenizer import NUMBER_LIMIT, SimTokenizer
from tokenspeed_router.timing import TimingModel

__all__ = [
    "NUMBER_LIMIT",
    "Engine",
    "EngineConfig",
    "EngineStatistics",
    "EventOutlet",
    "OutletConfig",
    "SimRequest",
    "SimTokenizer",
    "TimingModel",
]
