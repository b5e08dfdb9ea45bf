"""One outstanding replay request to a publisher's replay ROUTER, and its answer.

The socket side of a subscriber's replays (``subscriber.py`` decides when to
ask and how to merge the answer): a DEALER connected to the replay endpoint,
created on first use; the request ``[b"", start_seq]``; the answer's frames
read through the stream's :class:`~tokenspeed_router.events.frame_reader.FrameReader`
until the end marker or the deadline. A request that is not answered within
``timeout_s`` fails, and the DEALER is then closed and made anew, so a late
answer can never be mistaken for the next one.

Asynchronous: nothing here waits; :meth:`ReplayClient.pump` reads what has
arrived. Threading: the subscriber's thread only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from tokenspeed_router.events.curve import CurveClientKeys
from tokenspeed_router.events.frame_reader import FrameReader
from tokenspeed_router.events.frames import encode_seq, ipv6_endpoint
from tokenspeed_router.events.replay_merge import Message, ReplayPurpose

__all__ = ["PendingReplay", "ReplayClient"]

logger = logging.getLogger("tokenspeed_router.events.subscriber")


@dataclass(slots=True)
class PendingReplay:
    """A replay asked for and not finished yet."""

    start_seq: int
    purpose: ReplayPurpose
    target_seq: int | None  # the live seq that triggered it (held, merged at the end)
    deadline: float  # time.monotonic()
    items: list[Message]


class ReplayClient:
    """The DEALER of one stream's replays and the request in flight (module docstring).

    ``endpoint`` None: a stream without replay; :meth:`start` is never called then.
    """

    def __init__(
        self,
        worker: str,
        endpoint: str | None,
        context: zmq.Context[zmq.Socket[bytes]],
        frames: FrameReader,
        *,
        timeout_s: float,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self._worker = worker
        self._endpoint = endpoint
        self._ctx = context
        self._frames = frames
        self._timeout_s = timeout_s
        self._curve = curve
        self._dealer: zmq.Socket[bytes] | None = None
        #: the request in flight (None: none)
        self.pending: PendingReplay | None = None
        self.requests = 0
        self.timeouts = 0

    @property
    def socket(self) -> zmq.Socket[bytes] | None:
        """The DEALER while a request is in flight (for an external poller), else None."""
        return self._dealer if self.pending is not None else None

    def start(self, start_seq: int, purpose: ReplayPurpose, target_seq: int | None) -> bool:
        """Ask for everything from ``start_seq``; False when the request could not be sent
        (then :attr:`pending` holds it, to be finished as failed)."""
        self.requests += 1
        self.pending = PendingReplay(start_seq, purpose, target_seq, time.monotonic() + self._timeout_s, [])
        dealer = self._ensure_dealer()
        try:
            dealer.send_multipart((b"", encode_seq(start_seq)), zmq.NOBLOCK)
        except zmq.ZMQError as err:
            logger.warning("kv subscriber worker=%s: cannot send replay request: %s", self._worker, err)
            self.reset()
            return False
        logger.debug(
            "kv subscriber worker=%s: replay requested from seq %d (%s, up to %s)",
            self._worker, start_seq, purpose, target_seq,
        )
        return True

    def pump(self) -> str | None:
        """Read what the publisher sent: ``"done"`` at the end marker, ``"timeout"``
        past the deadline (the DEALER is then reset), None while still waiting."""
        pending = self.pending
        if pending is None:
            return None
        dealer = self._dealer
        while dealer is not None:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            parsed = self._frames.parse_replay(frames)
            if parsed is True:
                return "done"
            if isinstance(parsed, Message):
                pending.items.append(parsed)
        if time.monotonic() >= pending.deadline:
            self.timeouts += 1
            logger.warning(
                "kv subscriber worker=%s: replay from seq %d not answered within %.1fs",
                self._worker, pending.start_seq, self._timeout_s,
            )
            self.reset()
            return "timeout"
        return None

    def take(self) -> PendingReplay:
        """The request just finished (it is no longer pending)."""
        pending = self.pending
        assert pending is not None
        self.pending = None
        return pending

    def reset(self) -> None:
        """Drop the DEALER so that a late reply can never answer the next request."""
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def _ensure_dealer(self) -> zmq.Socket[bytes]:
        if self._dealer is None:
            assert self._endpoint is not None, "a stream without a replay endpoint never asks for one"
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.setsockopt(zmq.RCVHWM, 0)  # a full ring must never be cut short
            if ipv6_endpoint(self._endpoint):
                dealer.setsockopt(zmq.IPV6, 1)
            if self._curve is not None:
                self._curve.apply(dealer)
            dealer.connect(self._endpoint)
            self._dealer = dealer
        return self._dealer
