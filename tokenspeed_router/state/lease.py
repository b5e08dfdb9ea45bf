"""The ingestion lease: one leader at a time, with a fencing token.

Why a lease *and* a fence: a lease (``SET NX PX``) elects one ingesting
replica, but a leader that was paused (GC, SIGSTOP, a long partition) can wake
up after its lease expired and keep writing. Every acquisition therefore takes
a strictly larger fencing token (``INCR``), the append script rejects writes
whose token is not the current one (:mod:`tokenspeed_router.state.stream`),
and so a stale leader's writes fail instead of interleaving with the new
leader's. Renewal and release compare the holder before acting, so a replica
never extends or deletes a lease it no longer holds.

After a Redis restart without persistence the fence counter starts again from
zero; acquisition takes a ``floor`` (the highest token this replica has seen)
so tokens stay monotonic across that reset too.

Not thread-safe: one thread (the replica's lease loop) drives it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenspeed_router.state.config import StateKeys

if TYPE_CHECKING:
    import redis

__all__ = ["Lease", "LeaseHolder"]

_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local f = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[3])
if f <= floor then
  f = floor + 1
  redis.call('SET', KEYS[2], f)
end
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. f, 'PX', ARGV[2])
return f
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaseHolder(tuple[str, int]):
    """``(replica_id, fence)`` of the current lease holder."""

    @property
    def replica_id(self) -> str:
        return self[0]

    @property
    def fence(self) -> int:
        return self[1]


class Lease:
    """Acquire, renew and release the ingestion lease of one cluster."""

    def __init__(self, client: redis.Redis, keys: StateKeys, replica_id: str, ttl_s: float) -> None:
        self._client = client
        self._keys = keys
        self._replica_id = replica_id
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._token: int | None = None

    @property
    def token(self) -> int | None:
        """The fencing token of the lease we hold, or None."""
        return self._token

    def _value(self) -> str:
        return f"{self._replica_id}|{self._token}"

    def try_acquire(self, floor: int = 0) -> int | None:
        """Take the lease if it is free; return the new fencing token, or None if held."""
        token: Any = self._acquire(
            keys=[self._keys.lease, self._keys.fence], args=[self._replica_id, self._ttl_ms, floor]
        )
        if token is None:
            return None
        self._token = int(token)
        return self._token

    def renew(self) -> bool:
        """Extend our lease by the TTL; False (and forget the token) if we no longer hold it."""
        if self._token is None:
            return False
        ok = bool(self._renew(keys=[self._keys.lease], args=[self._value(), self._ttl_ms]))
        if not ok:
            self._token = None
        return ok

    def release(self) -> bool:
        """Give the lease up now (clean shutdown) so a successor need not wait for expiry."""
        if self._token is None:
            return False
        released = bool(self._release(keys=[self._keys.lease], args=[self._value()]))
        self._token = None
        return released

    def forget(self) -> None:
        """Drop our token without touching Redis (we learnt we lost the lease)."""
        self._token = None

    def holder(self) -> LeaseHolder | None:
        """Who holds the lease now (for status pages), or None."""
        raw = self._client.get(self._keys.lease)
        if raw is None:
            return None
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        replica, _, fence = text.rpartition("|")
        return LeaseHolder((replica, int(fence)))
