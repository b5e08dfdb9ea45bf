"""Event relay sidecar (DESIGN §12): follows one engine, republishes, serves snapshots.

Router side only: never imports torch.
"""

from tokenspeed_router.relay.blockset import BlockSet
from tokenspeed_router.relay.hashes_only import ContentHasher
from tokenspeed_router.relay.relay import EventRelay, RelayConfig, RelayStatistics
from tokenspeed_router.relay.ring import SnapshotRing

__all__ = ["BlockSet", "ContentHasher", "EventRelay", "RelayConfig", "RelayStatistics", "SnapshotRing"]
