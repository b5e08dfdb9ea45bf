"""Event log format: round trip, torn tails, reading while writing, seeking, captures."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest

from tokenspeed_router.errors import EventLogError
from tokenspeed_router.events import (
    EventLogReader,
    EventLogWriter,
    LogRecord,
    decode_batch,
    open_event_source,
    read_kvcap,
)


def _records(n: int, t0: float = 1000.0) -> list[LogRecord]:
    return [
        LogRecord(t0 + i * 0.5, f"w{i % 3}", i, b"kv", bytes([i % 256]) * (i % 7 + 1))
        for i in range(n)
    ]


def _write(path: Path, records: list[LogRecord], meta: dict[str, object] | None = None) -> None:
    with EventLogWriter(path, meta=meta) as w:
        for r in records:
            w.append_record(r)


def test_round_trip_with_meta(tmp_path: Path) -> None:
    path = tmp_path / "a.tslog"
    recs = _records(50)
    _write(path, recs, meta={"workers": ["w0", "w1", "w2"]})
    with EventLogReader(path) as r:
        assert r.meta["workers"] == ["w0", "w1", "w2"]
        assert r.version == 1
        assert list(r) == recs
        assert not r.truncated
        assert r.start_time_s == 1000.0


def test_empty_log(tmp_path: Path) -> None:
    path = tmp_path / "empty.tslog"
    EventLogWriter(path).close()
    with EventLogReader(path) as r:
        assert list(r) == [] and not r.truncated and r.start_time_s is None
        r.seek_time(5.0)
        assert list(r.records()) == []


def test_truncated_tail_at_every_offset_of_last_record(tmp_path: Path) -> None:
    path = tmp_path / "full.tslog"
    recs = _records(4)
    _write(path, recs[:3], meta={"created_s": 1.0})
    prefix_size = path.stat().st_size
    _write(path, recs, meta={"created_s": 1.0})
    data = path.read_bytes()
    cut = tmp_path / "cut.tslog"
    for end in range(prefix_size, len(data)):
        cut.write_bytes(data[:end])
        with EventLogReader(cut) as r:
            got = list(r)
            assert got == recs[:3], end
            assert r.truncated == (end > prefix_size), end
    cut.write_bytes(data)
    with EventLogReader(cut) as r:
        assert list(r) == recs and not r.truncated


def test_corrupt_record_stops_the_read(tmp_path: Path) -> None:
    path = tmp_path / "c.tslog"
    recs = _records(5)
    _write(path, recs)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # flip a payload byte of the last record: CRC mismatch
    path.write_bytes(bytes(data))
    with EventLogReader(path) as r:
        assert list(r) == recs[:4]
        assert r.truncated


def test_bad_header(tmp_path: Path) -> None:
    path = tmp_path / "x.tslog"
    path.write_bytes(b"NOTALOG!" + b"\0" * 20)
    with pytest.raises(EventLogError, match="not a tokenspeed-router event log"):
        EventLogReader(path)
    _write(path, [])
    data = bytearray(path.read_bytes())
    data[8] = 99  # version
    path.write_bytes(bytes(data))
    with pytest.raises(EventLogError, match="unsupported event log version 99"):
        EventLogReader(path)


def test_read_while_writing(tmp_path: Path) -> None:
    path = tmp_path / "live.tslog"
    recs = _records(6)
    with EventLogWriter(path) as w, EventLogReader(path) as r:
        assert list(r.records()) == []
        w.append_record(recs[0])
        w.append_record(recs[1])
        w.flush()
        assert list(r.records()) == recs[:2]
        # A half-written record is "not yet", then read once complete.
        full = path.read_bytes()
        w.append_record(recs[2])
        w.flush()
        grown = path.read_bytes()
        with open(path, "r+b") as f:
            f.truncate(len(full) + (len(grown) - len(full)) // 2)
        assert list(r.records()) == [] and r.truncated
        with open(path, "r+b") as f:
            f.seek(0)
            f.write(grown)
        assert list(r.records()) == [recs[2]] and not r.truncated
        for rec in recs[3:]:
            w.append_record(rec)
        w.flush()
        assert list(r) == recs[3:]


def test_seek_time_and_until(tmp_path: Path) -> None:
    path = tmp_path / "s.tslog"
    recs = _records(1000)  # recv times 1000.0, 1000.5, ...
    _write(path, recs)
    with EventLogReader(path) as r:
        r.seek_time(1100.0)
        assert next(iter(r)).seq == 200
        r.seek_time(1100.2)
        assert next(iter(r)).seq == 201
        r.seek_time(0.0)
        assert next(iter(r)).seq == 0
        r.seek_time(10_000.0)
        assert list(r) == []
        r.rewind()
        upto = list(r.records(until_s=1002.0))
        assert [x.seq for x in upto] == [0, 1, 2, 3, 4]
        assert next(iter(r)).seq == 5  # resumes after the last yielded record


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    with EventLogWriter(tmp_path / "w.tslog") as w:
        with pytest.raises(EventLogError):
            w.append("w", -1, b"")
        with pytest.raises(EventLogError):
            w.append("w" * 70_000, 0, b"")
    with pytest.raises(EventLogError):
        w.append("w", 0, b"")
    with pytest.raises(EventLogError):
        EventLogWriter(tmp_path / "m.tslog", meta={"x": object()})


def test_read_kvcap_and_sources(captures: Path, tmp_path: Path) -> None:
    folder = captures / "tokenspeed-0.1.1"
    live = list(read_kvcap(folder / "dp1.sub.kvcap"))
    assert [len(r.frames) for r in live] == [3, 3, 3]
    replay = list(read_kvcap(folder / "dp1.replay.kvcap"))
    assert replay[-1].frames == (b"", b"\xff" * 8, b"")

    one = list(open_event_source(folder / "dp1.replay.kvcap"))
    assert [(r.worker, r.seq) for r in one] == [("dp1", 2), ("dp1", 3), ("dp1", 4)]

    merged = list(open_event_source(folder))
    by_worker: dict[str, list[int]] = {}
    for rec in merged:
        by_worker.setdefault(rec.worker, []).append(rec.seq)
        decode_batch(rec.payload)
    assert by_worker == {"dp0": [0, 1, 2, 3, 4, 5], "dp1": [0, 1, 2, 3, 4]}

    # A capture converted to our log reads back identically.
    log = tmp_path / "conv.tslog"
    _write(log, merged)
    assert list(open_event_source(log)) == merged

    # Torn capture: the intact prefix is read.
    torn = tmp_path / "dp0.sub.kvcap"
    data = (folder / "dp0.sub.kvcap").read_bytes()
    torn.write_bytes(data[:-5])
    assert [r.seq for r in open_event_source(torn)] == [0, 1, 2, 3, 4]


def test_open_event_source_rejects_unknown(tmp_path: Path, captures: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello world")
    with pytest.raises(EventLogError):
        list(open_event_source(junk))
    with pytest.raises(EventLogError):
        list(open_event_source(tmp_path))  # no .kvcap files
    with pytest.raises(EventLogError):
        list(read_kvcap(junk))
    shutil.copy(captures / "vllm-0.33.0" / "dp0.sub.kvcap", tmp_path / "dp7.sub.kvcap")
    assert {r.worker for r in open_event_source(tmp_path)} == {"dp7"}


def _kvcap_bytes(records: list[tuple[int, tuple[bytes, ...]]]) -> bytes:
    out = bytearray(b"KVCAPv1\n")
    for recv_ns, frames in records:
        out += struct.pack("<QI", recv_ns, len(frames))
        for frame in frames:
            out += struct.pack("<I", len(frame)) + frame
    return bytes(out)


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def test_event_log_reader_reads_kvcap(captures: Path, tmp_path: Path) -> None:
    for engine in ("tokenspeed-0.1.1", "vllm-0.33.0", "sglang-0.5.23"):
        for name in ("dp0.sub.kvcap", "dp1.sub.kvcap", "dp1.replay.kvcap"):
            path = captures / engine / name
            with EventLogReader(path) as r:
                got = list(r)
                assert got == list(open_event_source(path)), (engine, name)
                assert got and {rec.worker for rec in got} == {name.split(".")[0]}
                assert r.meta == {"format": "kvcap", "worker": name.split(".")[0]}
                assert not r.truncated
                assert r.start_time_s == got[0].recv_time_s
                for rec in got:
                    decode_batch(rec.payload)


def test_event_log_reader_kvcap_seek_until_and_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "dp3.sub.kvcap"
    records = [
        (1_000_000_000 * (10 + i), (b"kv", _seq(i), bytes([i]) * 5)) for i in range(6)
    ]
    junk = [(1_000_000_000 * 99, (b"just one frame",))]  # not a message: skipped
    data = _kvcap_bytes(records[:3] + junk + records[3:])
    path.write_bytes(data)
    with EventLogReader(path) as r:
        assert r.start_time_s == 10.0
        assert [rec.seq for rec in r.records(until_s=12.0)] == [0, 1, 2]
        assert [rec.seq for rec in r.records()] == [3, 4, 5]  # resumes
        assert list(r.records()) == []
        r.seek_time(13.5)
        assert [(rec.worker, rec.seq, rec.recv_time_s) for rec in r] == [
            ("dp3", 4, 14.0), ("dp3", 5, 15.0)
        ]
        r.rewind()
        assert [rec.payload for rec in r] == [bytes([i]) * 5 for i in range(6)]
        assert not r.truncated

    # A torn last record at every cut: the intact prefix, truncated=True.
    last_len = len(_kvcap_bytes(records[-1:])) - len(b"KVCAPv1\n")
    for cut in range(1, last_len):
        path.write_bytes(data[:-cut])
        with EventLogReader(path) as r:
            assert [rec.seq for rec in r] == [0, 1, 2, 3, 4], cut
            assert r.truncated, cut
    # ... and a capture that grows is followed on the next pass.
    path.write_bytes(data[:-1])
    with EventLogReader(path) as r:
        assert [rec.seq for rec in r] == [0, 1, 2, 3, 4] and r.truncated
        path.write_bytes(data)
        assert [rec.seq for rec in r] == [5] and not r.truncated

    empty = tmp_path / "dp0.sub.kvcap"
    empty.write_bytes(b"KVCAPv1\n")
    with EventLogReader(empty) as r:
        assert list(r) == [] and r.start_time_s is None and not r.truncated
