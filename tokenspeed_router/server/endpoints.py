"""ZeroMQ endpoints and TCP listen addresses: parsing and the checks made at start.

One job: turn what an operator wrote (``tcp://host:port``, ``HOST:PORT``) into
validated values, with a :class:`ConfigError` naming the setting when it is
wrong, so that a typo stops ``serve`` at start instead of surfacing later
inside ZeroMQ.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.events.frames import offset_endpoint_port

__all__ = [
    "HostPort",
    "endpoint_with_port_offset",
    "is_loopback_host",
    "parse_endpoint",
    "parse_host_port",
]

_TCP_RE = re.compile(r"^tcp://(?P<host>\[[^\]\s]+\]|[^:/\[\]\s]+):(?P<port>\d+|\*)$")


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
    """``tcp://h:5557`` + 2 -> ``tcp://h:5559`` (the engines' DP-rank rule, ``events.frames``).

    Endpoints the rule cannot offset (``ipc://``, a port past 65535) are a
    :class:`ConfigError` here: a worker spec is configuration.
    """
    try:
        out = offset_endpoint_port(endpoint, offset)
    except ValueError as err:
        raise ConfigError(
            f"endpoint {endpoint!r}, data-parallel rank {offset}: {err} (ranks need tcp://HOST:PORT, port + rank)"
        ) from None
    assert out is not None
    return out


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
