"""LogRecord: one received message, as the event log, the captures and replay all see it.

Defined apart from ``log.py`` and ``kvcap.py`` because both formats produce it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LogRecord"]


@dataclass(frozen=True, slots=True)
class LogRecord:
    """One received message: when, from which worker, its seq, topic and payload."""

    recv_time_s: float
    worker: str
    seq: int
    topic: bytes
    payload: bytes
