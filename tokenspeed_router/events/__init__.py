"""Wire layer: KV event schema and codec, ZeroMQ publisher/subscriber, event log.

Never imports torch: the router side must deploy without GPU stacks.
"""

from tokenspeed_router.events.codec import BatchDecoder, decode_batch, encode_batch
from tokenspeed_router.events.schema import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)

__all__ = [
    "AllBlocksCleared",
    "BatchDecoder",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
]
