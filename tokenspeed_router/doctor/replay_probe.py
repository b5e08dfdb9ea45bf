"""Ask an engine's replay endpoint for the canary's batch, as the router would after a gap.

The router heals a gap in a stream by asking the engine's replay ROUTER
socket for the batches from the missing seq on (DESIGN §3). A replay
endpoint that is wrong in the worker spec fails silently: nothing answers, or
another engine (another DP rank) answers with its own batches, and the
router falls back to a full resync on every gap. The doctor sends the same
request (``[b"", seq]`` from a DEALER) for the seq its canary arrived with,
and reports whether the answer came, ended with the end marker, and carried
the canary's blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import zmq

from tokenspeed_router.events.codec import BatchDecoder
from tokenspeed_router.events.curve import CurveClientKeys
from tokenspeed_router.events.frames import (
    END_SEQ,
    SEQ_BYTES,
    decode_seq,
    encode_seq,
    ipv6_endpoint,
    split_replay_frames,
)
from tokenspeed_router.events.schema import BlockStored

__all__ = ["ReplayAnswer", "probe_replay"]

#: replies read at most: the canary's batch is among the newest, a ring holds thousands
_MAX_REPLIES = 100_000


@dataclass(slots=True)
class ReplayAnswer:
    """What one replay request got back."""

    answered: bool = False
    """The end marker arrived."""
    replies: int = 0
    """Batches in the reply."""
    first_seq: int | None = None
    block_ids: set[object] = field(default_factory=set)
    """Ids of every ``BlockStored`` block in the reply."""
    malformed: int = 0
    error: str | None = None


def probe_replay(endpoint: str, start_seq: int, timeout_s: float,
                 curve: CurveClientKeys | None = None) -> ReplayAnswer:
    """Request a replay from ``start_seq`` at ``endpoint``; wait at most ``timeout_s``. Blocking."""
    answer = ReplayAnswer()
    decoder = BatchDecoder(validate=False)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.linger = 0
        dealer.setsockopt(zmq.RCVHWM, 0)
        if ipv6_endpoint(endpoint):
            dealer.setsockopt(zmq.IPV6, 1)
        if curve is not None:
            curve.apply(dealer)
        dealer.connect(endpoint)
        dealer.send_multipart((b"", encode_seq(start_seq)))
        deadline = time.monotonic() + timeout_s
        while answer.replies + answer.malformed < _MAX_REPLIES:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not dealer.poll(left_ms):
                break
            split = split_replay_frames(dealer.recv_multipart())
            if split is None or len(split[1]) != SEQ_BYTES:
                answer.malformed += 1
                continue
            _, seq_frame, payload = split
            if seq_frame == END_SEQ:
                answer.answered = True
                break
            try:
                batch = decoder.decode(payload)
            except Exception:  # a foreign or broken payload: counted, the check says so
                answer.malformed += 1
                continue
            answer.replies += 1
            if answer.first_seq is None:
                answer.first_seq = decode_seq(seq_frame)
            for event in batch.events:
                if isinstance(event, BlockStored):
                    answer.block_ids.update(event.block_hashes)
    except zmq.ZMQError as err:
        answer.error = f"{type(err).__name__}: {err}"
    finally:
        dealer.close(linger=0)
        ctx.term()
    return answer
