"""Configuration of the router process: one frozen object, validated at start.

Three sources fill it, highest precedence first:

1. command-line flags (``--worker``, ``--http``, ...),
2. environment variables ``TOKENSPEED_ROUTER_<KEY>`` (e.g. ``TOKENSPEED_ROUTER_HTTP``,
   ``TOKENSPEED_ROUTER_WORKERS="name=w0,events=tcp://...;name=w1,..."``; specs are
   separated by ``;`` or newlines, and ``TOKENSPEED_ROUTER_WORKER`` is the same
   variable spelled like the flag),
3. a TOML file (``--config router.toml`` or ``TOKENSPEED_ROUTER_CONFIG``).

Every key has the same name in all three (``zmq_api`` = ``--zmq-api`` =
``TOKENSPEED_ROUTER_ZMQ_API``); in TOML a key may be written with ``-`` as in
the flag (``zmq-api``, ``auth-token``), and the worker list as ``[[workers]]``
or ``[[worker]]``. List-valued keys (``workers``) are taken whole
from the highest source that sets them, never merged: merging worker lists
from two places makes "which workers am I routing to?" a puzzle at 3 a.m.

Why everything is validated here and not where it is used: a typo in an
endpoint or a duplicate worker name must stop ``serve`` at start with a
message naming the key, not surface minutes later as a silent, empty index.
The library itself never reads the environment (STYLE §9): only
:func:`load_server_config`, called by the CLI, does.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.events.curve import CurveClientKeys
from tokenspeed_router.gateway.config import GatewayConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "ENV_PREFIX",
    "ROLES",
    "ApiLimits",
    "HostPort",
    "Role",
    "ServerConfig",
    "SubscriberSpec",
    "WorkerSpec",
    "is_loopback_host",
    "load_server_config",
    "parse_endpoint",
    "parse_host_port",
]

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
ENV_PREFIX = "TOKENSPEED_ROUTER_"

#: keys a worker spec accepts (``--worker k=v,...``, a ``[[workers]]`` table, PUT /workers body)
WORKER_KEYS = ("name", "events", "replay", "role", "dp_ranks", "topic", "curve_server_key", "curve_key", "url")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}$")
_TCP_RE = re.compile(r"^tcp://(?P<host>\[[^\]\s]+\]|[^:/\[\]\s]+):(?P<port>\d+|\*)$")
MAX_DP_RANKS = 1024
_URL_RE = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]\s]+)(:\d{1,5})?(/\S*)?$")


# --------------------------------------------------------------------------- endpoints


def parse_endpoint(
    value: object, *, what: str, allow_wildcard_port: bool = False, connect: bool = False
) -> str:
    """Validate a ZeroMQ endpoint (``tcp://host:port``, ``ipc://path``, ``inproc://name``).

    ``connect=True`` for endpoints we connect to (a worker's ``events`` and
    ``replay``): those need a real host and port, so the bind-only wildcards
    (host ``*``, port ``*`` or ``0``) are refused here, at configuration time,
    instead of failing inside ZeroMQ when the subscriber starts.
    Returns the endpoint unchanged; raises :class:`ConfigError` naming ``what``.
    """
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what}: expected a ZeroMQ endpoint string, got {value!r}")
    if value.startswith(("ipc://", "inproc://")):
        if len(value.split("://", 1)[1]) == 0:
            raise ConfigError(f"{what}: {value!r} has an empty address")
        return value
    m = _TCP_RE.match(value)
    if m is None:
        raise ConfigError(
            f"{what}: {value!r} is not a ZeroMQ endpoint "
            "(expected tcp://HOST:PORT, ipc://PATH or inproc://NAME)"
        )
    host, port = m.group("host"), m.group("port")
    if connect and host in ("*", "[*]"):
        raise ConfigError(
            f"{what}: {value!r} has host '*', which only works for binding; the router "
            "connects to this endpoint, so give the worker's address (e.g. tcp://127.0.0.1:5557)"
        )
    if port == "*":
        if connect or not allow_wildcard_port:
            raise ConfigError(f"{what}: {value!r} needs an explicit port")
        return value
    if not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what}: port {port} out of range in {value!r}")
    if connect and int(port) == 0:
        raise ConfigError(
            f"{what}: {value!r} has port 0, which only works for binding; give the worker's real port"
        )
    return value


def endpoint_with_port_offset(endpoint: str, offset: int) -> str:
    """``tcp://h:5557`` + 2 -> ``tcp://h:5559`` (vLLM/TokenSpeed DP-rank convention, DESIGN §3)."""
    if offset == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{offset}"
    m = _TCP_RE.match(endpoint)
    if m is None or m.group("port") == "*":
        raise ConfigError(
            f"endpoint {endpoint!r}: data-parallel ranks need tcp://HOST:PORT "
            "(ranks publish on port + rank)"
        )
    port = int(m.group("port")) + offset
    if port > 65535:
        raise ConfigError(f"endpoint {endpoint!r} + rank {offset} exceeds port 65535")
    return f"tcp://{m.group('host')}:{port}"


@dataclass(frozen=True)
class HostPort:
    """A TCP listen address (port 0 lets the OS choose)."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_host_port(value: object, *, what: str) -> HostPort:
    """Parse ``HOST:PORT`` / ``[v6]:PORT`` / ``:PORT`` (-> 127.0.0.1)."""
    if isinstance(value, HostPort):
        return value
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"{what}: expected HOST:PORT, got {value!r}")
    host, _, port_text = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    host = host or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{what}: port {port_text!r} is not a number in {value!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{what}: port {port} out of range in {value!r}")
    return HostPort(host, port)


def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost`` (what we bind unless told otherwise)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------- workers


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
    role: Role
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
    role: Role = "both"
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
        if self.role not in ROLES:
            raise ConfigError(f"{what}: role must be one of {', '.join(ROLES)}, got {self.role!r}")
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
                raise ConfigError(f"worker spec {text!r}: {part!r} is not key=value")
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
        data = _canonical_keys(data, {}, source)  # dp-ranks = dp_ranks
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
            role=values.get("role", "both") or "both",
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
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- service


@dataclass(frozen=True, kw_only=True)
class ApiLimits:
    """Bounds on what one API request may ask; beyond them the answer is 413/400."""

    max_body_bytes: int = 8 << 20
    max_tokens: int = 1 << 20
    max_request_id_len: int = 256

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{f.name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything ``serve`` needs; immutable once validated.

    ``router_options`` are passed to :class:`tokenspeed_router.router.RouterConfig`
    by keyword (with ``policy``), so routing knobs need no change here when the
    router gains one. ``http=None`` disables the HTTP listener.
    """

    workers: tuple[WorkerSpec, ...] = ()
    http: HostPort | None = HostPort("127.0.0.1", 8000)
    zmq_api: str | None = None
    auth_token: str | None = None
    state: str | None = None
    record: str | None = None
    policy: str | None = None
    router_options: Mapping[str, Any] = field(default_factory=dict)
    limits: ApiLimits = field(default_factory=ApiLimits)
    stale_after_s: float = 10.0
    replay_timeout_s: float = 2.0
    inflight_timeout_s: float | None = None
    gateway: GatewayConfig = field(default_factory=GatewayConfig)

    def __post_init__(self) -> None:
        names: set[str] = set()
        for spec in self.workers:
            for sub in spec.subscribers():
                if sub.name in names:
                    raise ConfigError(f"duplicate worker name {sub.name!r}")
                names.add(sub.name)
        endpoints: dict[str, str] = {}
        for spec in self.workers:
            for sub in spec.subscribers():
                for ep in (sub.events, sub.replay):
                    if ep is None:
                        continue
                    other = endpoints.get(ep)
                    if other is not None and other != sub.name:
                        raise ConfigError(
                            f"workers {other!r} and {sub.name!r} use the same endpoint {ep}"
                        )
                    endpoints[ep] = sub.name
        if self.zmq_api is not None:
            parse_endpoint(self.zmq_api, what="zmq_api")
        if self.auth_token is not None and (not self.auth_token or self.auth_token != self.auth_token.strip()):
            raise ConfigError("auth_token must be non-empty and have no surrounding whitespace")
        for name in ("stale_after_s", "replay_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")

    def subscribers(self) -> list[SubscriberSpec]:
        return [sub for spec in self.workers for sub in spec.subscribers()]

    def router_config(self) -> Any:
        """Build the :class:`RouterConfig`; unknown knobs are a :class:`ConfigError`."""
        from tokenspeed_router.router.router import RouterConfig

        options = dict(self.router_options)
        if self.policy is not None:
            options["policy"] = self.policy
        if self.inflight_timeout_s is not None:
            options.setdefault("inflight_timeout_s", self.inflight_timeout_s)
        try:
            return RouterConfig(**options)
        except (TypeError, ValueError) as err:
            known = ""
            if dataclasses.is_dataclass(RouterConfig):
                known = f" (known: {', '.join(f.name for f in dataclasses.fields(RouterConfig))})"
            raise ConfigError(f"router options {options!r}: {err}{known}") from err


# --------------------------------------------------------------------------- loading

#: key -> parser(value, source) for scalar keys; also the list of known keys.
_SCALAR_KEYS = (
    "http",
    "zmq_api",
    "auth_token",
    "auth_token_file",
    "state",
    "record",
    "policy",
    "stale_after_s",
    "replay_timeout_s",
    "inflight_timeout_s",
    "max_body_bytes",
    "max_tokens",
    *GatewayConfig.setting_names(),
)
_LIST_KEYS = ("workers",)
_TABLE_KEYS = ("router",)
KNOWN_KEYS = _SCALAR_KEYS + _LIST_KEYS + _TABLE_KEYS
#: other spellings of a key, after ``-`` -> ``_`` (TOML, environment): the flag is
#: ``--worker`` (singular) and ``--router-option``, the canonical keys are plural/``router``
KEY_ALIASES = {"worker": "workers", "router_option": "router", "router_options": "router"}
#: environment variables read by other parts of the CLI, not by ServerConfig
_FOREIGN_ENV = {"LOG_LEVEL", "CONFIG"}


def _canonical_keys(data: Mapping[str, Any], aliases: Mapping[str, str], source: str) -> dict[str, Any]:
    """Keys with ``-`` read as ``_`` and aliases resolved (``zmq-api`` = ``zmq_api``,
    ``worker`` = ``workers``); two spellings of one key in the same place is an error."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in data.items():
        canon = str(key).replace("-", "_")
        canon = aliases.get(canon, canon)
        if canon in given:
            raise ConfigError(f"{source}: {given[canon]!r} and {key!r} set the same key {canon!r}; give one")
        given[canon] = str(key)
        out[canon] = value
    return out


def _parse_float(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: expected a number, got {value!r}") from None
    if not out > 0 or out == float("inf"):
        raise ConfigError(f"{what}: must be a positive finite number, got {value!r}")
    return out


def _parse_int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected an integer, got {value!r}")
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: expected an integer, got {value!r}") from None
    if out <= 0:
        raise ConfigError(f"{what}: must be positive, got {value!r}")
    return out


def _parse_option_value(text: str) -> Any:
    """Router option values from flags/env: JSON when it parses (numbers, bools), else text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_router_options(items: Any, what: str) -> dict[str, Any]:
    """``["k=v", ...]`` or ``"k=v;k=v"`` or a mapping -> dict."""
    if isinstance(items, Mapping):
        return _canonical_keys(items, {}, what)  # queue-weight = queue_weight
    if isinstance(items, str):
        items = [p for p in re.split(r"[;\n]", items) if p.strip()]
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{what}: {item!r} is not KEY=VALUE")
        out[key.strip().replace("-", "_")] = _parse_option_value(value.strip())
    return out


STATE_SCHEMES = ("redis", "rediss", "unix")


def check_state_url(url: str, what: str) -> str:
    """Catch a malformed ``--state`` URL here, with a message, not as a ValueError deep in redis-py."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a port that is not a number
    except ValueError as err:
        raise ConfigError(f"{what}: {url!r} is not a valid URL: {err}") from None
    if parts.scheme not in STATE_SCHEMES:
        raise ConfigError(f"{what}: {url!r}: the state URL must be redis://, rediss:// or unix://")
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError(f"{what}: {url!r} names no socket path (unix:///path/to/redis.sock)")
        return url
    if not parts.hostname:
        raise ConfigError(f"{what}: {url!r} names no host (e.g. redis://127.0.0.1:6379/0)")
    if port is not None and not 0 < port <= 65535:
        raise ConfigError(f"{what}: port {port} out of range in {url!r}")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError(f"{what}: {url!r}: the database must be a number (redis://HOST:PORT/0)")
    return url


def check_output_path(path: str, what: str) -> str:
    """An output file we will create: its directory must exist and it must not be a directory."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what}: {path!r} is a directory, not a file")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"{what}: cannot write {path!r}: directory {str(parent)!r} does not exist")
    return path


