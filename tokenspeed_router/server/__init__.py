"""The router process (DESIGN §6-7): ingestion, HTTP and ZeroMQ query API, metrics, config.

``RouterService`` owns the index and its single ingestion thread; ``create_app``
(HTTP) and ``ZmqApiServer`` serve it; ``ZmqRouterClient`` and
``HttpRouterClient`` are the Python clients. Internals (the ingest sinks, the
HTTP server wrapper) are imported from their modules.
Never imports torch.
"""

from tokenspeed_router.server.app import RouterService
from tokenspeed_router.server.client import HttpRouterClient, ZmqRouterClient
from tokenspeed_router.server.config import (
    ApiLimits,
    ServerConfig,
    WorkerSpec,
    load_server_config,
)
from tokenspeed_router.server.http import create_app
from tokenspeed_router.server.zmq_api import ZmqApiServer

__all__ = [
    "ApiLimits",
    "HttpRouterClient",
    "RouterService",
    "ServerConfig",
    "WorkerSpec",
    "ZmqApiServer",
    "ZmqRouterClient",
    "create_app",
    "load_server_config",
]
