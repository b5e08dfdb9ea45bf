"""``serve --state redis://...`` end to end: real processes, real publishers, SIGKILL.

Two router processes share one redis-server; only the lease holder subscribes
to the workers. Their ``/match`` answers must agree, and after the leader is
SIGKILLed the survivor takes over and agrees with a router that saw everything.
A third process started later comes up warm from the snapshot + stream.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq
from support import REPO_ROOT, wait_until
from support.proc_cpu import cpu_share
from support.state_harness import Reference, Workers, queries

from tokenspeed_router.endpoints import free_tcp_port

pytestmark = [pytest.mark.redis, pytest.mark.slow]

WORKERS = ["w0", "w1"]


class Serve:
    """One ``tokenspeed-router serve --state`` process."""

    def __init__(self, name: str, state_url: str, workers: Workers, ingest: str = "stream") -> None:
        self.name = name
        self.port = free_tcp_port()
        args = [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "WARNING", "serve",
                "--http", f"127.0.0.1:{self.port}",
                "--state", f"{state_url}?lease_ttl_s=1.5&read_block_ms=50&replica_id={name}"
                           f"&ingest={ingest}"]
        for n, ep, rp in workers.endpoints():
            args += ["--worker", f"name={n},events={ep},replay={rp}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENSPEED_ROUTER_")}
        self.proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=5.0)
        wait_until(self._up, 30, interval_s=0.05, what=f"{name} to serve /health")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}: {err[-2000:]}")
        try:
            return self.http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def state(self) -> dict[str, Any]:
        return dict(self.http.get("/health").json()["state"])

    def seqs(self) -> dict[str, int | None]:
        workers = self.http.get("/workers").json()
        return {w: workers[w]["last_seq"] for w in workers}

    def answers(self) -> list[dict[str, int]]:
        return [self.http.post("/match", json={"token_ids": q}).json()["scores"] for q in queries()]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.http.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.http.close()
        if self.proc.stderr:
            self.proc.stderr.close()


@pytest.fixture
def setup(redis_url: str) -> Iterator[tuple[Workers, Reference, Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    workers = Workers(WORKERS, ctx)
    reference = Reference(workers.endpoints(), ctx)
    made: list[Serve] = []

    def serve(name: str, ingest: str = "stream") -> Serve:
        s = Serve(name, redis_url, workers, ingest)
        made.append(s)
        return s

    yield workers, reference, serve
    for s in made:
        s.stop()
    reference.close()
    workers.close()
    ctx.term()


def _one_leader(*procs: Serve) -> Serve | None:
    leaders = [p for p in procs if p.state()["role"] == "leader"]
    return leaders[0] if len(leaders) == 1 else None


def _wait_seqs(workers: Workers, *parties: Any) -> None:
    def done() -> bool:
        for p in parties:
            seqs = p.seqs() if isinstance(p, Serve) else p.last_seqs()
            if any(seqs.get(w) != s for w, s in workers.last_seq.items()):
                return False
        return True

    wait_until(done, 30, interval_s=0.05, what=f"seqs {workers.last_seq}")


def _handshake(workers: Workers, *parties: Any) -> None:
    def seen() -> bool:
        for n in workers.names:
            workers.last_seq[n] = workers.publishers[n].publish_events([])
        for p in parties:
            seqs = p.seqs() if isinstance(p, Serve) else p.last_seqs()
            if any(seqs.get(n) is None for n in workers.names):
                return False
        return True

    wait_until(seen, 20, interval_s=0.1, what="every router to see the probes")
    _wait_seqs(workers, *parties)


def test_serve_replicas_agree_survive_sigkill_and_warm_restart(setup: Any) -> None:
    workers, reference, serve = setup
    a = serve("ra")
    b = serve("rb")
    leader = wait_until(lambda: _one_leader(a, b), 20, interval_s=0.05, what="one leader")
    assert leader is not None
    other = b if leader is a else a
    _handshake(workers, a, b, reference)
    workers.publish(30)
    _wait_seqs(workers, a, b, reference)
    expected = reference.answers()
    assert a.answers() == expected and b.answers() == expected
    state = other.state()
    assert state["role"] == "follower" and not state["degraded"]
    assert state["stream_lag_entries"] == 0

    leader.kill()
    workers.publish(10)
    wait_until(lambda: other.state()["role"] == "leader", 20, interval_s=0.05,
               what="the survivor to take the lease")
    workers.publish(10)
    _wait_seqs(workers, other, reference)
    assert other.answers() == reference.answers()

    c = serve("rc")  # a restarted replica: snapshot (if any) + stream, timed
    _wait_seqs(workers, c)
    warm = c.state()["warm_start"]
    assert warm is not None and warm["source"] in ("snapshot", "stream")
    print(f"serve replica warm in {warm['total_s'] * 1000:.1f} ms from {warm['source']}")
    assert c.answers() == reference.answers()
    metrics = c.http.get("/metrics").text
    assert "tokenspeed_state_role" in metrics and "tokenspeed_state_entries_applied" in metrics


def test_idle_replicas_do_not_spin(setup: Any) -> None:
    """A follower holds no event socket: its ingestion loop must block, not poll nothing.

    It used to spin (77-97% of a core, idle or loaded) because a zmq poll over
    no sockets returns at once. Measured from /proc over a 2 s window: an idle
    replica uses a few percent of a core; the bound leaves room for a loaded
    machine. Both ingestion modes: ``stream`` (leader + follower) and ``direct``.
    """
    workers, _reference, serve = setup
    a = serve("ra")
    b = serve("rb")
    leader = wait_until(lambda: _one_leader(a, b), 20, interval_s=0.05, what="one leader")
    assert leader is not None
    follower = b if leader is a else a
    c = serve("rc", ingest="direct")
    _handshake(workers, a, b, c)
    assert follower.state()["role"] == "follower"
    assert c.state()["ingest"] == "direct"
    shares = {p.name: cpu_share(p.proc.pid, 2.0) for p in (follower, leader, c)}
    print(f"idle CPU share (cores): {shares}")
    assert all(share < 0.2 for share in shares.values()), shares
