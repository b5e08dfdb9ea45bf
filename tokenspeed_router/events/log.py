"""Event logs: record every received message, replay it later (DESIGN §7).

Our format (``.tslog`` by convention), version 1, little-endian::

    file    := header record*
    header  := magic "TSEVLOG\\n" | version u16 | meta_len u32 | meta (JSON, UTF-8) | crc32 u32
    record  := body_len u32 | crc32(body) u32 | body
    body    := recv_time_s f64 | seq u64 | worker_len u16 | topic_len u16
               | worker (UTF-8) | topic | payload

* Append-only, one ``write`` per record: a crash leaves at most one torn
  record at the end. Every record carries its own length and CRC32, so a
  reader detects a short or corrupt tail, reads the intact prefix and sets
  :attr:`EventLogReader.truncated`; it never guesses past damage.
* Readable while being written: a reader stops before an incomplete last
  record and picks up from there on its next pass (``records()`` resumes
  where the previous pass stopped), so ``tail -f``-style following is a loop.
  Records become visible when the writer flushes (:meth:`EventLogWriter.flush`).
* The version is checked on open; a reader refuses versions it does not know.
* ``seek_time(t)`` binary-searches a sparse index (one entry every
  ``_INDEX_EVERY`` records, built by a header-only scan the first time) and
  then scans forward; it assumes receive times are non-decreasing, which
  holds for logs written by one recorder on one clock.

Also here: :func:`open_event_source`, which turns our log, one ``.kvcap``
capture file or a capture directory (the format: ``kvcap.py``) into the same
stream of :class:`LogRecord`.
:class:`EventLogReader` opens a ``.kvcap`` file too (recognised by its magic):
it yields the same records as ``open_event_source`` does for that file (worker
= file name up to the first dot), with ``meta`` = ``{"format": "kvcap",
"worker": ...}``, ``truncated`` set by a torn tail (the intact prefix is read),
and ``seek_time``/``records(until_s=)``/``start_time_s`` as for a log. A
capture has no record index: each pass re-reads the file (captures are small).
"""

from __future__ import annotations

import bisect
import io
import json
import os
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from tokenspeed_router.errors import EventLogError
from tokenspeed_router.events.kvcap import (
    KVCAP_MAGIC,
    KvcapLog,
    capture_dir_records,
    kvcap_log_records,
)
from tokenspeed_router.events.records import LogRecord

__all__ = [
    "LOG_MAGIC",
    "LOG_VERSION",
    "EventLogReader",
    "EventLogWriter",
    "LogRecord",
    "open_event_source",
]

LOG_MAGIC = b"TSEVLOG\n"
LOG_VERSION = 1

_HEAD = struct.Struct("<HI")  # version, meta_len
_CRC = struct.Struct("<I")
_REC = struct.Struct("<II")  # body_len, crc32
_BODY = struct.Struct("<dQHH")  # recv_time_s, seq, worker_len, topic_len
_MAX_BODY = 1 << 30  # a larger length can only be damage
_MAX_META = 16 << 20
_INDEX_EVERY = 256


# ---------------------------------------------------------------- writer


class EventLogWriter:
    """Append records to a new log file (an existing file at ``path`` is replaced).

    Not thread safe: one recorder owns it. ``fsync=True`` makes :meth:`flush`
    also fsync (durable against power loss, slower).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, meta: dict[str, Any] | None = None, fsync: bool = False
    ) -> None:
        self._path = Path(path)
        self._fsync = fsync
        full_meta = {"format": "tokenspeed-router event log", "created_s": time.time()}
        full_meta.update(meta or {})
        try:
            meta_bytes = json.dumps(full_meta, sort_keys=True).encode()
        except (TypeError, ValueError) as err:
            raise EventLogError(f"log meta must be JSON-serialisable: {err}") from err
        if len(meta_bytes) > _MAX_META:
            raise EventLogError(f"log meta is {len(meta_bytes)} bytes, limit {_MAX_META}")
        head = LOG_MAGIC + _HEAD.pack(LOG_VERSION, len(meta_bytes)) + meta_bytes
        self._file: BinaryIO = open(self._path, "wb")  # noqa: SIM115 - owned, closed in close()
        self._file.write(head + _CRC.pack(zlib.crc32(head)))
        self._file.flush()  # a reader may open the log at once
        self._closed = False

    @property
    def path(self) -> Path:
        return self._path

    def append(
        self,
        worker: str,
        seq: int,
        payload: bytes | bytearray | memoryview,
        *,
        recv_time_s: float | None = None,
        topic: bytes = b"",
    ) -> None:
        """Append one record (``recv_time_s`` defaults to now, wall clock)."""
        if self._closed:
            raise EventLogError(f"event log {self._path} is closed")
        worker_bytes = worker.encode()
        if len(worker_bytes) > 0xFFFF or len(topic) > 0xFFFF:
            raise EventLogError("worker name and topic must be shorter than 64 KiB")
        if not 0 <= seq < 1 << 64:
            raise EventLogError(f"seq must be an unsigned 64-bit integer, got {seq}")
        when = time.time() if recv_time_s is None else float(recv_time_s)
        body = b"".join(
            (_BODY.pack(when, seq, len(worker_bytes), len(topic)), worker_bytes, topic, payload)
        )
        if len(body) > _MAX_BODY:
            raise EventLogError(f"record of {len(body)} bytes exceeds the {_MAX_BODY} limit")
        self._file.write(_REC.pack(len(body), zlib.crc32(body)) + body)

    def append_record(self, record: LogRecord) -> None:
        """Append a :class:`LogRecord` as is (e.g. when converting a capture)."""
        self.append(
            record.worker, record.seq, record.payload,
            recv_time_s=record.recv_time_s, topic=record.topic,
        )

    def flush(self) -> None:
        """Make the records written so far visible to readers (and durable with fsync)."""
        if self._closed:
            return
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        """Flush and close (idempotent)."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._file.close()

    def __enter__(self) -> EventLogWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# ---------------------------------------------------------------- reader