def _parse_workers(value: Any, what: str) -> tuple[WorkerSpec, ...]:
    if isinstance(value, str):  # env: specs separated by ';' or newlines
        return tuple(WorkerSpec.parse(p) for p in re.split(r"[;\n]", value) if p.strip())
    if isinstance(value, Mapping):  # TOML [workers.NAME] tables
        return tuple(
            WorkerSpec.from_mapping(v, name=k, source=f"{what} [workers.{k}]") for k, v in value.items()
        )
    if isinstance(value, (list, tuple)):
        out = []
        for i, item in enumerate(value):
            if isinstance(item, WorkerSpec):
                out.append(item)
            elif isinstance(item, str):
                out.append(WorkerSpec.parse(item))
            else:
                out.append(WorkerSpec.from_mapping(item, source=f"{what} workers[{i}]"))
        return tuple(out)
    raise ConfigError(f"{what}: workers must be a list of worker specs, got {type(value).__name__}")


def _read_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found") from None
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r}: {err}") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from err
    source = f"config file {str(path)!r}"
    data = _canonical_keys(data, KEY_ALIASES, source)
    unknown = sorted(set(data) - set(KNOWN_KEYS))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(map(repr, unknown))} "
            f"(known: {', '.join(KNOWN_KEYS)}; '-' may be written for '_', "
            "and 'worker' for 'workers')"
        )
    return data


