"""Real processes for the reliability benchmarks (``faults.py``, ``soak.py``).

Not a benchmark itself: a ``serve`` subprocess with an HTTP client, a
``redis-server`` subprocess, resident-memory and process-tree CPU sampling
from ``/proc``, and a deadline poll. Every wait polls with a deadline; nothing here sleeps blindly.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.loadgen.fleet import stop_process

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def data_dir(kind: str) -> Path:
    """Where ``captures`` or ``traces`` live: $TOKENSPEED_SHARED, the nearest ``shared/``
    above the checkout (full traces), else the copies in ``tests/data`` (trace heads)."""
    env = os.environ.get("TOKENSPEED_SHARED")
    candidates = [Path(env)] if env else [*(p / "shared" for p in REPO.parents), REPO / "tests" / "data"]
    for path in candidates:
        if (path / kind).is_dir():
            return path / kind
    raise SystemExit(f"no {kind}/ found (tests/data or shared/): set TOKENSPEED_SHARED")


def wait_for(pred: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.01) -> T:
    """Poll ``pred`` until truthy; raise TimeoutError naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        pause.wait(interval_s)


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS from /proc), 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its live descendants, from ``/proc``.

    A process tree, because a router may run workers as children (``serve
    --processes``, granian); children that already exited and were reaped
    count in their parent's ``cutime``/``cstime``, which this does not read,
    so sample while the tree is up. 0 once ``pid`` is gone. The one reader
    of its kind (``bench_http_stack.py``, ``compare_routers.py``).
    """
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(cpu.get(p, 0.0) for p in tree)


class Serve:
    """``tokenspeed-router serve`` as a subprocess, with an HTTP client on its API."""

    def __init__(self, args: list[str], *, log_dir: Path, port: int | None = None,
                 log_level: str = "WARNING", env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = env or {}
        self.port = port if port is not None else free_tcp_port()
        self.log_dir = log_dir
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=self.url, timeout=10.0)
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 60.0) -> Serve:
        self.starts += 1
        log = open(self.log_dir / f"serve-{self.port}-{self.starts}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", self.log_level, "serve",
             *self.args, "--http", f"127.0.0.1:{self.port}"],
            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            stdout=subprocess.DEVNULL, stderr=log,
        )
        log.close()

        def healthy() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited early rc={self.proc.returncode}: {self.log_tail()}")
            try:
                return self.http.get("/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout_s, "serve to answer /health", interval_s=0.05)
        return self

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return (self.log_dir / f"serve-{self.port}-{self.starts}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def get(self, path: str) -> Any:
        resp = self.http.get(path)
        resp.raise_for_status()
        return resp.json()

    def post(self, path: str, body: Any) -> Any:
        resp = self.http.post(path, json=body)
        resp.raise_for_status()
        return resp.json()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs (the crash case)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM and wait; the exit code (None if it was never started)."""
        if self.proc is None:
            return None
        return stop_process(self.proc, timeout_s)

    def close(self) -> None:
        self.stop()
        self.http.close()


class RedisServer:
    """A throw-away ``redis-server`` on a free loopback port (no persistence)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found on PATH (apt-get install redis-server)")
        self.binary = binary
        self.port = free_tcp_port()
        self._dir = tempfile.TemporaryDirectory()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port)

        def ping() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_for(ping, 15, "redis-server to answer PING", interval_s=0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()
