"""Scale-out through Redis: a fenced, durable event stream, snapshots, leader failover.

One replica holds the ingestion lease and appends every subscriber item to a
Redis stream; every replica (leader included) builds its in-memory index
only from that stream, so all converge and queries never touch Redis.
Periodic snapshots let a new replica come up warm. See
docs/replicas.md for the design, the failure modes and the figures.

Importing this package does not import redis-py: the client is built when a
replica is.
"""

from tokenspeed_router.state.applier import IndexHost, LocalIndexHost
from tokenspeed_router.state.config import RedisStateConfig, StateKeys
from tokenspeed_router.state.health import StateHealth, WarmStartReport
from tokenspeed_router.state.replica import IngestionControl, RedisStateReplica
from tokenspeed_router.state.service import create_ingest_sink
from tokenspeed_router.state.stream import FencedError, GenerationError

__all__ = [
    "FencedError",
    "GenerationError",
    "IndexHost",
    "IngestionControl",
    "LocalIndexHost",
    "RedisStateConfig",
    "RedisStateReplica",
    "StateHealth",
    "StateKeys",
    "WarmStartReport",
    "create_ingest_sink",
]
