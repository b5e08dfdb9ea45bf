"""The endpoint picker's gRPC server: ext_proc, health checking, readiness.

It runs on the event loop of the router's HTTP server (gRPC's asyncio server
works on uvloop), beside the OpenAI gateway whose parts it shares: the
upstreams (down marking, the ``/tokenize`` client), the tokenizer, the truth
loop and the tracer; so both front ends keep one set of books and one truth
loop. With ``--http none`` it gets a loop of its own (:func:`run_alone`).

gRPC health checking (``grpc.health.v1.Health``), as the protocol asks:

* ``liveness``: SERVING while the process answers;
* ``readiness``, the ext_proc service name, ``inference-extension`` (what the
  upstream Helm chart probes with one replica) and ``""``: SERVING when the
  picker can pick (:func:`readiness`); NOT_SERVING with the reason logged
  on each change. Unknown services are NOT_FOUND, as the protocol of gRPC
  health checking says.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenspeed_router.endpoints import HostPort, bind_socket, is_loopback_host
from tokenspeed_router.epp import messages
from tokenspeed_router.epp.exchange import Exchange
from tokenspeed_router.epp.names import EPP_EXTRA_HINT, HEALTH_SERVICES
from tokenspeed_router.epp.picker import EndpointPicker, PickerHost, PickerSettings
from tokenspeed_router.errors import ConfigError

__all__ = ["EppConfig", "EppServer", "readiness", "run_alone"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EppConfig:
    """``serve --epp HOST:PORT`` and its options (``server/config.py`` carries them)."""

    address: HostPort
    picker: PickerSettings
    #: readiness NOT_SERVING on every replica but the state backend's leader
    leader_only: bool = False


def readiness(service: Any, gateway: Any, *, leader_only: bool) -> tuple[bool, str]:
    """Whether the picker can pick now, and why not.

    Ready when the router serves (``/health`` ok or degraded), some worker has
    a url, no engine of them all is down, and every configured worker's event
    stream has synced: connected and live (not resyncing, not stale) on a
    replica that subscribes itself; on a follower of ``--state ...?ingest=stream``,
    the shared stream's replica is live. With ``leader_only`` only the replica
    holding the state backend's lease is ready.
    """
    health = gateway.annotate_health(service.health())
    state = health.get("state")
    if leader_only and (not isinstance(state, dict) or state.get("role") != "leader"):
        return False, "leader-only picking: this replica does not hold the state backend's lease"
    if health.get("status") not in ("ok", "degraded"):
        problems = "; ".join(health.get("problems") or []) or health.get("status", "?")
        return False, f"the router is not serving ({problems})"
    if not any(s.url for s in service.worker_specs().values()):
        return False, "no worker has a url= to pick"
    if health.get("subscribed"):
        for name, entry in service.workers().items():
            if not entry.get("connected"):
                return False, f"worker {name}'s event stream is not connected yet"
            if entry.get("state") != "live":
                return False, f"worker {name}'s event stream is {entry.get('state')}"
    return True, "ready"


class EppServer:
    """ext_proc + health on ``config.address`` (module docstring); start and stop on the serving loop."""

    def __init__(self, service: PickerHost, gateway: Any, config: EppConfig) -> None:
        messages.load()
        try:
            import grpc  # noqa: F401  (the extra's runtime; imported where it is used below)
            from grpc_health.v1 import health_pb2  # noqa: F401
        except ImportError as err:
            raise ConfigError(f"{EPP_EXTRA_HINT} ({err})") from None
        self._service = service
        #: the HTTP gateway whose parts the picker shares (``gateway/app.py``)
        self.gateway = gateway
        self.config = config
        self.picker = EndpointPicker(service, gateway.upstreams, gateway.tokenizer, gateway.truth,
                                     gateway.proxy.stats, config.picker, gateway.tracer)
        service.metrics.add_collector(_EppCollector(self.picker))
        # the port is checked now, so that "address in use" fails the start like --http does
        probe = bind_socket(config.address)
        self.address = HostPort(config.address.host, probe.getsockname()[1])
        probe.close()
        if not is_loopback_host(config.address.host):
            logger.info("endpoint picker listening on non-loopback %s (plaintext gRPC)", self.address)
        self._server: Any = None
        self._refresh: asyncio.Future[None] | None = None
        self._ready: tuple[bool, str] | None = None
        self.started = threading.Event()

    def ready(self) -> tuple[bool, str]:
        """:func:`readiness` now (its changes are logged)."""
        now = readiness(self._service, self.gateway, leader_only=self.config.leader_only)
        if now != self._ready:
            logger.info("endpoint picker readiness: %s (%s)", "SERVING" if now[0] else "NOT_SERVING", now[1])
            self._ready = now
        return now

    async def start(self) -> None:
        """Serve on the running loop."""
        import grpc
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
        from grpc_health.v1 import health_pb2_grpc

        # no SO_REUSEPORT: a second picker on the same port must fail, not share it
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(_ExtProc(self.picker), server)
        health_pb2_grpc.add_HealthServicer_to_server(_Health(self.ready), server)
        try:
            port = server.add_insecure_port(str(self.address))
        except RuntimeError as err:
            raise ConfigError(f"cannot listen on {self.address} (--epp): {err}") from err
        if port == 0:
            raise ConfigError(f"cannot listen on {self.address} (--epp)")
        self.address = HostPort(self.address.host, port)
        await server.start()
        self._server = server
        self._refresh = asyncio.ensure_future(self.picker.refresh_endpoints())
        logger.info("endpoint picker (ext_proc) on %s", self.address)
        self.ready()
        self.started.set()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking streams; those open get ``grace_s`` to end (each releases what it holds)."""
        if self._refresh is not None:
            self._refresh.cancel()
            self._refresh = None
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None


