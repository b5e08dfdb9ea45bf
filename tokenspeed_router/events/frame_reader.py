"""Frames off a subscriber's sockets into checked messages, or counted skips.

One :class:`FrameReader` per :class:`~tokenspeed_router.events.subscriber.EventSubscriber`.
It is the only place that looks at raw frames: the shape (``[topic, 8-byte
seq, payload]`` live, either replay framing), the topic, the payload size and
the payload itself. Whatever fails is counted by reason, logged at most once
per reason per interval, and skipped *before* its seq is looked at, so a
malformed frame can never move the subscriber's sequence state. What passes
becomes a :class:`~tokenspeed_router.events.replay_merge.Message`. A
well-formed batch whose every event is of a kind we do not know is skipped
too (``no_known_events``) and only reported to the caller as a *filler* seq
(``sequencing.py``): it moves nothing either.

Payloads: the native scanner (``_native.scan_batch``) proves the common
vLLM-shaped batches well formed without building a Python object per block;
anything it cannot vouch for goes through the typed decoder
(``events/codec.py``), which decides, and a malformed one is skipped here.

Threading: the subscriber's thread only (it owns the counters).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenspeed_router.errors import WireError
from tokenspeed_router.events.codec import BatchDecoder, only_unknown_events
from tokenspeed_router.events.frames import END_SEQ, SEQ_BYTES, decode_seq, split_replay_frames
from tokenspeed_router.events.replay_merge import Message
from tokenspeed_router.events.schema import KVEventBatch
from tokenspeed_router.ratelimit import RateLimitedLog

__all__ = ["FrameReader"]

logger = logging.getLogger("tokenspeed_router.events.subscriber")

try:  # the compiled scanner proves the common payloads well formed without decoding them
    from tokenspeed_router._native import scan_batch as _scan_batch
except ImportError:
    _scan_batch = None  # type: ignore[assignment]

_LOG_INTERVAL_S = 10.0


class FrameReader:
    """Check one stream's frames (see the module docstring); counts what it skips.

    ``received`` counts live messages read (good or bad), ``malformed`` the
    skipped ones by reason (frame_count, seq_length, topic, payload_size,
    payload_decode, no_known_events, replay_frame), ``last_recv_time_s`` the
    wall time of the last live message. ``on_filler(seq)`` hears each seq that
    carried only events of unknown kinds (the subscriber notes it in its tracker).
    """

    def __init__(
        self, worker: str, topic: bytes, max_payload_bytes: int, on_filler: Callable[[int], None]
    ) -> None:
        self._worker = worker
        self._on_filler = on_filler
        self._topic = topic
        self._max_payload_bytes = max_payload_bytes
        self._decoder = BatchDecoder()
        self._limiter = RateLimitedLog(logger, _LOG_INTERVAL_S)
        self.received = 0
        self.malformed: dict[str, int] = {}
        self.last_recv_time_s: float | None = None

    @property
    def limiter(self) -> RateLimitedLog:
        """The stream's rate-limited log (shared with the subscriber's own warnings)."""
        return self._limiter

    def skip(self, reason: str, detail: str, *args: object) -> None:
        """Count and (rate limited) log one skipped message."""
        self.malformed[reason] = self.malformed.get(reason, 0) + 1
        self._limiter.log(
            logging.WARNING, reason,
            "kv subscriber worker=%s: skipping malformed message (%s): " + detail,
            self._worker, reason, *args,
        )

    def parse_live(self, frames: list[bytes], now: float | None = None) -> Message | None:
        """A live message received at ``now`` (wall clock; default: now), or None (counted)
        when it is not one we can use."""
        if now is None:
            now = time.time()
        self.received += 1
        self.last_recv_time_s = now
        if len(frames) != 3:
            self.skip("frame_count", "expected 3 frames [topic, seq, payload], got %d", len(frames))
            return None
        topic, seq_frame, payload = frames
        return self.check(topic, seq_frame, payload, now, replayed=False)

    def parse_replay(self, frames: list[bytes]) -> Message | bool:
        """A replayed message, True for the end marker, False for a skipped frame."""
        split = split_replay_frames(frames)
        if split is None:
            self.skip(
                "replay_frame",
                "expected [b'', topic, seq, payload] or [b'', seq, payload], got %d frames",
                len(frames),
            )
            return False
        topic_frame, seq_frame, payload = split
        if seq_frame == END_SEQ:
            return True
        topic = self._topic if topic_frame is None else topic_frame
        message = self.check(topic, seq_frame, payload, time.time(), replayed=True)
        return False if message is None else message

    def check(self, topic: bytes, seq_frame: bytes, payload: bytes, now: float, *, replayed: bool) -> Message | None:
        """The checks every message passes before its seq means anything."""
        if self._topic and topic != self._topic:
            self.skip("topic", "expected topic %r, got %r", self._topic, topic[:64])
            return None
        if len(seq_frame) != SEQ_BYTES:
            self.skip("seq_length", "seq frame must be %d bytes, got %d", SEQ_BYTES, len(seq_frame))
            return None
        if len(payload) > self._max_payload_bytes:
            self.skip(
                "payload_size", "payload of %d bytes exceeds max_payload_bytes=%d",
                len(payload), self._max_payload_bytes,
            )
            return None
        seq = decode_seq(seq_frame)
        ts = _scan_batch(payload) if _scan_batch is not None else None
        batch: KVEventBatch | None = None
        if ts is None:  # not provably the common case: the typed decoder decides
            unknown_before = self._decoder.unknown_events
            try:
                batch = self._decoder.decode(payload)
            except WireError as err:
                self.skip("payload_decode", "%s", err)
                return None
            if only_unknown_events(batch, payload):
                # Nothing to apply: no evidence of a restart or a gap either (sequencing.py).
                self._on_filler(seq)
                self.skip(
                    "no_known_events", "batch seq %d carries only events of kinds this router does "
                    "not know (%d); skipped, it moves nothing",
                    seq, self._decoder.unknown_events - unknown_before,
                )
                return None
            ts = batch.ts
        return Message(seq, payload, batch, topic, now, replayed, ts)
