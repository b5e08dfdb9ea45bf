"""Lease, fencing and configuration of the Redis state backend (real redis-server)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from support import wait_until

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.state import FencedError, GenerationError, RedisStateConfig, StateKeys
from tokenspeed_router.state._client import connect
from tokenspeed_router.state.lease import Lease
from tokenspeed_router.state.snapshot import SNAPSHOT_FORMAT, SnapshotEnvelope, SnapshotStore
from tokenspeed_router.state.stream import EntryMeta, StreamAppender, decode_entry, encode_meta

pytestmark = pytest.mark.redis


@pytest.fixture
def config(redis_url: str) -> RedisStateConfig:
    return RedisStateConfig(url=redis_url, cluster="t")


@pytest.fixture
def client(config: RedisStateConfig) -> Iterator[Any]:
    c = connect(config)
    yield c
    c.close()


def _lease(client: Any, replica: str, ttl_s: float = 5.0) -> Lease:
    return Lease(client, StateKeys.for_cluster("t"), replica, ttl_s)


def _seed(client: Any, fence: int, generation: str = "g1") -> None:
    envelope = SnapshotEnvelope(format=SNAPSHOT_FORMAT, generation=generation, n=0,
                                stream_id="0-0", created_s=0.0, replica_id="x", positions={},
                                worker_states={}, max_fence=fence, index=b"")
    SnapshotStore(client, StateKeys.for_cluster("t")).seed(fence, envelope, num_blocks=0)


def _entry(seq: int) -> tuple[bytes, bytes]:
    return encode_meta(EntryMeta("batch", "w0", 0, seq, 0.0)), b"payload"


def test_one_holder_renewal_and_release(client: Any) -> None:
    a, b = _lease(client, "a"), _lease(client, "b")
    first = a.try_acquire()
    assert first == 1
    assert b.try_acquire() is None
    assert a.renew() and not b.renew()
    holder = a.holder()
    assert holder is not None and holder.replica_id == "a" and holder.fence == 1
    assert not b.release()  # compare-and-delete: b cannot drop a's lease
    assert a.release()
    second = b.try_acquire()
    assert second is not None and second > first


def test_expiry_lets_another_replica_take_over(client: Any) -> None:
    a, b = _lease(client, "a", ttl_s=0.2), _lease(client, "b", ttl_s=0.2)
    assert a.try_acquire() == 1
    token = wait_until(lambda: b.try_acquire(), 5, interval_s=0.02, what="the lease to expire")
    assert token == 2
    assert not a.renew()  # a cannot renew a lease it lost
    assert a.token is None


def test_stale_leader_appends_are_fenced_off(config: RedisStateConfig, client: Any) -> None:
    keys = StateKeys.for_cluster("t")
    a, b = _lease(client, "a", ttl_s=0.2), _lease(client, "b", ttl_s=0.2)
    appender = StreamAppender(client, keys, maxlen=1000)
    old = a.try_acquire()
    assert old is not None
    _seed(client, old)
    assert len(appender.append(old, "g1", [_entry(0), _entry(1)])) == 2
    new = wait_until(lambda: b.try_acquire(), 5, interval_s=0.02, what="takeover")
    assert new is not None
    with pytest.raises(FencedError) as err:  # a was paused past its TTL and wakes up
        appender.append(old, "g1", [_entry(2)])
    assert err.value.current == new
    appender.append(new, "g1", [_entry(2)])
    with pytest.raises(GenerationError):
        appender.append(new, "other-generation", [_entry(3)])
    entries = [decode_entry(i, f) for i, f in client.xrange(keys.stream)]
    assert [e.n for e in entries] == [1, 2, 3]
    assert [e.fence for e in entries] == [old, old, new]
    assert [e.meta.seq for e in entries] == [0, 1, 2]


def test_fence_stays_monotonic_after_redis_lost_it(client: Any) -> None:
    a = _lease(client, "a")
    assert a.try_acquire() == 1
    client.flushall()  # what a restart without persistence does
    assert _lease(client, "b").try_acquire(floor=7) == 8


def test_config_from_url_and_validation(redis_url: str) -> None:
    cfg = RedisStateConfig.from_url(redis_url + "?cluster=blue&maxlen=5000&lease_ttl_s=2.5")
    assert (cfg.cluster, cfg.maxlen, cfg.lease_ttl_s) == ("blue", 5000, 2.5)
    assert cfg.url == redis_url and cfg.renew_interval_s == pytest.approx(2.5 / 3)
    assert cfg.keys.stream == "tsr:{blue}:stream"
    for bad in ("http://x", redis_url + "?maxlen=0", redis_url + "?lease_ttl_s=abc",
                redis_url + "?cluster=a:b"):
        with pytest.raises(ConfigError):
            RedisStateConfig.from_url(bad)
    with pytest.raises(ConfigError):
        RedisStateConfig(url=redis_url, lease_ttl_s=1.0, lease_renew_s=2.0)