def _read_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        key = var[len(ENV_PREFIX):].lower()
        if key.upper() in _FOREIGN_ENV:
            continue
        key = KEY_ALIASES.get(key, key)  # TOKENSPEED_ROUTER_WORKER, like the --worker flag
        if key in KNOWN_KEYS and (key != "router" or var != ENV_PREFIX + "ROUTER"):
            if key in given:
                raise ConfigError(f"environment: {given[key]} and {var} are both set; give one")
            given[key] = var
            out[key] = value
        else:
            # Not fatal: other parts of the CLI may own TOKENSPEED_ROUTER_* names.
            logger.warning("ignoring unknown environment variable %s", var)
    return out


def load_server_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> ServerConfig:
    """Merge flags > env > file into a validated :class:`ServerConfig`.

    ``flags`` holds only the values actually given (None means "not given").
    ``config_file`` defaults to ``env["TOKENSPEED_ROUTER_CONFIG"]``.
    """
    flags = {k: v for k, v in (flags or {}).items() if v is not None and v != [] and v != ()}
    env = env or {}
    if config_file is None:
        config_file = env.get(ENV_PREFIX + "CONFIG") or None
    layers: list[tuple[str, Mapping[str, Any]]] = [
        ("flag", flags),
        ("environment", _read_env(env)),
    ]
    if config_file is not None:
        layers.append((f"config file {str(config_file)!r}", _read_toml(config_file)))

    def pick(key: str) -> tuple[Any, str] | None:
        for source, layer in layers:
            if key in layer:
                return layer[key], source
        return None

    kwargs: dict[str, Any] = {}
    if (got := pick("workers")) is not None:
        kwargs["workers"] = _parse_workers(got[0], got[1])
    if (got := pick("http")) is not None:
        value, source = got
        if isinstance(value, str) and value.strip().lower() in ("", "none", "off"):
            kwargs["http"] = None
        else:
            kwargs["http"] = parse_host_port(value, what=f"http ({source})")
    for key in ("zmq_api", "state", "record"):
        if (got := pick(key)) is not None:
            if not isinstance(got[0], str):
                raise ConfigError(f"{key} ({got[1]}): expected a string, got {got[0]!r}")
            kwargs[key] = got[0] or None
            if kwargs[key] is not None and key == "state":
                check_state_url(kwargs[key], f"state ({got[1]})")
            elif kwargs[key] is not None and key == "record":
                check_output_path(kwargs[key], f"record ({got[1]})")
    if kwargs.get("zmq_api") is not None:
        parse_endpoint(kwargs["zmq_api"], what="zmq_api")
    token_got = pick("auth_token")
    file_got = pick("auth_token_file")
    if token_got is not None and (
        file_got is None or layers_index(layers, token_got[1]) <= layers_index(layers, file_got[1])
    ):
        kwargs["auth_token"] = str(token_got[0]) or None
    elif file_got is not None:
        try:
            kwargs["auth_token"] = Path(str(file_got[0])).read_text().strip() or None
        except OSError as err:
            raise ConfigError(f"auth_token_file ({file_got[1]}): {err}") from err
    for key in ("stale_after_s", "replay_timeout_s", "inflight_timeout_s"):
        if (got := pick(key)) is not None:
            kwargs[key] = _parse_float(got[0], f"{key} ({got[1]})")
    limits: dict[str, int] = {}
    for key in ("max_body_bytes", "max_tokens"):
        if (got := pick(key)) is not None:
            limits[key] = _parse_int(got[0], f"{key} ({got[1]})")
    if limits:
        kwargs["limits"] = ApiLimits(**limits)
    kwargs["gateway"] = _gateway_config(pick)
    # Router knobs merge key by key (unlike workers): a flag overriding one knob
    # should not reset the others set in the file. ``policy`` may be given at
    # top level or inside the router table; the highest layer wins.
    tables = [
        (source, parse_router_options(layer["router"], f"router ({source})") if "router" in layer else {})
        for source, layer in layers
    ]
    for (source, layer), (_, table) in zip(layers, tables, strict=True):
        policy = layer.get("policy", table.get("policy"))
        if policy is not None:
            if not isinstance(policy, str) or not policy:
                raise ConfigError(f"policy ({source}): expected a policy name, got {policy!r}")
            kwargs["policy"] = policy
            break
    options: dict[str, Any] = {}
    for _, table in reversed(tables):
        options.update({k: v for k, v in table.items() if k != "policy"})
    kwargs["router_options"] = options
    return ServerConfig(**kwargs)


def _gateway_config(pick: Any) -> GatewayConfig:
    """The gateway settings from the layers (numbers may come as text from env/flags)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(GatewayConfig):
        got = pick(f.name)
        if got is None:
            continue
        value, source = got
        what = f"{f.name} ({source})"
        if f.name == "tokenizer":
            if not isinstance(value, str):
                raise ConfigError(f"{what}: expected 'engine' or a path, got {value!r}")
            values[f.name] = value
        elif f.name.endswith("_s"):
            values[f.name] = _parse_float(value, what)
        elif f.name == "upstream_retries":
            if isinstance(value, bool):
                raise ConfigError(f"{what}: expected an integer, got {value!r}")
            try:
                values[f.name] = int(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{what}: expected an integer, got {value!r}") from None
        else:
            values[f.name] = _parse_int(value, what)
    return GatewayConfig(**values)


def layers_index(layers: list[tuple[str, Mapping[str, Any]]], source: str) -> int:
    """Precedence rank of a source name (0 = highest)."""
    return next(i for i, (name, _) in enumerate(layers) if name == source)
