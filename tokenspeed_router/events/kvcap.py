"""The ``.kvcap`` capture format: raw ``recv_multipart`` results, as recorded from engines.

The captures in ``tests/data/captures/`` (format in its README) are what
real vLLM, SGLang and TokenSpeed engines sent, frame for frame, live and
replayed::

    file    := magic "KVCAPv1\\n" record*
    record  := recv_time_ns u64 | num_frames u32 | (frame_len u32 | frame)*

Here: reading them (:func:`read_kvcap`; a torn last record is dropped), the
worker a file belongs to (:func:`kvcap_worker`), and turning their live and
replay frames into the :class:`LogRecord` s an event log holds, for one file
(:class:`KvcapLog`, re-read on each load, so a growing capture can be
followed) or a whole capture directory (:func:`capture_dir_records`). The
event log (``log.py``) opens captures through these.
"""

from __future__ import annotations

import heapq
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenspeed_router.errors import EventLogError
from tokenspeed_router.events.frames import END_SEQ, SEQ_BYTES, decode_seq
from tokenspeed_router.events.records import LogRecord

__all__ = [
    "KVCAP_MAGIC",
    "KvcapLog",
    "KvcapRecord",
    "capture_dir_records",
    "kvcap_log_records",
    "kvcap_messages",
    "kvcap_worker",
    "read_kvcap",
]

KVCAP_MAGIC = b"KVCAPv1\n"


@dataclass(frozen=True, slots=True)
class KvcapRecord:
    """One ``recv_multipart`` result from a capture: wall-clock ns and raw frames."""

    recv_time_ns: int
    frames: tuple[bytes, ...]


_KVCAP_HEAD = struct.Struct("<QI")
_KVCAP_FRAME = struct.Struct("<I")


def read_kvcap(path: str | os.PathLike[str]) -> Iterator[KvcapRecord]:
    """Yield the records of a ``.kvcap`` capture (format in ``tests/data/captures/README.md``).

    A torn last record is dropped (the intact prefix is yielded); a bad
    magic raises :class:`EventLogError`.
    """
    data = Path(path).read_bytes()
    if not data.startswith(KVCAP_MAGIC):
        raise EventLogError(f"{path} is not a .kvcap capture (magic {data[:8]!r})")
    for record, _ in parse_kvcap(data):
        yield record


def parse_kvcap(data: bytes) -> Iterator[tuple[KvcapRecord, int]]:
    """Complete records of a capture (magic already checked), each with its end offset."""
    off = len(KVCAP_MAGIC)
    end = len(data)
    while off + _KVCAP_HEAD.size <= end:
        recv_ns, num_frames = _KVCAP_HEAD.unpack_from(data, off)
        pos = off + _KVCAP_HEAD.size
        frames: list[bytes] = []
        for _ in range(num_frames):
            if pos + _KVCAP_FRAME.size > end:
                return
            (length,) = _KVCAP_FRAME.unpack_from(data, pos)
            pos += _KVCAP_FRAME.size
            if pos + length > end:
                return
            frames.append(data[pos : pos + length])
            pos += length
        yield KvcapRecord(recv_ns, tuple(frames)), pos
        off = pos


def kvcap_worker(path: str | os.PathLike[str]) -> str:
    """Worker name of a capture file: its name up to the first dot (``dp1.sub.kvcap`` -> ``dp1``)."""
    return Path(path).name.split(".", 1)[0]


class KvcapLog:
    """A capture seen as a log: its message records, re-read on each :meth:`load`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.worker = kvcap_worker(path)
        self.torn = False

    def load(self) -> list[LogRecord]:
        """The message records of the intact prefix; sets :attr:`torn` when bytes
        follow it (a torn or damaged last record)."""
        data = self.path.read_bytes()
        if not data.startswith(KVCAP_MAGIC):
            raise EventLogError(f"{self.path} is not a .kvcap capture (magic {data[:8]!r})")
        records: list[KvcapRecord] = []
        clean_end = len(KVCAP_MAGIC)
        for record, end in parse_kvcap(data):
            records.append(record)
            clean_end = end
        self.torn = clean_end != len(data)
        return list(kvcap_messages(records, self.worker))


def kvcap_log_records(path: Path) -> Iterator[LogRecord]:
    yield from kvcap_messages(read_kvcap(path), kvcap_worker(path))


def kvcap_messages(records: Iterable[KvcapRecord], worker: str) -> Iterator[LogRecord]:
    """Live records ``[topic, seq, payload]`` and replay records (DEALER delimiter
    first, then vLLM ``[topic, seq, payload]`` or TokenSpeed ``[seq, payload]``);
    end markers and anything else are skipped."""
    for rec in records:
        frames = rec.frames
        if len(frames) == 4 and frames[0] == b"":
            topic, seq_frame, payload = frames[1:]
        elif len(frames) == 3 and frames[0] == b"" and len(frames[1]) == SEQ_BYTES:
            topic, seq_frame, payload = b"", frames[1], frames[2]
        elif len(frames) == 3:
            topic, seq_frame, payload = frames
        else:
            continue
        if seq_frame == END_SEQ or len(seq_frame) != SEQ_BYTES:
            continue
        yield LogRecord(rec.recv_time_ns / 1e9, worker, decode_seq(seq_frame), topic, payload)


def merged_worker(records: Iterable[LogRecord]) -> list[LogRecord]:
    """One worker's records in seq order, the first copy of each seq kept."""
    by_seq: dict[int, LogRecord] = {}
    for rec in sorted(records, key=lambda r: r.recv_time_s):
        by_seq.setdefault(rec.seq, rec)
    return [by_seq[seq] for seq in sorted(by_seq)]


def capture_dir_records(path: Path) -> Iterator[LogRecord]:
    files = sorted(path.glob("*.kvcap"))
    if not files:
        raise EventLogError(f"{path} holds no .kvcap files")
    per_worker: dict[str, list[LogRecord]] = {}
    for file in files:
        per_worker.setdefault(kvcap_worker(file), []).extend(kvcap_log_records(file))
    streams = [merged_worker(recs) for _, recs in sorted(per_worker.items())]
    # Interleave workers by receive time; heapq.merge keeps each worker's seq order.
    yield from heapq.merge(*streams, key=lambda r: r.recv_time_s)
