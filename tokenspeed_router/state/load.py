"""Shared in-flight load: router replicas see each other's requests through Redis.

Why: each replica counts only the requests *it* routed, so two gateways
splitting traffic both see an idle worker and pile onto it (sglang#14305,
dynamo#7836). With :class:`SharedLoad` each replica's router adds what the
other replicas have in flight on every worker, and makes the decision one
router would.

What goes to Redis: one hash per router cluster, ``tsr:{cluster}:load``,
with one field per (replica, worker): ``replica \\t worker`` ->
``deadline_ms,requests,pending_prefill_tokens,active_tokens``. A replica
publishes its per-worker totals, not one entry per request: a sync costs
O(workers), not O(requests), and the per-request bookkeeping (release, first
token, ``inflight_timeout_s``) stays in the replica's own router, which
already does it exactly. The deadline is Redis's own clock (``TIME``) plus
``load_ttl_s``, so host clocks may disagree. A replica that dies stops
refreshing its fields; the sync script of every live replica deletes fields
past their deadline, so a dead replica's load stops counting after at most
``load_ttl_s``. A clean shutdown deletes its fields at once. One Lua script
per sync writes this replica's fields, drops expired ones and returns the
sum of every other live replica's fields per worker: one round trip, one
key (legal on Redis Cluster: the key carries the cluster's hash tag).

Threads: the routing thread only reads a cached mapping (:meth:`peers`,
swapped whole, so no lock) and sets an event (:meth:`changed`). The
``state-load`` thread syncs when the local load changed (at most every
``load_min_interval_s``, so a burst of routes costs one round trip) and at
least every ``load_refresh_s`` (to see the others' changes while idle).

Staleness bound: a change on replica A is in Redis after at most
``load_min_interval_s`` + one round trip; replica B picks it up on its next
sync, at most ``load_refresh_s`` later (``load_min_interval_s`` while B is
routing itself) + one round trip. Defaults: 5 ms + 50 ms + 2 RTT, about
55 ms on a LAN. Requests routed inside that window by two replicas at once
may still land together; everything older is seen.

Redis down: the sync fails, is counted (``load_sync_errors``) and logged
(rate limited); the last view of the peers is kept until it is
``load_ttl_s`` old (their entries would have expired in Redis by then too),
then the router falls back to its local load alone (``fallback`` in
``/health``) until Redis answers again.

Requests must be released on the replica that routed them (the gateway does
that by construction); a ``/release`` sent to another replica is answered as
an unknown id there and the routing replica expires the request after
``inflight_timeout_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tokenspeed_router.ratelimit import RateLimitedLog
from tokenspeed_router.router.scoring import WorkerLoad
from tokenspeed_router.state._client import Backoff, connect, transient_errors
from tokenspeed_router.state.config import RedisStateConfig

__all__ = ["SharedLoad", "SharedLoadStatistics"]

logger = logging.getLogger(__name__)

#: KEYS[1] the load hash. ARGV: replica id, ttl ms, then worker, packed load pairs.
#: Writes this replica's fields (all of them: a worker whose load went to zero
#: is written as zeros, a forgotten worker's field expires), deletes expired
#: fields of anyone, returns [peers, worker, requests, pending, active, ...]
#: summed over the other live replicas.
_SYNC = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = ARGV[1]
local deadline = now + tonumber(ARGV[2])
for i = 3, #ARGV, 2 do
  redis.call('HSET', KEYS[1], me .. '\\t' .. ARGV[i], deadline .. ',' .. ARGV[i + 1])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 4)
local all = redis.call('HGETALL', KEYS[1])
local sums = {}
local order = {}
local peers = {}
local npeers = 0
for i = 1, #all, 2 do
  local field = all[i]
  local value = all[i + 1]
  local tab = string.find(field, '\\t', 1, true)
  local owner = string.sub(field, 1, tab - 1)
  local worker = string.sub(field, tab + 1)
  local d, r, p, a = string.match(value, '^(%d+),(%d+),(%d+),(%d+)$')
  if d == nil or tonumber(d) < now then
    redis.call('HDEL', KEYS[1], field)
  elseif owner ~= me then
    if not peers[owner] then peers[owner] = true; npeers = npeers + 1 end
    local s = sums[worker]
    if s == nil then
      s = {0, 0, 0}
      sums[worker] = s
      order[#order + 1] = worker
    end
    s[1] = s[1] + tonumber(r)
    s[2] = s[2] + tonumber(p)
    s[3] = s[3] + tonumber(a)
  end
end
local out = {npeers}
for _, worker in ipairs(order) do
  local s = sums[worker]
  out[#out + 1] = worker
  out[#out + 1] = s[1]
  out[#out + 1] = s[2]
  out[#out + 1] = s[3]
end
return out
"""

#: Delete this replica's fields (clean shutdown). KEYS[1] the hash, ARGV[1] the replica id.
_LEAVE = """
local all = redis.call('HKEYS', KEYS[1])
local prefix = ARGV[1] .. '\\t'
local n = 0
for _, field in ipairs(all) do
  if string.sub(field, 1, #prefix) == prefix then
    redis.call('HDEL', KEYS[1], field)
    n = n + 1
  end
end
return n
"""


