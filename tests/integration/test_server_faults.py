"""Faults against a real `serve` process: crash + restart, dropped frames, unhealable gaps.

One router process follows three workers:

* ``crash``  — a publisher *process* that is SIGKILLed and started again on the
  same endpoints (its seq restarts at 0): old blocks gone, new ones present,
  ``stale`` while its endpoint is gone;
* ``lossy``  — frames pass a proxy that drops some; the replay ROUTER heals;
* ``holes``  — no replay endpoint, frames dropped: ``resyncing``, and never a
  positive match for blocks it may no longer hold.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support import REPO_ROOT, wait_until
from support.server import BLOCK, DropProxy, ServeProcess, batch, removed, stored, tokens

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.events.publisher import ZmqEventPublisher


class PublisherProcess:
    """tests/support/server_publisher.py in a subprocess, one command at a time."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "support.server_publisher", "--endpoint", endpoint,
             "--replay", replay],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT / "tests",
        )
        assert self._line().startswith("ready")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the child answers promptly or dies (then EOF)
        assert line, f"publisher exited rc={self.proc.poll()}"
        return line.strip()

    def send(self, command: str) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = self._line()
        assert reply.startswith("ok "), reply
        return int(reply.split()[1])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def _score(router: ServeProcess, worker: str, token_ids: list[int]) -> int:
    return int(router.post("/match", {"token_ids": token_ids})["scores"].get(worker, 0))


def _warm_up(pub: ZmqEventPublisher, proxy: DropProxy) -> int:
    """Publish one-block batches until the proxy forwards one (PUB->SUB slow joiner); return next seq."""
    seq = -1

    def through() -> bool:
        nonlocal seq
        seq = pub.publish(batch(stored(tokens(900 + seq + 1, 1))))
        pub.wait_sent(5)
        return wait_ok(lambda: seq in proxy.forwarded, 0.1)

    wait_until(through, 15, interval_s=0.0, what="the proxy to forward a batch")
    return seq + 1


def wait_ok(pred: Callable[[], bool], timeout_s: float) -> bool:
    try:
        wait_until(pred, timeout_s)
        return True
    except AssertionError:
        return False


def test_crash_restart_drops_and_resync(tmp_path: Path) -> None:
    crash_ev = f"tcp://127.0.0.1:{free_tcp_port()}"
    crash_rp = f"tcp://127.0.0.1:{free_tcp_port()}"
    lossy = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    holes = ZmqEventPublisher("tcp://127.0.0.1:*")
    lossy_proxy = DropProxy(lossy.endpoint, set())
    holes_proxy = DropProxy(holes.endpoint, set())
    crash = PublisherProcess(crash_ev, crash_rp)
    closers: list[Callable[[], None]] = []
    args = [
        "--worker", f"name=crash,events={crash_ev},replay={crash_rp}",
        "--worker", f"name=lossy,events={lossy_proxy.endpoint},replay={lossy.replay_endpoint}",
        "--worker", f"name=holes,events={holes_proxy.endpoint}",
        "--stale-after-s", "0.5", "--replay-timeout-s", "1",
    ]
    try:
        with ServeProcess(args, tmp_path).start() as router:
            workers: Callable[[], dict[str, Any]] = router.workers
            # ---- crash: chain A, SIGKILL, stale, restart with chain B -------------------
            a, b = tokens(1, 4), tokens(2, 3)
            wait_until(lambda: workers()["crash"]["connected"], 10, what="crash connected")
            crash.send("store 1 2")
            crash.send("extend 1 2 2")
            wait_until(lambda: _score(router, "crash", a) == 4, 10, what="chain A visible")
            crash.kill()
            wait_until(lambda: workers()["crash"]["state"] == "stale", 10, what="crash stale")
            route = router.post("/route", {"token_ids": a})
            assert route["scores"].get("crash", 0) == 0  # stale scores as cold
            crash = PublisherProcess(crash_ev, crash_rp)
            wait_until(lambda: workers()["crash"]["connected"], 10, what="crash reconnected")
            crash.send("store 2 3")
            wait_until(lambda: _score(router, "crash", b) == 3, 10, what="chain B visible after restart")
            assert _score(router, "crash", a) == 0  # the crashed incarnation's blocks are gone
            w = workers()["crash"]
            assert w["restarts"] >= 1 and w["state"] == "live" and w["blocks"] == 3

            # ---- lossy: drop two frames (one holds a removal), replay heals --------------
            lossy_proxy.subscribed.wait(10)
            nxt = _warm_up(lossy, lossy_proxy)
            lossy_proxy.drop_seqs.update({nxt + 1, nxt + 2})
            c, d = tokens(3, 4), tokens(4, 2)
            lossy.publish(batch(stored(c)))  # nxt
            lossy.publish(batch(removed(c, 2, 2)))  # nxt+1 dropped
            lossy.publish(batch(stored(d)))  # nxt+2 dropped
            last = lossy.publish(batch(stored(tokens(5, 1))))  # nxt+3: reveals the gap
            lossy.wait_sent(5)
            wait_until(lambda: workers()["lossy"]["last_seq"] == last, 10, what="lossy caught up")
            assert sorted(lossy_proxy.dropped) == [nxt + 1, nxt + 2]
            assert _score(router, "lossy", c) == 2 and _score(router, "lossy", d) == 2
            w = workers()["lossy"]
            assert w["state"] == "live" and w["replayed_batches"] >= 2 and w["resyncs"] == 0
            wait_until(lambda: workers()["lossy"]["gaps"] >= 1, 5, what="gap counted")

            # ---- holes: no replay, a dropped removal -> resyncing, no wrong positives ----
            holes_proxy.subscribed.wait(10)
            nxt = _warm_up(holes, holes_proxy)
            holes_proxy.drop_seqs.add(nxt + 1)
            e = tokens(6, 4)
            holes.publish(batch(stored(e)))  # nxt
            wait_until(lambda: _score(router, "holes", e) == 4, 10, what="chain E visible")
            holes.publish(batch(removed(e, 1, 3)))  # nxt+1 dropped: the worker no longer holds E[1:]
            holes.publish(batch(stored(tokens(7, 2)[:BLOCK], parent_tokens=e[:4 * BLOCK])))  # child of a lost block
            last = holes.publish(batch(stored(tokens(8, 1))))
            holes.wait_sent(5)
            wait_until(lambda: workers()["holes"]["last_seq"] == last, 10, what="holes caught up")
            w = workers()["holes"]
            assert w["state"] == "resyncing" and w["resyncs"] == 1, w
            # its entries were dropped: never a claim on the removed blocks (nor their lost child)
            assert _score(router, "holes", e) == 0
            assert _score(router, "holes", e + tokens(7, 1)) == 0
            route = router.post("/route", {"token_ids": tokens(8, 1)})
            assert route["scores"].get("holes", 0) == 0  # resyncing scores as cold
            metrics = router.http.get("/metrics").text
            assert 'tokenspeed_ingest_resyncs_total{worker="holes"} 1.0' in metrics
            assert 'tokenspeed_worker_state{state="resyncing",worker="holes"} 1.0' in metrics
            assert 'tokenspeed_ingest_restarts_total{worker="crash"}' in metrics
            assert 'tokenspeed_ingest_gaps_total{worker="lossy"}' in metrics
            assert "tokenspeed_ingest_visible_delay_seconds_bucket" in metrics
            assert router.alive()

            # ---- a worker added and removed at run time --------------------------------
            late = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
            closers.append(late.close)
            resp = router.http.put("/workers/late", json={"events": late.endpoint,
                                                          "replay": late.replay_endpoint, "role": "decode"})
            assert resp.status_code == 201, resp.text
            f = tokens(9, 3)
            late.publish(batch(stored(f)))
            late.wait_sent(5)

            def visible_or_nudge() -> bool:
                # Published before the new SUB may have joined: the subscriber replays from 0
                # as soon as a later batch reveals the gap, so publish a filler while waiting.
                if _score(router, "late", f) == 3:
                    return True
                late.publish(batch(stored(tokens(10, 1))))
                return False

            wait_until(visible_or_nudge, 10, interval_s=0.05, what="run-time worker's blocks visible")
            assert workers()["late"]["role"] == "decode"
            assert router.http.delete("/workers/late").json() == {"removed": ["late"]}
            assert "late" not in workers() and _score(router, "late", f) == 0
            assert router.stop() == 0
    finally:
        crash.kill()
        for closer in (lossy_proxy.close, holes_proxy.close, lossy.close, holes.close, *closers):
            closer()



