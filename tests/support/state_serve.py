"""``serve --state redis://...`` as real subprocesses, for the state tests (not a test module).

Every wait polls with a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import httpx

from support import REPO_ROOT, wait_until
from support.state_harness import Workers, queries
from tokenspeed_router.endpoints import free_tcp_port


class Serve:
    """One ``tokenspeed-router serve --state`` process."""

    def __init__(self, name: str, state_url: str, workers: Workers, ingest: str = "stream",
                 options: str = "", extra_args: tuple[str, ...] = (), worker_url: str | None = None) -> None:
        self.name = name
        self.port = free_tcp_port()
        args = [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "WARNING", "serve",
                "--http", f"127.0.0.1:{self.port}",
                "--state", f"{state_url}?lease_ttl_s=1.5&read_block_ms=50&replica_id={name}"
                           f"&ingest={ingest}{options}"]
        for n, ep, rp in workers.endpoints():
            args += ["--worker", f"name={n},events={ep},replay={rp}" + (f",url={worker_url}" if worker_url else "")]
        args += list(extra_args)
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

    def route(self, token_ids: list[int], request_id: str) -> dict[str, Any]:
        resp = self.http.post("/route", json={"token_ids": token_ids, "request_id": request_id})
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    def release(self, request_id: str) -> None:
        assert self.http.post("/release", json={"request_id": request_id}).status_code == 200

    def workers(self) -> dict[str, Any]:
        return dict(self.http.get("/workers").json())

    def peers_in_flight(self) -> int:
        """Requests the other replicas have in flight, as this one sees them."""
        return sum(w["in_flight_peers"] for w in self.http.get("/workers").json().values())

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


def one_leader(*procs: Serve) -> Serve | None:
    leaders = [p for p in procs if p.state()["role"] == "leader"]
    return leaders[0] if len(leaders) == 1 else None


def wait_seqs(workers: Workers, *parties: Any) -> None:
    def done() -> bool:
        for p in parties:
            seqs = p.seqs() if isinstance(p, Serve) else p.last_seqs()
            if any(seqs.get(w) != s for w, s in workers.last_seq.items()):
                return False
        return True

    wait_until(done, 30, interval_s=0.05, what=f"seqs {workers.last_seq}")


def handshake(workers: Workers, *parties: Any) -> None:
    def seen() -> bool:
        for n in workers.names:
            workers.last_seq[n] = workers.publishers[n].publish_events([])
        for p in parties:
            seqs = p.seqs() if isinstance(p, Serve) else p.last_seqs()
            if any(seqs.get(n) is None for n in workers.names):
                return False
        return True

    wait_until(seen, 20, interval_s=0.1, what="every router to see the probes")
    wait_seqs(workers, *parties)
