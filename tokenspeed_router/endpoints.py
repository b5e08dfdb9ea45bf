"""ZeroMQ endpoints and TCP listen addresses: parsing, checks, listen sockets, free ports.

One job: turn what an operator wrote (``tcp://host:port``, ``HOST:PORT``) into
validated values, with a :class:`ConfigError` naming the setting when it is
wrong, so that a typo stops ``serve`` at start instead of surfacing later
inside ZeroMQ; and open the listen sockets those addresses name. The router,
the gateway, the relay and the engine simulator all listen, so this module
sits below all of them.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.events.frames import offset_endpoint_port

__all__ = [
    "HostPort",
    "bind_socket",
    "endpoint_with_port_offset",
    "free_tcp_port",
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


def bind_socket(address: HostPort, *, reuse_port: bool = False) -> socket.socket:
    """Bind the listen socket ourselves so ``--http 127.0.0.1:0`` can report its port.

    ``reuse_port``: SO_REUSEPORT, so several processes listen on one port and
    the kernel spreads connections over them (``serve --processes N``).
    """
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    # proto must be IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on accepted
    # sockets whose proto says TCP, and without it Nagle + delayed ACKs add 40 ms to
    # every response uvicorn writes in two parts (head, body).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((address.host, address.port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"cannot listen on {address}: {err}") from err
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def free_tcp_port(*, consecutive: int = 1, avoid: tuple[int, ...] = (), host: str = "127.0.0.1") -> int:
    """An OS-chosen port P on ``host`` with P .. P+consecutive-1 free right now.

    For processes that must be told a port number up front (an ``engine-sim``
    fleet, a ``serve --zmq-events`` worker list, tests and benchmarks);
    ``consecutive=2`` serves a ``dp_ranks=2`` worker whose rank r listens on
    base port + r. Ports within one of ``avoid`` are skipped (ports already
    handed out but not yet bound). The ports are free when checked; another
    process may take one before it is bound, which is why servers that can
    bind port 0 themselves (``serve --http 127.0.0.1:0``) should.
    """
    if consecutive < 1:
        raise ValueError(f"consecutive must be at least 1, got {consecutive}")
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        if port + consecutive - 1 > 65535 or any(abs(port - a) < consecutive for a in avoid):
            continue
        if consecutive == 1:
            return port
        held: list[socket.socket] = []
        try:
            for p in range(port, port + consecutive):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.bind((host, p))
            return port
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {consecutive} consecutive free ports found on {host}")