def test_stale_worker_is_live_again_after_its_publisher_restarts() -> None:
    """A worker marked ``stale`` (endpoint gone) comes back ``live`` on the restarted
    publisher's first batch, with the old incarnation's blocks gone.

    (The exact collision — old last seq 0, new first seq 0 — is detected by the
    subscriber from the payload; see tests/integration/test_events_restart.py.)
    """
    from tokenspeed_router.server import RouterService, ServerConfig, WorkerSpec

    ev, rp = f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}"
    pub = ZmqEventPublisher(ev, replay_endpoint=rp)
    service = RouterService(ServerConfig(http=None, stale_after_s=0.3,
                                         workers=(WorkerSpec(name="w0", events=ev, replay=rp),)))
    service.start()
    try:
        old, new = tokens(1, 2), tokens(2, 1)

        def w0() -> dict[str, Any]:
            return dict(service.workers()["w0"])

        wait_until(lambda: w0()["connected"], 10, what="connected")
        # slow joiner: empty batches until one arrives, then the real one
        wait_until(lambda: pub.publish_events([], ts=0.0) >= 0 and w0()["last_seq"] is not None, 10,
                   what="subscribed")
        for _ in range(50):  # the old incarnation gets well ahead: the new one's seqs go back
            pub.publish_events([], ts=0.0)
        pub.publish(batch(stored(old)))
        wait_until(lambda: service.match(old).scores.get("w0") == 2, 10, what="old blocks visible")
        pub.close()
        wait_until(lambda: w0()["state"] == "stale", 10, what="stale")
        assert not w0()["connected"]
        route = service.route(old)
        assert route.matched_blocks == 0  # stale scores as cold
        pub = ZmqEventPublisher(ev, replay_endpoint=rp)
        wait_until(lambda: w0()["connected"], 10, what="reconnected")
        wait_until(lambda: pub.publish_events([], ts=0.0) >= 0 and w0()["restarts"] >= 1, 10,
                   what="restart detected")
        pub.publish(batch(stored(new), ts=2.0))
        wait_until(lambda: service.match(new).scores.get("w0") == 1, 10, what="new blocks visible")
        info = w0()
        assert info["state"] == "live" and info["blocks"] == 1 and info["epoch"] >= 1
        assert service.match(old).scores.get("w0", 0) == 0  # the old incarnation's blocks are gone
        assert service.route(new).worker == "w0"
    finally:
        service.stop()
        pub.close()
