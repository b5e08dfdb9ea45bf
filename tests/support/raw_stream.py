"""A publisher that sends whatever frames a test gives it, good or bad, with an optional replay ROUTER.

Not a test module. :class:`RawStream` binds an XPUB on a free loopback port
(XPUB shows when a subscriber has joined, so nothing is lost to the slow
joiner and nothing sleeps) and, when asked, a replay ROUTER that answers
``[b"", start_seq]`` from :attr:`RawStream.ring` in vLLM's framing
(``[id, b"", topic, seq, payload]`` per batch, then the end marker). The ring
is what the engine itself holds: the tests put only the batches the engine
really published there, never the bad frames someone else slipped in.

Also :data:`BAD_PAYLOADS`: one payload per malformed class of issue 28 (each
must be skipped whatever seq it carries), and :func:`bad_frames`, the
frame-level classes (wrong frame counts, a short seq).
"""

from __future__ import annotations

import random
import struct
import threading

import msgspec
import zmq

from support import wait_until

_enc = msgspec.msgpack.Encoder()
END_SEQ = b"\xff" * 8


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _stored_map(**fields: object) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
            "token_ids": list(range(16)), "block_size": 16, **fields}


#: Well-formed frames whose *payload* is not a batch we may apply, by class.
BAD_PAYLOADS: dict[str, bytes] = {
    "undecodable": b"\xc1\xc1\xc1\xc1",
    "truncated": _enc.encode([1.0, [_stored_map()]])[:-5],
    "not_a_batch_map": _enc.encode({"ts": 1.0, "events": []}),
    "not_a_batch_str": _enc.encode("BlockStored"),
    "not_a_batch_int": _enc.encode(12345),
    "unknown_tag_map": _enc.encode([1.0, [{"type": "BlockMoved", "block_hashes": [1]}]]),
    "unknown_tag_array": _enc.encode([1.0, [["KVCacheOffloaded", [1, 2], "CPU"]]]),
    "wrong_types_hashes": _enc.encode([1.0, [_stored_map(block_hashes=["a", "b"])]]),
    "wrong_types_tokens": _enc.encode([1.0, [_stored_map(token_ids="0123")]]),
    "wrong_types_ts": _enc.encode(["yesterday", [_stored_map()]]),
    "wrong_types_removed": _enc.encode([1.0, [{"type": "BlockRemoved", "block_hashes": {"a": 1}}]]),
    "negative_block_size": _enc.encode([1.0, [_stored_map(block_size=-16)]]),
    "zero_block_size": _enc.encode([1.0, [_stored_map(block_size=0)]]),
    "many_hashes_one_token": _enc.encode([1.0, [_stored_map(block_hashes=list(range(100_000)),
                                                             token_ids=[1])]]),
    "no_hashes": _enc.encode([1.0, [_stored_map(block_hashes=[])]]),
    "nan_ts": _enc.encode([float("nan"), [_stored_map()]]),
    "array32_4g_items": b"\x93\xcb" + struct.pack(">d", 1.0) + b"\xdd\xff\xff\xff\xff",
    "map32_4g_items": b"\x93\xcb" + struct.pack(">d", 1.0) + b"\x91\xdf\xff\xff\xff\xff",
    "str32_4g": b"\x93\xcb" + struct.pack(">d", 1.0) + b"\x91\x92\xdb\xff\xff\xff\xff",
    "deep_nesting": b"\x93\xcb" + struct.pack(">d", 1.0) + b"\x91" * 5000,
    "trailing_bytes": _enc.encode([1.0, [_stored_map()]]) + b"\x00",
    "random": bytes(random.Random(28).randrange(256) for _ in range(200)),
}


def bad_frames(topic: bytes, seq: int) -> list[list[bytes]]:
    """Frame-level bad messages: wrong frame counts and a short seq."""
    good_seq = seq_bytes(seq)
    return [
        [topic],
        [topic, good_seq],
        [topic, good_seq, b"x", b"extra"],
        [topic, good_seq[:3], _enc.encode([1.0, []])],
        [topic, b"", b"\x92\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x90"],
        [topic, good_seq + b"\x00", b"\x90"],
    ]


class RawStream:
    """XPUB + optional replay ROUTER on free loopback ports (see the module docstring)."""

    def __init__(self, *, replay: bool, topic: bytes = b"") -> None:
        self.topic = topic
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.linger = 0
        self.pub.setsockopt(zmq.SNDHWM, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        #: what the engine holds: seq -> payload (served by the replay ROUTER)
        self.ring: dict[int, bytes] = {}
        self._ring_lock = threading.Lock()
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replay_requests = 0
        if replay:
            router = self.ctx.socket(zmq.ROUTER)
            router.linger = 0
            rport = router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            self._thread = threading.Thread(target=self._serve_replay, args=(router,), daemon=True)
            self._thread.start()
        self._subscribed = False

    def wait_subscribed(self, timeout_s: float = 10.0) -> None:
        """Wait for a subscriber's subscription message on the XPUB."""
        def joined() -> bool:
            if not self._subscribed and self.pub.poll(0, zmq.POLLIN):
                msg = self.pub.recv()
                self._subscribed = msg[:1] == b"\x01"
            return self._subscribed

        wait_until(joined, timeout_s, interval_s=0.01, what="a subscriber to join")

    def hold(self, seq: int, payload: bytes) -> None:
        """A batch the engine published: into its ring (whether or not it arrives live)."""
        with self._ring_lock:
            self.ring[seq] = payload

    def publish(self, seq: int, payload: bytes) -> None:
        """A good batch: into the ring, then on the wire."""
        self.hold(seq, payload)
        self.pub.send_multipart([self.topic, seq_bytes(seq), payload])

    def send_frames(self, frames: list[bytes]) -> None:
        """Any frames at all (never into the ring)."""
        self.pub.send_multipart(frames)

    def restart_ring(self) -> None:
        """A new publisher process: its ring starts empty."""
        with self._ring_lock:
            self.ring.clear()

    def _serve_replay(self, router: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(50):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue
                self.replay_requests += 1
                ident, start = frames[0], int.from_bytes(frames[2], "big")
                with self._ring_lock:
                    held = sorted((s, p) for s, p in self.ring.items() if s >= start)
                for s, p in held:
                    router.send_multipart([ident, b"", self.topic, seq_bytes(s), p])
                router.send_multipart([ident, b"", b"", END_SEQ, b""])
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self.pub.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> RawStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def every_bad_frame(topic: bytes, seq: int) -> list[list[bytes]]:
    """Every malformed class, each frame carrying ``seq`` (the payload classes and the frame ones)."""
    frames = [[topic, seq_bytes(seq), p] for p in BAD_PAYLOADS.values()]
    return [*frames, *bad_frames(topic, seq)]