@dataclass(frozen=True)
class SharedLoadStatistics:
    """What ``/health`` and ``/metrics`` show about load sharing."""

    peers: int
    """Other live replicas in the last successful sync."""
    peer_requests: int
    """Requests the other replicas have in flight (all workers)."""
    syncs: int
    sync_errors: int
    fallback: bool
    """True while Redis has not answered for ``load_ttl_s``: local load only."""
    age_s: float | None
    """Seconds since the last successful sync (None: never)."""
    last_error: str | None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class SharedLoad:
    """Publishes this replica's in-flight load and reads the others' (see the module docstring).

    ``local_load()`` returns this replica's per-worker load; it is called from
    the ``state-load`` thread, so it must do its own locking (the router
    service passes a function that holds its lock around ``router.load()``).
    Implements :class:`~tokenspeed_router.router.router.PeerLoad`.
    """

    def __init__(
        self,
        config: RedisStateConfig,
        local_load: Callable[[], Mapping[str, Any]],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._local_load = local_load
        self._clock = clock
        self._key = config.keys.load
        self._ttl_ms = max(1, int(config.load_ttl_s * 1000))
        self._errors = transient_errors()
        self._client = connect(config)
        self._sync_script = self._client.register_script(_SYNC)
        self._leave_script = self._client.register_script(_LEAVE)
        self._peers: Mapping[str, WorkerLoad] = {}
        self._num_peers = 0
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_ok: float | None = None
        self._fallback = False
        self._syncs = 0
        self._sync_errors = 0
        self._last_error: str | None = None
        self._limited = RateLimitedLog(logger, 10.0)

    # ------------------------------------------------------------ routing thread

    def peers(self) -> Mapping[str, WorkerLoad]:
        """Other replicas' load per worker, as of the last sync (empty in fallback)."""
        return self._peers

    def changed(self) -> None:
        """This replica's load changed: publish it soon.

        ``is_set`` first: a plain read, where ``set`` takes a lock and notifies;
        between two syncs (``load_min_interval_s``) only the first change pays.
        """
        if not self._dirty.is_set():
            self._dirty.set()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> SharedLoad:
        """Sync once (so a replica starts knowing its peers when Redis is up), then run."""
        self.sync_now()
        self._thread = threading.Thread(target=self._run, name="state-load", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop syncing and delete this replica's fields, so its load stops counting at once."""
        self._stop.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(5.0)
        try:
            self._leave_script(keys=[self._key], args=[self._config.replica_id])
        except self._errors as err:
            logger.info("state: could not remove this replica's load (%s); it expires in %.1fs",
                        err, self._config.load_ttl_s)
        self._client.close()

    def crash(self) -> None:
        """Stop syncing without cleaning up, as a killed process would (tests, fault drills)."""
        self._stop.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self._client.close()

    # ------------------------------------------------------------ syncing

    def sync_now(self) -> bool:
        """One sync: publish the local load, read the peers'. False when Redis did not answer."""
        args: list[Any] = [self._config.replica_id, self._ttl_ms]
        for worker, load in self._local_load().items():
            args.append(worker)
            args.append(f"{max(0, load.active_requests)},{max(0, load.pending_prefill_tokens)},"
                        f"{max(0, load.active_tokens)}")
        try:
            reply = self._sync_script(keys=[self._key], args=args)
        except self._errors as err:
            self._failed(err)
            return False
        peers: dict[str, WorkerLoad] = {}
        for i in range(1, len(reply), 4):
            name = reply[i].decode() if isinstance(reply[i], bytes) else str(reply[i])
            peers[name] = WorkerLoad(int(reply[i + 1]), int(reply[i + 2]), int(reply[i + 3]))
        self._peers = peers
        self._num_peers = int(reply[0])
        self._last_ok = self._clock()
        self._syncs += 1
        if self._fallback or self._last_error is not None:
            logger.warning("state: load sharing back (Redis answers again); %d peer replica(s)",
                           self._num_peers)
        self._fallback = False
        self._last_error = None
        return True

    def _failed(self, err: BaseException) -> None:
        self._sync_errors += 1
        self._last_error = f"{type(err).__name__}: {err}"
        age = None if self._last_ok is None else self._clock() - self._last_ok
        if not self._fallback and (age is None or age >= self._config.load_ttl_s):
            self._fallback = True
            self._peers = {}
            self._num_peers = 0
            logger.warning("state: Redis unreachable for load sharing (%s): routing on this "
                           "replica's load only until it answers", self._last_error)
        else:
            self._limited.log(logging.WARNING, "sync", "state: load sync failed (%s)", self._last_error)

    def _run(self) -> None:
        cfg = self._config
        backoff = Backoff(cfg.backoff_min_s, cfg.backoff_max_s, self._stop)
        while not self._stop.is_set():
            self._dirty.wait(cfg.load_refresh_s)
            if self._stop.is_set():
                return
            self._dirty.clear()
            try:
                ok = self.sync_now()
            except Exception as err:  # a bug must not kill load sharing silently
                logger.exception("state: load sync crashed")
                self._failed(err)
                ok = False
            if ok:
                backoff.reset()
                if self._stop.wait(cfg.load_min_interval_s):
                    return
            elif backoff.wait():
                return

    def statistics(self) -> SharedLoadStatistics:
        peers = self._peers
        return SharedLoadStatistics(
            peers=self._num_peers,
            peer_requests=sum(p.active_requests for p in peers.values()),
            syncs=self._syncs,
            sync_errors=self._sync_errors,
            fallback=self._fallback,
            age_s=None if self._last_ok is None else round(self._clock() - self._last_ok, 3),
            last_error=self._last_error,
        )
