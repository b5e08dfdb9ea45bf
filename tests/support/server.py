"""Helpers for the server tests: event builders, a `serve` subprocess, capture re-publishers.

Not a test module (no ``test_`` prefix). Every wait polls with a deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zmq

from support import REPO_ROOT, wait_until
from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.events.kvcap import read_kvcap
from tokenspeed_router.events.schema import (
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.loadgen.fleet import stop_process

BLOCK = 16


def tokens(seed: int, num_blocks: int, block_size: int = BLOCK) -> list[int]:
    """Deterministic token ids, distinct per seed."""
    return [seed * 100_000 + i for i in range(num_blocks * block_size)]


def stored(token_ids: Sequence[int], *, parent_tokens: Sequence[int] = (), block_size: int = BLOCK,
           medium: str | None = None) -> BlockStored:
    """A BlockStored for ``token_ids`` chained after ``parent_tokens`` (ids = our content hash)."""
    full = [*parent_tokens, *token_ids]
    hashes: list[BlockHash] = list(block_hashes(full, block_size))
    skip = len(parent_tokens) // block_size
    parent = hashes[skip - 1] if skip else None
    return BlockStored(
        block_hashes=hashes[skip:], parent_block_hash=parent, token_ids=list(token_ids),
        block_size=block_size, medium=medium,
    )


def removed(token_ids: Sequence[int], first_block: int, num_blocks: int, block_size: int = BLOCK) -> BlockRemoved:
    hashes: list[BlockHash] = list(block_hashes(token_ids, block_size))
    return BlockRemoved(block_hashes=hashes[first_block : first_block + num_blocks])


def nonzero(scores: dict[str, int]) -> dict[str, int]:
    """Match scores without the workers that hold nothing (the index lists those with 0)."""
    return {w: n for w, n in scores.items() if n}


def batch(*events: Event, ts: float = 1.0) -> KVEventBatch:
    return KVEventBatch(ts, list(events))


# --------------------------------------------------------------------------- serve subprocess


@dataclass
class ServeProcess:
    """``tokenspeed-router serve`` (or ``replay --serve``) as a real subprocess."""

    args: list[str]
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_tcp_port)
    command: str = "serve"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0, token: str | None = None) -> ServeProcess:
        self.stderr_path = self.workdir / f"{self.command}-{self.port}.stderr"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "INFO", self.command,
             *self.args, "--http", f"127.0.0.1:{self.port}"],
            cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=self._stderr,
        )

        def healthy() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"router exited early rc={self.proc.returncode}: {self.stderr()}")
            try:
                return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout_s, interval_s=0.05, what=f"{self.command} to answer /health")
        self.http = httpx.Client(base_url=self.url, timeout=10.0,
                                 headers={"authorization": f"Bearer {token}"} if token else {})
        return self

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def get(self, path: str) -> Any:
        resp = self.http.get(path)
        assert resp.status_code == 200, (resp.status_code, resp.text)
        return resp.json()

    def post(self, path: str, body: Any) -> Any:
        resp = self.http.post(path, json=body)
        assert resp.status_code == 200, (resp.status_code, resp.text)
        return resp.json()

    def workers(self) -> dict[str, Any]:
        return dict(self.get("/workers"))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM and wait: returns the exit code (0 = clean shutdown)."""
        assert self.proc is not None
        code = stop_process(self.proc, timeout_s)
        if hasattr(self, "http"):
            self.http.close()
        self._stderr.close()
        return code

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.stop()


# --------------------------------------------------------------------------- capture re-publishing


@dataclass
class _RankCapture:
    worker: str
    live: list[tuple[int, list[bytes]]]  # (recv_ns, [topic, seq, payload])
    replay_form: str  # "vllm" ([b"", topic, seq, payload]) or "tokenspeed" ([b"", seq, payload])
    end_marker: list[bytes]
    messages: dict[int, tuple[bytes, bytes]]  # seq -> (topic, payload): live + replay records


def load_capture(folder: Path) -> dict[str, _RankCapture]:
    """Per rank (dp0, dp1): the live frames and every (seq -> payload) known from the capture."""
    out: dict[str, _RankCapture] = {}
    replay_recs = list(read_kvcap(folder / "dp1.replay.kvcap"))
    first = replay_recs[0].frames
    form = "vllm" if len(first) == 4 else "tokenspeed"
    end = list(replay_recs[-1].frames)
    for rank in ("dp0", "dp1"):
        live = [(r.recv_time_ns, list(r.frames)) for r in read_kvcap(folder / f"{rank}.sub.kvcap")]
        messages = {int.from_bytes(f[1], "big"): (f[0], f[2]) for _, f in live}
        if rank == "dp1":
            for r in replay_recs[:-1]:
                f = r.frames
                topic, seq, payload = (f[1], f[2], f[3]) if form == "vllm" else (b"kv", f[1], f[2])
                messages.setdefault(int.from_bytes(seq, "big"), (topic, payload))
        out[rank] = _RankCapture(rank, live, form, end, messages)
    return out


