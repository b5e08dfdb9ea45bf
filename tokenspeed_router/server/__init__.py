"""The router process (DESIGN §6-7): ingestion, HTTP and ZeroMQ query API, metrics, config.

``RouterService`` owns the index and its single ingestion thread; ``create_app``
/ ``HttpServer`` and ``ZmqApiServer`` serve it; ``ZmqRouterClient`` and
``HttpRouterClient`` are the Python clients. The ``IngestSink`` protocol is
the seam between the subscribers and the index (see ``server/app.py``).
Never imports torch.
"""

from tokenspeed_router.server.app import (
    IngestSink,
    LocalIngestSink,
    NullIngestSink,
    RecordingSink,
    RouterService,
    SinkFactory,
)
from tokenspeed_router.server.client import HttpRouterClient, ZmqRouterClient
from tokenspeed_router.server.config import (
    ApiLimits,
    HostPort,
    ServerConfig,
    SubscriberSpec,
    WorkerSpec,
    load_server_config,
)
from tokenspeed_router.server.http import HttpServer, create_app
from tokenspeed_router.server.zmq_api import ZmqApiServer

__all__ = [
    "ApiLimits",
    "HostPort",
    "HttpRouterClient",
    "HttpServer",
    "IngestSink",
    "LocalIngestSink",
    "NullIngestSink",
    "RecordingSink",
    "RouterService",
    "ServerConfig",
    "SinkFactory",
    "SubscriberSpec",
    "WorkerSpec",
    "ZmqApiServer",
    "ZmqRouterClient",
    "create_app",
    "load_server_config",
]