class EventLogReader:
    """Read a log written by :class:`EventLogWriter`, possibly while it grows.

    Iterating (or calling :meth:`records`) continues from the current
    position: the start of the file, where :meth:`seek_time` put it, or where
    the previous pass stopped (at the end, or before an incomplete record).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._file: BinaryIO = open(self._path, "rb")  # noqa: SIM115 - owned, closed in close()
        # A .kvcap capture is read as a log too: its message records become
        # LogRecords (worker = file stem), as open_event_source yields them.
        self._kvcap: KvcapLog | None = None
        try:
            if self._file.read(len(KVCAP_MAGIC)) == KVCAP_MAGIC:
                self._kvcap = KvcapLog(self._path)
                self._meta: dict[str, Any] = {"format": "kvcap", "worker": self._kvcap.worker}
                self._version = 1
                self._data_start = 0
            else:
                self._file.seek(0)
                self._meta, self._version, self._data_start = _read_header(self._file, self._path)
        except BaseException:
            self._file.close()
            raise
        self._pos = self._data_start
        self._truncated = False
        self._corrupt = False
        # sparse index: (recv_time_s, offset) of every _INDEX_EVERY-th record,
        # valid for the file prefix [data_start, _indexed_to)
        self._index_times: list[float] = []
        self._index_offsets: list[int] = []
        self._indexed_to = self._data_start
        self._indexed_count = 0
        self._first_time: float | None = None

    @property
    def path(self) -> Path:
        return self._path

    @property
    def meta(self) -> dict[str, Any]:
        """The JSON metadata stored in the header (for a ``.kvcap``:
        ``{"format": "kvcap", "worker": <file stem>}``)."""
        return dict(self._meta)

    @property
    def version(self) -> int:
        return self._version

    @property
    def truncated(self) -> bool:
        """True if the last pass stopped before an incomplete or damaged record."""
        return self._truncated

    @property
    def start_time_s(self) -> float | None:
        """Receive time of the first record (None for an empty log)."""
        if self._first_time is None and self._kvcap is not None:
            first_records = self._kvcap.load()
            if first_records:
                self._first_time = first_records[0].recv_time_s
        elif self._first_time is None:
            first = self._read_at(self._data_start)
            if isinstance(first, tuple):
                self._first_time = first[0].recv_time_s
        return self._first_time

    def records(self, until_s: float | None = None) -> Iterator[LogRecord]:
        """Yield records from the current position, stopping before ``recv_time_s > until_s``.

        Stops (setting :attr:`truncated`) before a torn or damaged record.
        A later call resumes at the first record not yet yielded.
        """
        if self._kvcap is not None:
            yield from self._kvcap_records(until_s)
            return
        while True:
            got = self._read_at(self._pos)
            if got is None:
                self._truncated = False
                return
            if not isinstance(got, tuple):
                self._truncated = True
                return
            record, end = got
            if until_s is not None and record.recv_time_s > until_s:
                return
            self._truncated = False
            self._pos = end
            yield record

    def __iter__(self) -> Iterator[LogRecord]:
        return self.records()

    def rewind(self) -> None:
        """Go back to the first record."""
        self._pos = self._data_start

    def seek_time(self, t: float) -> None:
        """Position the reader at the first record with ``recv_time_s >= t``.

        ``t`` is an absolute time in the log's clock (seconds since the epoch,
        like ``recv_time_s``); add :attr:`start_time_s` for a relative offset.
        """
        if self._kvcap is not None:
            records = self._kvcap.load()
            self._pos = next(
                (i for i, rec in enumerate(records) if rec.recv_time_s >= t), len(records)
            )
            return
        self._extend_index()
        i = bisect.bisect_left(self._index_times, t)
        pos = self._index_offsets[i - 1] if i > 0 else self._data_start
        while True:
            got = self._read_at(pos, header_only=True)
            if not isinstance(got, tuple) or got[0] >= t:
                break
            pos = got[1]
        self._pos = pos

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> EventLogReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --------------------------------------------------------- internals

    def _kvcap_records(self, until_s: float | None) -> Iterator[LogRecord]:
        # For a capture, the position is an index into its message records;
        # each pass re-reads the file, so a growing capture is followed too.
        assert self._kvcap is not None
        records = self._kvcap.load()
        self._truncated = self._kvcap.torn
        while self._pos < len(records):
            record = records[self._pos]
            if until_s is not None and record.recv_time_s > until_s:
                return
            self._pos += 1
            yield record

    def _extend_index(self) -> None:
        pos = self._indexed_to
        while True:
            got = self._read_at(pos, header_only=True)
            if not isinstance(got, tuple):
                break
            if self._indexed_count % _INDEX_EVERY == 0:
                self._index_times.append(got[0])
                self._index_offsets.append(pos)
            self._indexed_count += 1
            pos = got[1]
        self._indexed_to = pos

    def _read_at(self, pos: int, *, header_only: bool = False) -> Any:
        """Read the record at ``pos``.

        Returns ``(LogRecord, end)`` (or ``(recv_time_s, end)`` with
        ``header_only``), None at a clean end of file, False for a torn or
        damaged record.
        """
        f = self._file
        f.seek(pos)
        head = f.read(_REC.size)
        if not head:
            return None
        if len(head) < _REC.size:
            return False
        body_len, crc = _REC.unpack(head)
        if body_len < _BODY.size or body_len > _MAX_BODY:
            return False
        end = pos + _REC.size + body_len
        if header_only:
            fixed = f.read(_BODY.size)
            if len(fixed) < _BODY.size or f.seek(0, io.SEEK_END) < end:
                return False
            return _BODY.unpack(fixed)[0], end
        body = f.read(body_len)
        if len(body) < body_len or zlib.crc32(body) != crc:
            return False
        when, seq, worker_len, topic_len = _BODY.unpack_from(body)
        off = _BODY.size
        if off + worker_len + topic_len > body_len:
            return False
        try:
            worker = body[off : off + worker_len].decode()
        except UnicodeDecodeError:
            return False
        off += worker_len
        topic = body[off : off + topic_len]
        payload = body[off + topic_len :]
        return LogRecord(when, worker, seq, topic, payload), end


def _read_header(f: BinaryIO, path: Path) -> tuple[dict[str, Any], int, int]:
    magic = f.read(len(LOG_MAGIC))
    if magic != LOG_MAGIC:
        raise EventLogError(f"{path} is not a tokenspeed-router event log (magic {magic!r})")
    fixed = f.read(_HEAD.size)
    if len(fixed) < _HEAD.size:
        raise EventLogError(f"{path}: header is truncated")
    version, meta_len = _HEAD.unpack(fixed)
    if version != LOG_VERSION:
        raise EventLogError(f"{path}: unsupported event log version {version} (know {LOG_VERSION})")
    if meta_len > _MAX_META:
        raise EventLogError(f"{path}: header meta of {meta_len} bytes is implausible")
    meta_bytes = f.read(meta_len)
    crc_bytes = f.read(_CRC.size)
    if len(meta_bytes) < meta_len or len(crc_bytes) < _CRC.size:
        raise EventLogError(f"{path}: header is truncated")
    if zlib.crc32(magic + fixed + meta_bytes) != _CRC.unpack(crc_bytes)[0]:
        raise EventLogError(f"{path}: header checksum mismatch")
    try:
        meta = json.loads(meta_bytes)
    except ValueError as err:
        raise EventLogError(f"{path}: header meta is not JSON: {err}") from err
    if not isinstance(meta, dict):
        raise EventLogError(f"{path}: header meta must be a JSON object")
    return meta, version, len(magic) + _HEAD.size + meta_len + _CRC.size


def open_event_source(path: str | os.PathLike[str]) -> Iterator[LogRecord]:
    """Yield :class:`LogRecord` s from our log, a ``.kvcap`` file or a capture directory.

    * our log: its records in file order;
    * one ``.kvcap``: its message records in file order (worker = file stem,
      e.g. ``dp0``; replay end markers skipped);
    * a capture directory: per worker, live and replay records merged in seq
      order without duplicates (so the deliberate gap of ``dp1.sub.kvcap`` is
      filled from ``dp1.replay.kvcap``), workers interleaved by receive time.
      Replayed records keep their own (later) receive time.
    """
    p = Path(path)
    if p.is_dir():
        yield from capture_dir_records(p)
        return
    with open(p, "rb") as f:
        magic = f.read(8)
    if magic == KVCAP_MAGIC:
        yield from kvcap_log_records(p)
    elif magic == LOG_MAGIC:
        with EventLogReader(p) as reader:
            yield from reader.records()
    else:
        raise EventLogError(f"{p}: neither an event log nor a .kvcap capture (magic {magic!r})")