class _ExtProc:
    """``envoy.service.ext_proc.v3.ExternalProcessor``: one :class:`Exchange` per stream."""

    def __init__(self, picker: EndpointPicker) -> None:
        self._picker = picker

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        exchange = Exchange(self._picker)
        self._picker.stats.streams += 1
        try:
            async for msg in requests:
                for answer in await exchange.step(msg):
                    yield answer
                if exchange.finished:
                    return
        finally:
            exchange.close()  # a dropped or cancelled stream releases its load here


class _Health:
    """``grpc.health.v1.Health`` over the picker's services (module docstring)."""

    def __init__(self, ready: Callable[[], tuple[bool, str]]) -> None:
        from grpc_health.v1 import health_pb2

        self._pb = health_pb2
        self._ready = ready

    def _status(self, service: str) -> int | None:
        pb = self._pb.HealthCheckResponse
        if service not in HEALTH_SERVICES:
            return None
        if service == "liveness":
            return pb.SERVING
        return pb.SERVING if self._ready()[0] else pb.NOT_SERVING

    async def Check(self, request: Any, context: Any) -> Any:
        import grpc

        status = self._status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r} "
                                f"(known: {', '.join(repr(s) for s in HEALTH_SERVICES)})")
        return self._pb.HealthCheckResponse(status=status)

    async def List(self, request: Any, context: Any) -> Any:
        """Every service's status (gRPC health's ``List``)."""
        statuses = {name: self._pb.HealthCheckResponse(status=self._status(name)) for name in HEALTH_SERVICES}
        return self._pb.HealthListResponse(statuses=statuses)

    async def Watch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        last = None
        while True:
            status = self._status(request.service)
            if status is None:
                status = self._pb.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                last = status
                yield self._pb.HealthCheckResponse(status=status)
            await asyncio.sleep(1.0)


class _EppCollector(Collector):
    """``tokenspeed_epp_*``: requests by outcome, streams, requests in flight through the picker."""

    def __init__(self, picker: EndpointPicker) -> None:
        self._picker = picker

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        stats = self._picker.stats
        requests = CounterMetricFamily("tokenspeed_epp_requests", "endpoint picker requests by outcome "
                                       "(routed, completed, aborted, refused, shed, http_4xx/5xx, "
                                       "fallback_served, ...)", labels=["outcome"])
        for outcome, n in sorted(stats.outcomes.items()):
            requests.add_metric([outcome], float(n))
        yield requests
        yield CounterMetricFamily("tokenspeed_epp_streams", "ext_proc streams opened by Envoy",
                                  value=float(stats.streams))
        yield GaugeMetricFamily("tokenspeed_epp_in_flight", "requests picked and not yet released",
                                value=float(self._picker.in_flight))


def run_alone(server: EppServer, stop: threading.Event, new_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
    """``--epp`` without ``--http``: serve the picker on a loop of its own until ``stop`` is set."""

    async def main() -> None:
        await server.start()
        try:
            while not stop.is_set():
                await asyncio.sleep(0.2)
        finally:
            await server.stop()
            await server.gateway.aclose()

    loop = new_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
