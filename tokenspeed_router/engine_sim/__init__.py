"""An inference engine without a model, for tests, demos and benchmarks (DESIGN §11).

``tokenspeed-router engine-sim`` serves vLLM's OpenAI API (:mod:`.api`), with
the project's real :class:`~tokenspeed_router.cache.PrefixCache` deciding
prefix hits and evictions and publishing real KV events (:mod:`.publishing`),
a scheduler loop (:mod:`.engine`) timed by a documented model
(:mod:`.timing`), a deterministic word tokenizer (:mod:`.tokenizer`) and fault
knobs that exercise a router's truth loop. Needs torch (the cache does).
"""

from tokenspeed_router.engine_sim.engine import Engine, EngineConfig, EngineStatistics, SimRequest
from tokenspeed_router.engine_sim.publishing import EventOutlet, OutletConfig
from tokenspeed_router.engine_sim.timing import TimingModel
from tokenspeed_router.engine_sim.tokenizer import NUMBER_LIMIT, SimTokenizer

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
