"""Configuration of the router process: one frozen object, validated at start.

Three sources fill it, highest precedence first: command-line flags,
environment variables ``TOKENSPEED_ROUTER_<KEY>``, a TOML file (``--config``
or ``TOKENSPEED_ROUTER_CONFIG``). Each setting has one spelling per source,
derived from one key: ``zmq_api`` is ``--zmq-api``,
``TOKENSPEED_ROUTER_ZMQ_API`` and ``zmq_api = ...`` in the file. Two settings
are lists or tables and say so in their names: ``workers`` (``--worker SPEC``
repeated, ``TOKENSPEED_ROUTER_WORKERS="spec;spec"``, ``[[workers]]`` tables)
and ``router``, the :class:`~tokenspeed_router.router.RouterConfig` knobs
other than ``policy`` and ``inflight_timeout_s`` (``--router-option K=V``
repeated, ``TOKENSPEED_ROUTER_ROUTER_OPTIONS="k=v;k=v"``, a ``[router]``
table). The worker list is taken whole from the highest source that has one,
never merged ("which workers am I routing to?" must have one answer); router
knobs merge knob by knob. The table of every key is ``docs/configuration.md``.

Why everything is validated here and not where it is used: a typo in an
endpoint or a duplicate worker name must stop ``serve`` at start with a
message naming the key, not surface minutes later as a silent, empty index.
The library itself never reads the environment (STYLE §9): only
:func:`load_server_config`, called by the CLI, does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenspeed_router.endpoints import (
    HostPort,
    endpoint_with_port_offset,
    is_loopback_host,
    parse_endpoint,
    parse_host_port,
)
from tokenspeed_router.errors import ConfigError
from tokenspeed_router.gateway.config import GatewayConfig
from tokenspeed_router.router.router import RouterConfig
from tokenspeed_router.server.explain import ExplainConfig
from tokenspeed_router.server.worker_spec import (
    WORKER_KEYS,
    SubscriberSpec,
    WorkerSpec,
    parse_workers,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "ENV_PREFIX",
    "WORKER_KEYS",
    "ApiLimits",
    "HostPort",
    "ServerConfig",
    "SubscriberSpec",
    "WorkerSpec",
    "endpoint_with_port_offset",
    "is_loopback_host",
    "load_server_config",
    "parse_endpoint",
    "parse_host_port",
]

logger = logging.getLogger(__name__)

ENV_PREFIX = "TOKENSPEED_ROUTER_"
#: where the HTTP API listens unless told otherwise (loopback only)
DEFAULT_HTTP = HostPort("127.0.0.1", 8000)


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
    """Everything ``serve`` needs; immutable once validated. ``http=None`` disables HTTP."""

    workers: tuple[WorkerSpec, ...] = ()
    http: HostPort | None = DEFAULT_HTTP
    zmq_api: str | None = None
    auth_token: str | None = None
    state: str | None = None
    record: str | None = None
    router: RouterConfig = field(default_factory=RouterConfig)
    limits: ApiLimits = field(default_factory=ApiLimits)
    stale_after_s: float = 10.0
    replay_timeout_s: float = 2.0
    #: a stream more than this far behind its publisher sheds its backlog (server/ingest_lag.py)
    ingest_max_lag_s: float = 1.0
    #: items one ingest pass reads at most before applying them (server/ingest_loop.py)
    ingest_queue: int = 4096
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    #: why this worker: --decision-log, --explain-sample (server/explain.py)
    explain: ExplainConfig = field(default_factory=ExplainConfig)
    #: the endpoint picker's gRPC listen address (--epp; None: no picker) and options (docs/epp.md)
    epp: HostPort | None = None
    epp_fallbacks: int = 2
    epp_max_in_flight: int = 0
    epp_leader_only: bool = False

    def __post_init__(self) -> None:
        names: set[str] = set()
        endpoints: dict[str, str] = {}
        for sub in self.subscribers():
            if sub.name in names:
                raise ConfigError(f"duplicate worker name {sub.name!r}")
            names.add(sub.name)
            for ep in (sub.events, sub.replay):
                other = endpoints.get(ep) if ep is not None else None
                if other is not None and other != sub.name:
                    raise ConfigError(f"workers {other!r} and {sub.name!r} use the same endpoint {ep}")
                if ep is not None:
                    endpoints[ep] = sub.name
        if self.zmq_api is not None:
            parse_endpoint(self.zmq_api, what="zmq_api")
        if self.auth_token is not None and (not self.auth_token or self.auth_token != self.auth_token.strip()):
            raise ConfigError("auth_token must be non-empty and have no surrounding whitespace")
        for name in ("stale_after_s", "replay_timeout_s", "ingest_max_lag_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if type(self.ingest_queue) is not int or self.ingest_queue < 1:
            raise ConfigError(f"ingest_queue must be a positive integer, got {self.ingest_queue!r}")
        for name in ("epp_fallbacks", "epp_max_in_flight"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if self.epp_leader_only and (self.epp is None or self.state is None or "ingest=stream" not in self.state):
            raise ConfigError("epp_leader_only needs --epp and --state redis://...?ingest=stream: the replica "
                              "holding the state backend's lease is the leader (active-active replicas, the "
                              "default, have none)")

    def subscribers(self) -> list[SubscriberSpec]:
        return [sub for spec in self.workers for sub in spec.subscribers()]


# --------------------------------------------------------------------------- value parsers


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{what}: expected a string, got {value!r}")
    return value


def _positive_float(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: expected a number, got {value!r}") from None
    if not out > 0 or out == float("inf"):
        raise ConfigError(f"{what}: must be a positive finite number, got {value!r}")
    return out


def _fraction(value: Any, what: str) -> float:
    """A number in [0, 1] (a rate such as ``--explain-sample``)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a number in [0, 1], got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: expected a number in [0, 1], got {value!r}") from None
    if not 0.0 <= out <= 1.0:  # NaN fails too
        raise ConfigError(f"{what}: must be in [0, 1] (a fraction of decisions), got {value!r}")
    return out


