"""Configuration of the Redis state backend, and the key names it derives.

One frozen, keyword-only struct, validated on construction, so a typo in a
deployment fails at start-up rather than as a silent misbehaviour at 3 a.m.
The library never reads environment variables: ``serve --state URL`` builds
this from the URL and its query string.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from tokenspeed_router.errors import ConfigError

__all__ = ["RedisStateConfig", "StateKeys", "join_url"]

_SCHEMES = ("redis", "rediss", "unix")


def _default_replica_id() -> str:
    """Host, pid and a random suffix: unique, and readable in ``/health`` and in Redis."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, kw_only=True)
class RedisStateConfig:
    """Everything the Redis state backend needs; see docs/replicas.md.

    ``cluster`` namespaces every key (several router clusters may share one
    Redis); keys carry it as a hash tag so they land in one Redis Cluster slot
    and the Lua scripts that touch several of them stay legal there.
    """

    url: str
    cluster: str = "default"
    #: Approximate bound on the stream length (XADD MAXLEN ~). Size it to hold
    #: at least two snapshot intervals of batches, or restarts fall back to a rebuild.
    maxlen: int = 1_000_000
    #: Ingestion lease time-to-live; a dead leader is replaced after at most this long.
    lease_ttl_s: float = 5.0
    #: How often the leader renews; default a third of the TTL (two renewals may fail).
    lease_renew_s: float | None = None
    #: Snapshot when this many stream entries were applied since the last one...
    snapshot_every_batches: int = 50_000
    #: ...or when the last one is this old (and anything changed).
    snapshot_every_s: float = 60.0
    #: Entries the leader keeps while Redis is unreachable; beyond it, it drops and
    #: marks the affected workers for resync.
    buffer_size: int = 100_000
    #: Entries per fenced append script call (one round trip).
    append_batch: int = 256
    #: Entries per XREAD and how long one XREAD blocks.
    read_count: int = 1_000
    read_block_ms: int = 200
    #: Reconnect backoff (exponential between these bounds).
    backoff_min_s: float = 0.05
    backoff_max_s: float = 2.0
    #: Connect / command timeouts for the Redis client.
    socket_timeout_s: float = 2.0
    #: Share in-flight load with the other replicas (``state/load.py``).
    share_load: bool = True
    #: A replica's published load counts this long after its last sync (a dead
    #: replica's load clears after at most this); also how long a Redis outage
    #: is bridged with the last view of the peers before routing on local load.
    load_ttl_s: float = 2.0
    #: Heartbeat: publish this replica's totals at least this often (a late
    #: joiner knows everyone after one period; must stay below ``load_ttl_s``)...
    load_refresh_s: float = 0.25
    #: ...and at most once per this (a burst of local changes costs one message).
    load_min_interval_s: float = 0.001
    #: How in-flight work travels: ``pubsub`` (Redis Pub/Sub, the default:
    #: a little faster at the median, nothing kept in Redis) or ``streams`` (XADD / XREAD).
    flight_transport: str = "pubsub"
    #: How the index is fed: ``direct`` (every replica subscribes to every
    #: engine itself: active-active) or ``stream`` (only the lease holder
    #: subscribes and appends to a Redis stream the others read: for engines
    #: reachable from one place only). See docs/replicas.md.
    ingest: str = "direct"
    replica_id: str = field(default_factory=_default_replica_id)

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in _SCHEMES:
            raise ConfigError(f"state url must be redis://, rediss:// or unix://, got {self.url!r}")
        if not self.cluster or any(c in self.cluster for c in "{}: \t\n"):
            raise ConfigError(f"cluster name must be non-empty without braces, colons or spaces: {self.cluster!r}")
        positive = {
            "maxlen": self.maxlen, "lease_ttl_s": self.lease_ttl_s,
            "snapshot_every_batches": self.snapshot_every_batches,
            "snapshot_every_s": self.snapshot_every_s, "buffer_size": self.buffer_size,
            "append_batch": self.append_batch, "read_count": self.read_count,
            "read_block_ms": self.read_block_ms, "backoff_min_s": self.backoff_min_s,
            "backoff_max_s": self.backoff_max_s, "socket_timeout_s": self.socket_timeout_s,
            "load_ttl_s": self.load_ttl_s, "load_refresh_s": self.load_refresh_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{name} must be positive, got {value!r}")
        if self.lease_renew_s is not None and not 0 < self.lease_renew_s < self.lease_ttl_s:
            raise ConfigError(
                f"lease_renew_s must be in (0, lease_ttl_s={self.lease_ttl_s}), got {self.lease_renew_s}"
            )
        if not 0 <= self.load_min_interval_s <= self.load_refresh_s < self.load_ttl_s:
            raise ConfigError(
                "load timing must satisfy 0 <= load_min_interval_s <= load_refresh_s < load_ttl_s, "
                f"got {self.load_min_interval_s}, {self.load_refresh_s}, {self.load_ttl_s}"
            )
        if self.flight_transport not in ("pubsub", "streams"):
            raise ConfigError(f"flight_transport must be 'pubsub' or 'streams', got {self.flight_transport!r}")
        if self.ingest not in ("direct", "stream"):
            raise ConfigError(f"ingest must be 'direct' or 'stream', got {self.ingest!r}")
        if self.backoff_min_s > self.backoff_max_s:
            raise ConfigError("backoff_min_s must not exceed backoff_max_s")
        if self.read_block_ms / 1000 >= self.socket_timeout_s:
            raise ConfigError("read_block_ms must be shorter than socket_timeout_s")
        if not self.replica_id:
            raise ConfigError("replica_id must be non-empty")

    @property
    def renew_interval_s(self) -> float:
        return self.lease_renew_s if self.lease_renew_s is not None else self.lease_ttl_s / 3

    @property
    def keys(self) -> StateKeys:
        return StateKeys.for_cluster(self.cluster)

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> RedisStateConfig:
        """Build from ``redis://host:port/db?cluster=a&maxlen=100000&lease_ttl_s=3``.

        Query parameters named like fields set them (typed by the field's
        default); everything else stays in the URL for redis-py (``password``
        and friends). Keyword ``overrides`` win over the query string.
        """
        parts = urlsplit(url)
        ours: dict[str, Any] = {}
        rest: list[tuple[str, str]] = []
        fields = cls.__dataclass_fields__
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key in fields and key != "url":
                ours[key] = _coerce(key, value)
            else:
                rest.append((key, value))
        query = "&".join(f"{k}={v}" for k, v in rest)
        clean = join_url(parts.scheme, parts.netloc, parts.path, query, parts.fragment)
        ours.update(overrides)
        try:
            return cls(url=clean, **ours)
        except TypeError as err:
            raise ConfigError(f"bad state option: {err}") from err


def join_url(scheme: str, netloc: str, path: str, query: str, fragment: str = "") -> str:
    """``urlunsplit`` that keeps ``unix:///path`` whole (it writes ``unix:/path``,
    which redis-py refuses: "unix" is not among the schemes it knows have a netloc)."""
    url = urlunsplit((scheme, netloc, path, query, fragment))
    if not netloc and scheme and url.startswith(f"{scheme}:/") and not url.startswith(f"{scheme}://"):
        url = f"{scheme}://{url[len(scheme) + 1:]}"
    return url


_FLOATS = {"lease_ttl_s", "lease_renew_s", "snapshot_every_s", "backoff_min_s", "backoff_max_s",
           "socket_timeout_s", "load_ttl_s", "load_refresh_s", "load_min_interval_s"}
_BOOLS = {"share_load"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_INTS = {"maxlen", "snapshot_every_batches", "buffer_size", "append_batch", "read_count",
         "read_block_ms"}


def _coerce(key: str, value: str) -> Any:
    try:
        if key in _FLOATS:
            return float(value)
        if key in _INTS:
            return int(value)
        if key in _BOOLS:
            if value.lower() in _TRUE:
                return True
            if value.lower() in _FALSE:
                return False
            raise ValueError(value)
    except ValueError as err:
        raise ConfigError(f"state option {key}={value!r} is not a valid "
                          f"{'boolean' if key in _BOOLS else 'number'}") from err
    return value


@dataclass(frozen=True)
class StateKeys:
    """Key names of one router cluster; ``{cluster}`` is a Redis Cluster hash tag."""

    lease: str
    fence: str
    stream: str
    counter: str
    generation: str
    snapshot: str
    snapshot_meta: str
    snapshot_lock: str
    load: str
    #: Pub/Sub channel and stream key of the shared in-flight work (state/load.py)
    flight: str
    flight_stream: str

    @classmethod
    def for_cluster(cls, cluster: str) -> StateKeys:
        p = f"tsr:{{{cluster}}}:"
        return cls(
            lease=p + "lease", fence=p + "fence", stream=p + "stream", counter=p + "count",
            generation=p + "gen", snapshot=p + "snap", snapshot_meta=p + "snapmeta",
            snapshot_lock=p + "snaplock", load=p + "load",
            flight=p + "flight", flight_stream=p + "flightlog",
        )
