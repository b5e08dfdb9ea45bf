"""Session fixtures: a real redis-server on a free loopback port, shared paths."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from support import captures_dir, traces_dir, wait_until
from support.zmq_context import end_context

from tokenspeed_router.endpoints import free_tcp_port


@pytest.fixture(scope="session")
def captures() -> Path:
    return captures_dir()


@pytest.fixture(scope="session")
def traces() -> Path:
    return traces_dir()


class RedisServer:
    """A real redis-server process owned by the test session."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server not found on PATH: install it (Debian: apt-get install redis-server); "
                "Redis tests are never skipped"
            )
        self.binary = binary
        self.workdir = workdir
        self.port = free_tcp_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis.from_url(self.url)

        def ping() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_until(ping, timeout_s=15, what="redis-server to answer PING")
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of the session redis-server, flushed before each test."""
    import redis

    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A ZeroMQ context per test, destroyed with linger 0 so no test waits on another's sockets.

    (The Redis state tests override it with a strict one, to catch leaked sockets.)
    """
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    end_context(context, strict=False)
