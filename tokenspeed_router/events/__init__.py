"""Wire layer: KV event schema and codec, ZeroMQ publisher/subscriber, event log.

Never imports torch: the router side must deploy without GPU stacks.
"""

from tokenspeed_router.events.codec import BatchDecoder, decode_batch, encode_batch
from tokenspeed_router.events.frames import END_SEQ, offset_endpoint_port
from tokenspeed_router.events.kvcap import KvcapRecord, read_kvcap
from tokenspeed_router.events.log import (
    EventLogReader,
    EventLogWriter,
    LogRecord,
    open_event_source,
)
from tokenspeed_router.events.publisher import (
    PublisherStatistics,
    QueueFullPolicy,
    ZmqEventPublisher,
)
from tokenspeed_router.events.schema import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)
from tokenspeed_router.events.sequencing import SequenceTracker, VerdictKind
from tokenspeed_router.events.subscriber import (
    BatchReceived,
    EventSubscriber,
    PublisherRestarted,
    ResyncNeeded,
    SubscriberItem,
    SubscriberStatistics,
)
from tokenspeed_router.events.subscriber_group import SubscriberGroup

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BatchDecoder",
    "BatchReceived",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventLogReader",
    "EventLogWriter",
    "EventSubscriber",
    "KVEventBatch",
    "KvcapRecord",
    "LogRecord",
    "PublisherRestarted",
    "PublisherStatistics",
    "QueueFullPolicy",
    "ResyncNeeded",
    "SequenceTracker",
    "SubscriberGroup",
    "SubscriberItem",
    "SubscriberStatistics",
    "VerdictKind",
    "ZmqEventPublisher",
    "decode_batch",
    "encode_batch",
    "offset_endpoint_port",
    "open_event_source",
    "read_kvcap",
]
