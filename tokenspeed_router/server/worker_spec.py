"""Worker specs: what ``--worker k=v,...``, a TOML ``[[workers]]`` table and ``PUT /workers`` say.

One shape everywhere (keys ``name``, ``events``, ``replay``, ``role``,
``dp_ranks``, ``topic``, ``url``, ``curve_server_key``, ``curve_key``),
validated when built: a bad endpoint, role or duplicate endpoint fails here
with a :class:`ConfigError` naming the worker.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenspeed_router.endpoints import endpoint_with_port_offset, parse_endpoint
from tokenspeed_router.errors import ConfigError
from tokenspeed_router.events.curve import CurveClientKeys
from tokenspeed_router.router.router import WorkerRole

__all__ = ["MAX_DP_RANKS", "WORKER_KEYS", "SubscriberSpec", "WorkerSpec", "parse_workers"]

#: keys a worker spec accepts (``--worker k=v,...``, a ``[[workers]]`` table, PUT /workers body)
WORKER_KEYS = ("name", "events", "replay", "role", "dp_ranks", "topic", "curve_server_key", "curve_key", "url")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}$")
MAX_DP_RANKS = 1024
_URL_RE = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]\s]+)(:\d{1,5})?(/\S*)?$")


@dataclass(frozen=True, kw_only=True)
class SubscriberSpec:
    """One event stream to subscribe to: a worker, or one DP rank of it.

    ``name`` is the index identity (DESIGN §4): ``NAME`` for one rank,
    ``NAME/dpR`` for rank R of a multi-rank worker.
    """

    name: str
    worker: str
    dp_rank: int
    events: str
    replay: str | None
    topic: str
    role: WorkerRole
    curve: CurveClientKeys | None = None
    """CURVE client keys when the publisher (a relay) is a CURVE server."""


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """A configured worker: ``name=...,events=...,replay=...,role=...,dp_ranks=N,topic=...,url=...``.

    ``url`` (``http://host:port``) is the engine's OpenAI-compatible server:
    the gateway (DESIGN §10) proxies to workers that have one.
    ``curve_server_key=FILE`` (the relay's public certificate) and
    ``curve_key=FILE`` (this router's secret certificate, ``NAME.key_secret``)
    subscribe over ZeroMQ CURVE, to a relay started with ``--curve-*``.
    """

    name: str
    events: str
    replay: str | None = None
    role: WorkerRole = WorkerRole.BOTH
    dp_ranks: int = 1
    topic: str = ""
    curve_server_key: str | None = None
    curve_key: str | None = None
    url: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ConfigError(
                f"worker name {self.name!r} is invalid: use letters, digits, '_', '-', '.', ':' "
                "(1-128 chars, '/' is reserved for DP ranks)"
            )
        what = f"worker {self.name!r}"
        parse_endpoint(self.events, what=f"{what} events", connect=True)
        if self.replay is not None:
            parse_endpoint(self.replay, what=f"{what} replay", connect=True)
        object.__setattr__(self, "role", _parse_role(self.role, what))  # "decode" -> WorkerRole.DECODE
        if isinstance(self.dp_ranks, bool) or not isinstance(self.dp_ranks, int):
            raise ConfigError(f"{what}: dp_ranks must be an integer, got {self.dp_ranks!r}")
        if not 1 <= self.dp_ranks <= MAX_DP_RANKS:
            raise ConfigError(f"{what}: dp_ranks must be in 1..{MAX_DP_RANKS}, got {self.dp_ranks}")
        if not isinstance(self.topic, str):
            raise ConfigError(f"{what}: topic must be a string, got {self.topic!r}")
        if self.url is not None and (not isinstance(self.url, str) or not _URL_RE.match(self.url)):
            raise ConfigError(f"{what}: url must be http://HOST[:PORT][/PATH], got {self.url!r}")
        if self.events == self.replay:
            raise ConfigError(f"{what}: events and replay endpoints must differ ({self.events})")
        if (self.curve_server_key is None) != (self.curve_key is None):
            raise ConfigError(
                f"{what}: CURVE needs both curve_server_key=FILE (the relay's public key) "
                "and curve_key=FILE (this router's secret key)"
            )
        self.subscribers()  # port offsets must be representable, key files readable

    @classmethod
    def parse(cls, text: str) -> WorkerSpec:
        """Parse the ``--worker`` flag form ``k=v,k=v``."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError("--worker: empty worker spec")
        data: dict[str, Any] = {}
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep:
                raise ConfigError(f"worker spec {text!r}: {part!r} is not key=value "
                                  "(write name=NAME,events=ENDPOINT[,KEY=VALUE...]; serve --help lists the keys)")
            if key in data:
                raise ConfigError(f"worker spec {text!r}: key {key!r} given twice")
            data[key] = value.strip()
        return cls.from_mapping(data, source=f"worker spec {text!r}")

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], *, name: str | None = None, source: str = "worker"
    ) -> WorkerSpec:
        """Build from a mapping (TOML table, JSON body); strings are coerced for ``dp_ranks``."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: expected a table/object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(WORKER_KEYS))
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(WORKER_KEYS)})"
            )
        values = dict(data)
        if name is not None:
            if "name" in values and values["name"] != name:
                raise ConfigError(f"{source}: name {values['name']!r} does not match {name!r}")
            values["name"] = name
        for required in ("name", "events"):
            if values.get(required) in (None, ""):
                raise ConfigError(f"{source}: missing required key {required!r}")
        dp_ranks = values.get("dp_ranks", 1)
        if isinstance(dp_ranks, str):
            try:
                dp_ranks = int(dp_ranks)
            except ValueError:
                raise ConfigError(f"{source}: dp_ranks must be an integer, got {dp_ranks!r}") from None
        replay = values.get("replay") or None
        url = values.get("url") or None
        if isinstance(url, str):
            url = url.rstrip("/") or None  # http://h:8000/ and http://h:8000 are one engine
        return cls(
            name=values["name"],
            events=values["events"],
            replay=replay,
            role=_parse_role(values.get("role") or "both", source),
            dp_ranks=dp_ranks,
            topic=values.get("topic", "") or "",
            curve_server_key=values.get("curve_server_key") or None,
            curve_key=values.get("curve_key") or None,
            url=url,
        )

    def subscribers(self) -> tuple[SubscriberSpec, ...]:
        """One spec per DP rank, with the port offset applied to both endpoints."""
        curve = None
        if self.curve_server_key is not None and self.curve_key is not None:
            curve = CurveClientKeys.from_files(self.curve_server_key, self.curve_key)
        if self.dp_ranks == 1:
            return (
                SubscriberSpec(
                    name=self.name, worker=self.name, dp_rank=0, events=self.events,
                    replay=self.replay, topic=self.topic, role=self.role, curve=curve,
                ),
            )
        return tuple(
            SubscriberSpec(
                name=f"{self.name}/dp{rank}",
                worker=self.name,
                dp_rank=rank,
                events=endpoint_with_port_offset(self.events, rank),
                replay=None if self.replay is None else endpoint_with_port_offset(self.replay, rank),
                topic=self.topic,
                role=self.role,
                curve=curve,
            )
            for rank in range(self.dp_ranks)
        )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "role": self.role.value}


def _parse_role(value: Any, source: str) -> WorkerRole:
    try:
        return WorkerRole(value)
    except ValueError:
        known = ", ".join(r.value for r in WorkerRole)
        raise ConfigError(f"{source}: role must be one of {known}, got {value!r}") from None


def parse_workers(value: Any, what: str) -> tuple[WorkerSpec, ...]:
    """A worker list as each source writes it: flags (``k=v,...`` specs, one per ``--worker``),
    the environment (one string, specs separated by ``;`` or newlines), TOML (``[[workers]]``
    tables, the same keys)."""
    if isinstance(value, str):
        return tuple(WorkerSpec.parse(p) for p in re.split(r"[;\n]", value) if p.strip())
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{what}: workers must be [[workers]] tables, got {type(value).__name__}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, WorkerSpec):
            out.append(item)
        elif isinstance(item, str):
            out.append(WorkerSpec.parse(item))
        else:
            out.append(WorkerSpec.from_mapping(item, source=f"{what} workers[{i}]"))
    return tuple(out)
