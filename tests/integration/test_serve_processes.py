"""``serve --processes N``: N real gateway processes on one port, sharing through a private Redis.

Connections land on either process (SO_REUSEPORT); a route made through one
is seen as a peer's in-flight work by the other; SIGTERM stops every child
cleanly (exit 0) and the private redis-server with them; a SIGKILLed
supervisor takes its children along (no orphan keeps serving the port).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import REPO_ROOT, wait_until

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.events.publisher import ZmqEventPublisher

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Supervisor:
    def __init__(self, tmp_path: Path, publishers: list[ZmqEventPublisher]) -> None:
        self.port = free_tcp_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENSPEED_ROUTER_")}
        self.stderr = open(tmp_path / "supervisor.stderr", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "INFO", "serve",
             "--processes", "2", "--http", f"127.0.0.1:{self.port}",
             *[a for i, p in enumerate(publishers)
               for a in ("--worker", f"name=w{i},events={p.endpoint},replay={p.replay_endpoint}")]],
            cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=self.stderr,
        )

    def replica_of(self, client: httpx.Client) -> str | None:
        try:
            return str(client.get("/health").json()["state"]["replica_id"])
        except httpx.HTTPError:
            return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


@pytest.fixture
def publishers() -> Iterator[list[ZmqEventPublisher]]:
    pubs = [ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") for _ in range(2)]
    yield pubs
    for pub in pubs:
        pub.close()


def _two_clients(sup: Supervisor) -> dict[str, httpx.Client]:
    """One keep-alive client per child process (new connections until both were hit)."""
    clients: dict[str, httpx.Client] = {}

    def both() -> bool:
        if sup.proc.poll() is not None:
            raise AssertionError(f"supervisor exited with {sup.proc.returncode}")
        client = httpx.Client(base_url=sup.url, timeout=5.0)
        replica = sup.replica_of(client)
        if replica is None or replica in clients:
            client.close()
        else:
            clients[replica] = client
        return len(clients) == 2

    wait_until(both, 60, interval_s=0.05, what="connections to reach both processes")
    return clients


def test_processes_share_one_port_and_stop_together(tmp_path: Path, publishers: list[ZmqEventPublisher]) -> None:
    sup = Supervisor(tmp_path, publishers)
    clients: dict[str, httpx.Client] = {}
    try:
        clients = _two_clients(sup)
        (ra, ca), (rb, cb) = clients.items()
        assert ra != rb
        prompt = list(range(4096))
        first = ca.post("/route", json={"token_ids": prompt, "request_id": "x0"}).json()["worker"]
        wait_until(lambda: sum(w["in_flight_peers"] for w in cb.get("/workers").json().values()) == 1,
                   15, interval_s=0.02, what="the other process to see the route")
        # the same decision as one router: the second request avoids the loaded worker
        second = cb.post("/route", json={"token_ids": list(range(10_000, 14_096)),
                                         "request_id": "x1"}).json()["worker"]
        assert {first, second} == {"w0", "w1"}
        kids = _children(sup.proc.pid)
        assert len(kids) == 3  # two serve processes and the private redis-server
        sup.proc.send_signal(signal.SIGTERM)
        assert sup.proc.wait(60) == 0
        assert not any(_alive(k) for k in kids)
    finally:
        for c in clients.values():
            c.close()
        sup.close()


def test_children_die_with_a_killed_supervisor(tmp_path: Path, publishers: list[ZmqEventPublisher]) -> None:
    sup = Supervisor(tmp_path, publishers)
    clients: dict[str, httpx.Client] = {}
    try:
        clients = _two_clients(sup)
        kids = _children(sup.proc.pid)
        assert len(kids) == 3
        sup.proc.kill()
        sup.proc.wait()
        wait_until(lambda: not any(_alive(k) for k in kids), 20, interval_s=0.05,
                   what="the children to die with their supervisor")
    finally:
        for c in clients.values():
            c.close()
        sup.close()