def _int(value: Any, what: str, low: int = 1) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected an integer, got {value!r}")
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: expected an integer, got {value!r}") from None
    if out < low:
        raise ConfigError(f"{what}: must be {'positive' if low == 1 else f'>= {low}'}, got {value!r}")
    return out


def _flag(value: Any, what: str) -> bool:
    """A boolean setting: true/false, 1/0, yes/no (flags pass True)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{what}: expected true or false, got {value!r}")


def _http(value: Any, what: str) -> HostPort | None:
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    return parse_host_port(value, what=what)


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


#: scalar key -> parser(value, "key (source)"); with the two lists/tables, every known key
_SCALARS: dict[str, Callable[[Any, str], Any]] = {
    "http": _http,
    "zmq_api": lambda v, what: parse_endpoint(_text(v, what), what=what),
    "auth_token": _text,
    "auth_token_file": _text,
    "state": lambda v, what: check_state_url(_text(v, what), what),
    "record": lambda v, what: check_output_path(_text(v, what), what),
    "policy": _text,
    "stale_after_s": _positive_float,
    "replay_timeout_s": _positive_float,
    "ingest_max_lag_s": _positive_float,
    "ingest_queue": lambda v, what: _int(v, what, low=1),
    "inflight_timeout_s": _positive_float,
    "max_body_bytes": _int,
    "max_tokens": _int,
    "tokenizer": _text,
    "upstream_timeout_s": _positive_float,
    "upstream_connect_timeout_s": _positive_float,
    "upstream_max_connections": _int,
    "upstream_retries": lambda v, what: _int(v, what, low=0),
    "worker_down_cooldown_s": _positive_float,
    "truth_window": _int,
    "otlp_traces_endpoint": _text,
    "decision_log": lambda v, what: check_output_path(_text(v, what), what),
    "explain_sample": _fraction,
    "decision_log_max_bytes": _int,
    "epp": _http,
    "epp_fallbacks": lambda v, what: _int(v, what, low=0),
    "epp_max_in_flight": lambda v, what: _int(v, what, low=0),
    "epp_leader_only": _flag,
}
assert set(GatewayConfig.setting_names()) <= set(_SCALARS), "every gateway setting needs a parser"
assert set(ExplainConfig.setting_names()) <= set(_SCALARS), "every explain setting needs a parser"
KNOWN_KEYS = (*_SCALARS, "workers", "router")
#: the router table's key in the environment (``TOKENSPEED_ROUTER_ROUTER`` would read as a typo)
_ROUTER_ENV = ENV_PREFIX + "ROUTER_OPTIONS"
#: router knobs with a setting of their own (``--policy``, ``--inflight-timeout-s``)
_OWN_SETTING = ("policy", "inflight_timeout_s")
#: environment variables read by other parts of the CLI, not by ServerConfig
_FOREIGN_ENV = {"LOG_LEVEL", "CONFIG"}


def parse_router_options(items: Any, what: str) -> dict[str, Any]:
    """``["k=v", ...]`` (flags), ``"k=v;k=v"`` (environment) or a ``[router]`` table -> knobs.

    Values from flags and the environment are JSON when they parse (numbers,
    booleans), else text. Keys are ``RouterConfig`` field names as written.
    """
    if isinstance(items, Mapping):
        out = dict(items)
    else:
        if isinstance(items, str):
            items = [p for p in re.split(r"[;\n]", items) if p.strip()]
        out = {}
        for item in items or ():
            key, sep, value = str(item).partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"{what}: {item!r} is not KEY=VALUE")
            try:
                out[key.strip()] = json.loads(value.strip())
            except ValueError:
                out[key.strip()] = value.strip()
    for key in _OWN_SETTING:
        if key in out:
            raise ConfigError(f"{what}: {key} is a setting of its own (--{key.replace('_', '-')}, "
                              f"{ENV_PREFIX}{key.upper()}, top-level {key} in the file)")
    return out


def _right_spelling(key: str) -> str | None:
    """The known key a near-miss means (``zmq-api`` -> ``zmq_api``, ``worker`` -> ``workers``), else None."""
    for guess in (key.replace("-", "_"), key.replace("-", "_") + "s"):
        if guess in KNOWN_KEYS:
            return guess
    return None


def _unknown(keys: set[str], source: str) -> None:
    if keys:
        hints = [f"{k!r} (write {right!r})" if (right := _right_spelling(k)) else repr(k) for k in sorted(keys)]
        raise ConfigError(f"{source}: unknown key(s) {', '.join(hints)} (known: {', '.join(KNOWN_KEYS)})")


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
    _unknown(set(data) - set(KNOWN_KEYS), source)
    workers = data.get("workers")
    if workers is not None and not (isinstance(workers, list) and all(isinstance(w, dict) for w in workers)):
        raise ConfigError(f"{source}: write the worker list as [[workers]] tables (name = ..., events = ...)")
    if "router" in data and not isinstance(data["router"], dict):
        raise ConfigError(f"{source}: router must be a [router] table of RouterConfig knobs")
    return data


def _read_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX) or var[len(ENV_PREFIX):] in _FOREIGN_ENV:
            continue
        key = "router" if var == _ROUTER_ENV else var[len(ENV_PREFIX):].lower()
        if key in KNOWN_KEYS and var != ENV_PREFIX + "ROUTER":
            out[key] = value
        else:
            # Not fatal: other parts of the CLI may own TOKENSPEED_ROUTER_* names.
            right = _right_spelling(key)
            hint = "" if right is None else f" (write {_ROUTER_ENV if right == 'router' else ENV_PREFIX + right.upper()})"
            logger.warning("ignoring unknown environment variable %s%s", var, hint)
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
    layers: list[tuple[str, Mapping[str, Any]]] = [("flag", flags), ("environment", _read_env(env))]
    if config_file is not None:
        layers.append((f"config file {str(config_file)!r}", _read_toml(config_file)))

    def pick(key: str) -> tuple[Any, str, int] | None:
        for rank, (source, layer) in enumerate(layers):
            if key in layer:
                return layer[key], f"{key} ({source})", rank
        return None

    values: dict[str, Any] = {}
    for key, parse in _SCALARS.items():
        if (got := pick(key)) is not None:
            values[key] = (parse(got[0], got[1]), got[2])
    kwargs: dict[str, Any] = {k: v for k, (v, _) in values.items() if k in ("http", "zmq_api", "state", "record")}
    if (got := pick("workers")) is not None:
        kwargs["workers"] = parse_workers(got[0], got[1])
    token, token_file = values.get("auth_token"), values.get("auth_token_file")
    if token is not None and (token_file is None or token[1] <= token_file[1]):
        kwargs["auth_token"] = token[0] or None
    elif token_file is not None:
        try:
            kwargs["auth_token"] = Path(token_file[0]).read_text().strip() or None
        except OSError as err:
            raise ConfigError(f"auth_token_file: {err}") from err
    for key in ("stale_after_s", "replay_timeout_s", "ingest_max_lag_s", "ingest_queue", "epp", "epp_fallbacks",
                "epp_max_in_flight", "epp_leader_only"):
        if key in values:
            kwargs[key] = values[key][0]
    limits = {k: values[k][0] for k in ("max_body_bytes", "max_tokens") if k in values}
    if limits:
        kwargs["limits"] = ApiLimits(**limits)
    kwargs["gateway"] = GatewayConfig(**{k: values[k][0] for k in GatewayConfig.setting_names() if k in values})
    kwargs["explain"] = ExplainConfig(**{k: values[k][0] for k in ExplainConfig.setting_names() if k in values})
    # Router knobs merge knob by knob (unlike workers): a flag overriding one
    # knob should not reset the others set in the file.
    knobs: dict[str, Any] = {}
    for source, layer in reversed(layers):
        if "router" in layer:
            knobs.update(parse_router_options(layer["router"], f"router ({source})"))
    knobs.update({k: values[k][0] for k in _OWN_SETTING if k in values})
    kwargs["router"] = router_config(knobs)
    return ServerConfig(**kwargs)


def router_config(knobs: Mapping[str, Any]) -> RouterConfig:
    """Build the :class:`RouterConfig`; unknown knobs are a :class:`ConfigError` naming the known ones."""
    try:
        return RouterConfig(**knobs)
    except TypeError as err:
        known = ", ".join(f.name for f in dataclasses.fields(RouterConfig))
        raise ConfigError(f"router options {dict(knobs)!r}: {err} (known: {known})") from err
