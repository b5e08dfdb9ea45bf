"""Live mode: real publishers, a real ``tokenspeed-router serve``, real time.

The same :class:`~tokenspeed_router.sim.cluster.Simulator` loop drives the
workers, but

* each worker's events go out through its own :class:`ZmqEventPublisher`
  (PUB + replay ROUTER on OS-chosen loopback ports) when the engine would
  publish them;
* routing decisions come from a ``tokenspeed-router serve`` subprocess over
  HTTP (``POST /route``, ``POST /release``), which subscribes to those
  publishers like it would to real engines;
* a :class:`RealTimePacer` maps virtual time to wall time with a compression
  factor, so event delivery, index updates and routing race as they do in
  production (no artificial event delay is added: the transport's own).

TTFT stays *simulated* (the cost model), so fast and live runs of the same
slice are comparable; what live mode adds is the real event path.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.errors import ConfigError, TokenspeedError
from tokenspeed_router.events.schema import Event
from tokenspeed_router.sim.cluster import RouteChoice
from tokenspeed_router.sim.traces import TraceRequest

__all__ = ["HttpRouterBackend", "LiveCluster", "RealTimePacer", "wall_clock_router_options"]

logger = logging.getLogger(__name__)


class RealTimePacer:
    """Waits until wall time reaches ``start + sim_time / time_scale``.

    ``clock`` and ``wait`` are injected (defaults: ``time.monotonic`` and an
    Event's ``wait``), so a test can drive it without sleeping. Lateness is
    not caught up by skipping: a late action runs at once.
    """

    def __init__(self, time_scale: float, *, clock: Callable[[], float] = time.monotonic,
                 wait: Callable[[float], object] | None = None) -> None:
        if time_scale <= 0:
            raise ConfigError(f"time_scale must be > 0, got {time_scale}")
        self._scale = time_scale
        self._clock = clock
        self._wait = wait if wait is not None else threading.Event().wait
        self._start: float | None = None
        self.max_lateness_s = 0.0

    def wait_until(self, sim_time_s: float) -> None:
        now = self._clock()
        if self._start is None:
            self._start = now - sim_time_s / self._scale
        target = self._start + sim_time_s / self._scale
        if target > now:
            self._wait(target - now)
        else:
            self.max_lateness_s = max(self.max_lateness_s, now - target)


def _http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 10.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"{}")


#: RouterConfig fields in seconds (divided by the time scale) and in per-second rates (multiplied)
_SECONDS_KNOBS = ("prefill_overhead_s", "approx_ttl_s", "predict_on_route_ttl_s",
                  "prediction_grace_s")
_RATE_KNOBS = ("prefill_tokens_per_s",)


def wall_clock_router_options(options: dict[str, Any] | None, time_scale: float) -> dict[str, Any]:
    """``options`` for a ``serve`` that lives in wall time while the simulation runs ``time_scale``x.

    The live router's clock is the wall clock: at ``time_scale`` 8 an engine
    that prefills 20k tokens per simulated second does 160k per wall second,
    and the HTTP API has no first-token call that would let the router fit
    it. Every time-valued knob of the cost model (the prefill prior, the
    prediction and approximate-store lifetimes) is therefore given in wall
    time (the in-flight timeout, a safety net, stays as it is), each at the value
    the in-process router has in simulated time (its default unless
    ``options`` sets it), so live and fast mode hold the same beliefs and
    differ only in the event path. Without this the live router believed the
    engines ``time_scale`` times slower than the fast one did (issue 31: the
    live hit ratio fell 5-7 points below fast mode's at ``prefill_weight``
    1, where queue estimates decide between waiting and recomputing).
    """
    from tokenspeed_router.router.config import RouterConfig

    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ConfigError(f"time_scale must be a finite number > 0, got {time_scale}")
    out = dict(options or {})
    defaults = RouterConfig()
    for key in _SECONDS_KNOBS:
        out[key] = float(out.get(key, getattr(defaults, key))) / time_scale
    for key in _RATE_KNOBS:
        out[key] = float(out.get(key, getattr(defaults, key))) * time_scale
    return out


class LiveCluster:
    """Publishers for ``worker_names`` and a ``serve`` subprocess subscribed to them.

    Use as a context manager; :meth:`close` stops the server (terminate, then
    kill after a grace period) and closes the publishers. ``time_scale``: the
    simulation runs that many times faster than the wall clock, and the
    router's time knobs are given in wall time (:func:`wall_clock_router_options`). The server's log goes
    to a file in ``log_dir`` (a temporary directory by default).
    """

    def __init__(
        self,
        worker_names: Sequence[str],
        *,
        roles: dict[str, str] | None = None,
        router_options: dict[str, Any] | None = None,
        time_scale: float = 1.0,
        startup_timeout_s: float = 30.0,
        log_dir: Path | None = None,
        python: str = sys.executable,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import zmq

        from tokenspeed_router.events.publisher import ZmqEventPublisher

        self._clock = clock
        self._ctx = zmq.Context()
        self.publishers: dict[str, ZmqEventPublisher] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp = None if log_dir is not None else tempfile.TemporaryDirectory(prefix="tsr-live-")
        self.log_path = (log_dir or Path(self._tmp.name if self._tmp else ".")) / "serve.log"
        try:
            for name in worker_names:
                self.publishers[name] = ZmqEventPublisher(
                    "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", context=self._ctx
                )
            self.http_port = free_tcp_port()
            self.base_url = f"http://127.0.0.1:{self.http_port}"
            cmd = [python, "-m", "tokenspeed_router.cli", "--log-level", "WARNING", "serve",
                   "--http", f"127.0.0.1:{self.http_port}"]
            if time_scale != 1.0:  # the router's time knobs in wall time (wall_clock_router_options)
                router_options = wall_clock_router_options(router_options, time_scale)
            for key, value in (router_options or {}).items():
                cmd += ["--router-option", f"{key}={json.dumps(value)}"]
            for name, pub in self.publishers.items():
                role = (roles or {}).get(name, "both")
                cmd += ["--worker", f"name={name},events={pub.endpoint},"
                        f"replay={pub.replay_endpoint},role={role}"]
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("wb")
            env = dict(os.environ)
            env.pop("TOKENSPEED_ROUTER_HTTP", None)
            self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        """Healthy server, and every publisher seen (slow-joiner handshake)."""
        deadline = self._clock() + timeout_s
        pause = threading.Event()
        seen: set[str] = set()
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise TokenspeedError(
                    f"router exited with code {self._proc.returncode}; log: {self.log_path}\n"
                    + self.log_path.read_text(errors="replace")[-2000:])
            try:
                workers = _http(self.base_url + "/workers", timeout_s=2.0)
                for name, info in _worker_rows(workers).items():
                    if name in self.publishers and info.get("last_seq") is not None:
                        seen.add(name)
                if seen >= set(self.publishers):
                    return
                # Probe: an empty batch; the subscriber reports the seq once it is connected.
                for name, pub in self.publishers.items():
                    if name not in seen and pub.statistics().published < 200:
                        pub.publish_events([], ts=0.0)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if self._clock() > deadline:
                raise TokenspeedError(f"router not ready within {timeout_s}s (seen {sorted(seen)}); "
                                      f"log: {self.log_path}")
            pause.wait(0.05)

    def url(self, path: str) -> str:
        return self.base_url + path

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for pub in self.publishers.values():
            pub.close(timeout_s=2.0)
        self.publishers.clear()
        self._ctx.term()
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LiveCluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _worker_rows(doc: Any) -> dict[str, dict[str, Any]]:
    """``GET /workers`` as {name: row}, accepting a dict or a list of rows."""
    if isinstance(doc, dict) and "workers" in doc:
        doc = doc["workers"]
    if isinstance(doc, dict):
        return {str(k): (v if isinstance(v, dict) else {}) for k, v in doc.items()}
    if isinstance(doc, list):
        return {str(r.get("name")): r for r in doc if isinstance(r, dict)}
    return {}


class HttpRouterBackend:
    """Routes through the live server; publishes events through the publishers."""

    needs_events = True

    def __init__(self, cluster: LiveCluster, *, name: str = "kv_aware") -> None:
        self.name = name
        self._cluster = cluster
        self.route_latency_s: list[float] = []

    def route(self, request: TraceRequest, tokens: np.ndarray) -> RouteChoice:
        started = time.perf_counter()
        answer = _http(self._cluster.url("/route"),
                       {"token_ids": tokens.tolist(), "request_id": request.request_id})
        self.route_latency_s.append(time.perf_counter() - started)
        return RouteChoice(worker=answer["worker"], decode_worker=answer.get("decode_worker"),
                           predicted_hit_tokens=int(answer.get("matched_tokens", 0)))

    def deliver(self, worker: str, seq: int, events: list[Event], now: float) -> None:
        self._cluster.publishers[worker].publish_events(events, ts=now)

    def prefill_done(self, request_id: str, now: float) -> None:
        return None  # the HTTP API has no "first token" call; load counts until release

    def finished(self, request_id: str, now: float) -> None:
        _http(self._cluster.url("/release"), {"request_id": request_id})