class CapturePublisher:
    """Re-publishes one capture's live frames on XPUB sockets, with replay ROUTERs.

    XPUB shows when the router's SUB has subscribed, so publishing starts only
    once it listens (no slow-joiner loss, no sleeps). The replay ROUTER answers
    ``[id, b"", start_seq]`` from the capture's records in the engine's own
    reply framing, then the engine's end marker.
    """

    def __init__(self, folder: Path, *, base_port: int | None = None, replay_base_port: int | None = None) -> None:
        self.ranks = load_capture(folder)
        self.manifest = json.loads((folder / "manifest.json").read_text())
        self.ctx = zmq.Context()
        self.pubs: dict[str, zmq.Socket[bytes]] = {}
        self.routers: dict[str, zmq.Socket[bytes]] = {}
        self.events: dict[str, str] = {}
        self.replays: dict[str, str] = {}
        for i, rank in enumerate(("dp0", "dp1")):
            pub = self.ctx.socket(zmq.XPUB)
            pub.linger = 0
            pub.bind("tcp://127.0.0.1:" + ("*" if base_port is None else str(base_port + i)))
            router = self.ctx.socket(zmq.ROUTER)
            router.linger = 0
            router.bind("tcp://127.0.0.1:" + ("*" if replay_base_port is None else str(replay_base_port + i)))
            self.pubs[rank] = pub
            self.routers[rank] = router
            self.events[rank] = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replays[rank] = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_requests: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def wait_subscribed(self, timeout_s: float = 20.0) -> None:
        for rank, pub in self.pubs.items():
            poller = zmq.Poller()
            poller.register(pub, zmq.POLLIN)

            def subscribed(pub: zmq.Socket[bytes] = pub, poller: zmq.Poller = poller) -> bool:
                if poller.poll(10):
                    return pub.recv()[:1] == b"\x01"
                return False

            wait_until(subscribed, timeout_s, what=f"router to subscribe to {rank}")

    def publish_all(self) -> None:
        """Publish every live record of both ranks in capture (receive-time) order."""
        frames = sorted(
            ((ns, rank, f) for rank, rc in self.ranks.items() for ns, f in rc.live), key=lambda x: x[0]
        )
        for _, rank, f in frames:
            self.pubs[rank].send_multipart(f)

    def serve_replays(self) -> None:
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        for router in self.routers.values():
            poller.register(router, zmq.POLLIN)
        by_sock = {id(s): rank for rank, s in self.routers.items()}
        while not self._stop.is_set():
            for sock, _ in poller.poll(20):
                rank = by_sock[id(sock)]
                msg = sock.recv_multipart()
                if len(msg) != 3:
                    continue
                start = int.from_bytes(msg[2], "big")
                self.replay_requests.append((rank, start))
                rc = self.ranks[rank]
                for seq in sorted(s for s in rc.messages if s >= start):
                    topic, payload = rc.messages[seq]
                    seq_b = seq.to_bytes(8, "big")
                    body = [b"", topic, seq_b, payload] if rc.replay_form == "vllm" else [b"", seq_b, payload]
                    sock.send_multipart([msg[0], *body])
                sock.send_multipart([msg[0], *rc.end_marker])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        for s in [*self.pubs.values(), *self.routers.values()]:
            s.close(0)
        self.ctx.term()

    def expected_matches(self, names: dict[str, str]) -> Iterator[tuple[list[int], dict[str, int]]]:
        """(query tokens, expected scores, zeros included, renamed with ``names``) for every manifest query."""
        for q in self.manifest["queries"]:
            expected = {names[w]: n for w, n in q["matched_blocks"].items()}
            yield q["tokens"], expected


class DropProxy:
    """Forwards a publisher's frames to the router, dropping the given sequence numbers.

    SUB (connected to the real publisher) -> XPUB (the router connects here).
    """

    def __init__(self, upstream: str, drop_seqs: set[int]) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.linger = 0
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(upstream)
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.linger = 0
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.drop_seqs = set(drop_seqs)
        self.forwarded: list[int] = []
        self.dropped: list[int] = []
        self.subscribed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.pub, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(20):
                if sock is self.pub:
                    if self.pub.recv()[:1] == b"\x01":
                        self.subscribed.set()
                    continue
                frames = self.sub.recv_multipart()
                seq = int.from_bytes(frames[1], "big") if len(frames) == 3 else -1
                if seq in self.drop_seqs:
                    self.dropped.append(seq)
                    continue
                self.forwarded.append(seq)
                self.pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sub.close(0)
        self.pub.close(0)
        self.ctx.term()
