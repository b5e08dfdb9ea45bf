"""``serve --processes N``: N gateway processes on one port, one machine's cores all used.

One ``serve`` process is one Python core (the GIL). The supervisor here
starts N ordinary ``serve`` children that each bind the same HTTP port with
``SO_REUSEPORT`` (``--reuse-port``): the kernel spreads incoming connections
over them. Each child is a replica in the sense of docs/replicas.md: it
subscribes to every engine itself (``ingest=direct``) and shares its
in-flight work and route predictions through Redis, so the N processes
decide as one router. Without ``--state`` the supervisor starts a private
``redis-server`` on a unix socket in a temporary directory (no TCP port, no
persistence) and gives its URL to the children; with ``--state`` they use
that Redis, and the supervisor's children are replicas of the wider cluster.

Life cycle: children die with the supervisor (``PR_SET_PDEATHSIG`` on Linux:
even a SIGKILLed supervisor leaves no orphan serving the port); SIGTERM or
SIGINT is forwarded to every child, their clean exits awaited, then the
private Redis stopped. A child that dies on its own is started again (at
most once per ``_RESTART_MIN_S`` per slot), as a process manager would.

Why Redis and not shared memory between the processes: the same mechanism as
replicas on different hosts (one code path, one set of tests), Pub/Sub
delivers on a unix socket in well under a millisecond, and the work shared
is small (per-worker totals and prefix hashes per route). Measured figures:
docs/benchmarks.md.
"""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

from tokenspeed_router.endpoints import HostPort
from tokenspeed_router.errors import ConfigError
from tokenspeed_router.process import shutdown_signals
from tokenspeed_router.state.config import join_url

__all__ = ["ProcessSupervisor", "child_argv", "replica_state_url"]

logger = logging.getLogger(__name__)

#: A slot whose child died is restarted at most this often...
_RESTART_MIN_S = 1.0
#: ...and a child that dies within this long of its start counts as failing to start:
#: after _MAX_FAST_FAILURES of those in a row (any slot) the supervisor gives up.
_FAST_FAILURE_S = 10.0
_MAX_FAST_FAILURES = 3
#: How long children get to exit cleanly after SIGTERM before SIGKILL.
_STOP_GRACE_S = 20.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the supervisor dies (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def child_argv(argv: Sequence[str], http: HostPort, state_url: str) -> list[str]:
    """The command line of one child: the supervisor's own, minus ``--processes``,
    plus ``--reuse-port``, the resolved HTTP address and the state URL (argparse
    keeps the last occurrence of a flag, so these win)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--processes":
            skip = True
            continue
        if arg.startswith("--processes="):
            continue
        out.append(arg)
    return [sys.executable, "-m", "tokenspeed_router.cli", *out,
            "--reuse-port", "--http", str(http), "--state", state_url]


def replica_state_url(url: str, index: int) -> str:
    """``url`` for child ``index``: an explicit ``replica_id`` gets ``.p<index>`` (ids must differ)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if not any(k == "replica_id" for k, _ in query):
        return url
    query = [(k, f"{v}.p{index}" if k == "replica_id" else v) for k, v in query]
    return join_url(parts.scheme, parts.netloc, parts.path, urlencode(query), parts.fragment)


class PrivateRedis:
    """A ``redis-server`` on a unix socket only, in a temporary directory, owned by the supervisor."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ConfigError("serve --processes without --state starts a private redis-server, "
                              "which is not on PATH: install it, or give --state redis://...")
        self._dir = Path(tempfile.mkdtemp(prefix="tsr-redis-"))
        self.socket_path = self._dir / "redis.sock"
        self.proc = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", str(self._dir), "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent,
        )

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        """Until the socket answers PING (polled with a deadline)."""
        deadline = time.monotonic() + timeout_s
        pause = threading.Event()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError(f"the private redis-server exited with {self.proc.returncode}")
            if self.socket_path.exists() and _ping(self.socket_path):
                return
            pause.wait(0.01)
        raise ConfigError(f"the private redis-server did not answer within {timeout_s}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def _ping(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(str(path))
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def reserve_port(address: HostPort) -> tuple[socket.socket, HostPort]:
    """Bind (not listen) ``address`` with SO_REUSEPORT: resolves port 0 and holds the port
    for the children, who bind it the same way; connections go only to listening sockets."""
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((address.host, address.port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"cannot listen on {address}: {err}") from err
    return sock, HostPort(address.host, sock.getsockname()[1])


class ProcessSupervisor:
    """Runs N ``serve`` children on one port (see the module docstring)."""

    def __init__(self, argv: Sequence[str], processes: int, http: HostPort, state: str | None) -> None:
        if processes < 1:
            raise ConfigError(f"--processes must be at least 1, got {processes}")
        if not hasattr(socket, "SO_REUSEPORT"):
            raise ConfigError("serve --processes needs SO_REUSEPORT (Linux, BSD, macOS)")
        self._argv = list(argv)
        self._processes = processes
        self._http = http
        self._state = state
        self._stop = threading.Event()
        self._children: list[subprocess.Popen[bytes] | None] = [None] * processes
        self._started_at = [0.0] * processes
        self.restarts = 0
        self._fast_failures = 0
        self._gave_up = False

    def run(self) -> int:
        """Start everything, supervise until SIGTERM/SIGINT, stop everything; the exit code."""
        held, http = reserve_port(self._http)
        redis: PrivateRedis | None = None
        try:
            state = self._state
            if state is None:
                redis = PrivateRedis()
                redis.wait_ready()
                state = redis.url
            with shutdown_signals(self._stop.set):
                for i in range(self._processes):
                    self._start(i, http, state)
                logger.info("serve: %d processes on http://%s sharing through %s",
                            self._processes, http, "a private redis-server" if redis else "--state")
                self._supervise(http, state)
        finally:
            code = self._stop_children()
            if redis is not None:
                redis.stop()
            held.close()
        return code

    def _start(self, i: int, http: HostPort, state: str) -> None:
        argv = child_argv(self._argv, http, replica_state_url(state, i))
        self._children[i] = subprocess.Popen(argv, preexec_fn=_die_with_parent)
        self._started_at[i] = time.monotonic()

    def _supervise(self, http: HostPort, state: str) -> None:
        while not self._stop.wait(0.2):
            for i, child in enumerate(self._children):
                if child is None or child.poll() is None:
                    continue
                lived = time.monotonic() - self._started_at[i]
                if lived < _RESTART_MIN_S:
                    continue
                self._fast_failures = self._fast_failures + 1 if lived < _FAST_FAILURE_S else 0
                if self._fast_failures >= _MAX_FAST_FAILURES:
                    logger.error("serve: process %d (pid %d) exited with %s, %d children in a row died "
                                 "within %.0fs of starting: giving up", i, child.pid, child.returncode,
                                 self._fast_failures, _FAST_FAILURE_S)
                    self._gave_up = True
                    return
                logger.error("serve: process %d (pid %d) exited with %s; starting it again",
                             i, child.pid, child.returncode)
                self.restarts += 1
                self._start(i, http, state)

    def _stop_children(self) -> int:
        live = [c for c in self._children if c is not None]
        for child in live:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        code = 0
        for child in live:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("serve: process pid %d did not stop in %.0fs; killing it", child.pid, _STOP_GRACE_S)
                child.kill()
                child.wait()
            if child.returncode not in (0, -signal.SIGTERM):
                code = max(code, 1)
        return 1 if self._gave_up else code


def supervise_from_args(argv: Sequence[str], processes: int, http: HostPort | None, state: str | None) -> int:
    """``serve --processes N`` entry point (cli_serve): checks, then :class:`ProcessSupervisor`."""
    if http is None:
        raise ConfigError("serve --processes needs an HTTP listener (--http HOST:PORT)")
    return ProcessSupervisor(argv, processes, http, state).run()
