"""The raw ingest path (csrc/ingest_decode.c) against the typed one (events/codec.py + KvIndex.apply).

Two IndexIngestors over two native indexes take the same items; one may
apply payloads undecoded (``apply_raw``), the other only decodes. Whatever
the wire form (tagged maps, tagged arrays, mixed; int, negative and bytes
ids; media spellings; LoRA, salts and extra keys that send it back to the
typed path; other block grids; unknown parents and salvage), every counter,
state and index table must come out the same. Malformed payloads must never
be taken by the raw path (``scan_batch`` None) nor crash it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenspeed_router.errors import WireError
from tokenspeed_router.events.codec import decode_batch
from tokenspeed_router.events.kvcap import read_kvcap
from tokenspeed_router.events.subscriber import (
    BatchReceived,
    PublisherRestarted,
    ResyncNeeded,
    SubscriberItem,
)
from tokenspeed_router.router.index import NATIVE_AVAILABLE, KvIndex
from tokenspeed_router.router.ingest import IndexIngestor

pytestmark = pytest.mark.skipif(not NATIVE_AVAILABLE, reason="the compiled core is not built")

if NATIVE_AVAILABLE:
    from tokenspeed_router import _native

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CAPTURES = Path(__file__).resolve().parents[1] / "data" / "captures"
BS = 4

_ids = st.one_of(
    st.integers(min_value=0, max_value=24),
    st.integers(min_value=2**63, max_value=2**63 + 3),
    st.integers(min_value=-3, max_value=-1),
    st.sampled_from([b"a", b"b", b"c" * 32, b"d" * 32]),
)
_media = st.sampled_from([None, None, None, "GPU", "cpu", " Disk ", "CPU_PINNED", "weird", "\uff27PU", 7])
_tokens = st.integers(min_value=0, max_value=40) | st.sampled_from([2**40, 2**63 + 5, -1])


@st.composite
def _stored(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(min_value=1, max_value=4))
    bs = draw(st.sampled_from([BS, BS, BS, BS, 2 * BS, 0]))
    full = n * bs
    num = draw(st.sampled_from([full, full, full, max(0, full - 1), full + 1, (n - 1) * bs + 1]))
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": draw(st.lists(_ids, min_size=n, max_size=n)),
        "parent_block_hash": draw(st.none() | st.integers(min_value=0, max_value=5) | _ids),
        "token_ids": draw(st.lists(_tokens, min_size=num, max_size=num)),
        "block_size": bs,
    }
    for key, values in (("lora_id", st.none() | st.just(3)), ("medium", _media),
                        ("cache_salt", st.none() | st.just("s")), ("extra_keys", st.none() | st.just([1]))):
        if draw(st.booleans()):
            ev[key] = draw(st.sampled_from([None, None, None]) | values)
    if draw(st.integers(0, 9)) == 0:
        ev["future_field"] = draw(st.sampled_from([1, [1, {"a": b"x"}], None]))
    return ev


def _removed(hashes: list[Any], medium: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes}
    if medium is not None:
        ev["medium"] = medium
    return ev


_events = st.one_of(
    _stored(), _stored(), _stored(),
    st.builds(_removed, st.lists(_ids, min_size=1, max_size=4), _media),
    st.builds(lambda m: {"type": "AllBlocksCleared", **({"medium": m} if m is not None else {})},
              st.sampled_from([None, None, "cpu", "GPU"])),
)

_ORDER = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "block_mm_infos", "cache_salt"],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": ["medium"],
}


def _as_array(ev: dict[str, Any]) -> list[Any]:
    fields = [ev.get(k) for k in _ORDER[ev["type"]]]
    floor = 4 if ev["type"] == "BlockStored" else 0
    while len(fields) > floor and fields[-1] is None:
        fields.pop()
    return [ev["type"], *fields]


@st.composite
def _payload(draw: st.DrawFn) -> bytes:
    events = draw(st.lists(_events, max_size=4))
    form = draw(st.sampled_from(["map", "array", "mixed"]))
    wire = [
        _as_array(ev) if form == "array" or (form == "mixed" and draw(st.booleans())) else ev
        for ev in events
    ]
    ts = draw(st.sampled_from([1.5, 2.0, 3]))
    tail = draw(st.sampled_from([[], [None], [0], [2]]))
    return msgspec.msgpack.encode([ts, wire, *tail])


#: every example starts from a worker that holds blocks 0..3 (ids the generated parents name)
_PRELUDE = msgspec.msgpack.encode([1.0, [{
    "type": "BlockStored", "block_hashes": [0, 1, 2, 3], "parent_block_hash": None,
    "token_ids": list(range(4 * BS)), "block_size": BS,
}]])


def _pair() -> tuple[IndexIngestor, IndexIngestor]:
    clock = lambda: 0.0  # noqa: E731 -- state_since_s must not differ between the two
    pair = (IndexIngestor(KvIndex(core="native"), raw=False, clock=clock),
            IndexIngestor(KvIndex(core="native"), clock=clock))
    for worker in ("w", "dp0", "dp1"):
        _feed(pair, worker, -1, _PRELUDE)
    return pair


def _feed(ingestors: tuple[IndexIngestor, IndexIngestor], worker: str, seq: int, payload: bytes) -> bool:
    """Both take the item (when the typed decoder accepts it); False when it is malformed."""
    try:
        batch = decode_batch(payload)
    except WireError:
        assert _native.scan_batch(payload) is None
        return False
    ts = _native.scan_batch(payload)
    assert ts is None or ts == batch.ts
    item = BatchReceived(worker, seq, batch, payload, b"", 10.0, 0, False)
    outcomes = []
    for ing in ingestors:
        try:
            ing.on_item(item)
            outcomes.append(None)
        except Exception as err:  # e.g. a value the core refuses: both must refuse it alike
            outcomes.append(type(err))
    assert outcomes[0] == outcomes[1]
    return True


def _same(ingestors: tuple[IndexIngestor, IndexIngestor]) -> None:
    typed, raw = ingestors
    assert raw.statuses() == typed.statuses()
    a, b = typed._index, raw._index  # the two KvIndex objects (IngestTarget)
    assert isinstance(a, KvIndex) and isinstance(b, KvIndex)
    assert b.statistics() == a.statistics()
    assert b.snapshot() == a.snapshot()


@SETTINGS
@given(st.lists(_payload(), min_size=1, max_size=10))
def test_raw_and_typed_ingest_agree(payloads: list[bytes]) -> None:
    pair = _pair()
    for seq, payload in enumerate(payloads):
        _feed(pair, "w", seq, payload)
        _same(pair)


@SETTINGS
@given(st.lists(_payload(), min_size=1, max_size=6), st.data())
def test_corrupted_payloads_are_never_taken_raw(payloads: list[bytes], data: st.DataObject) -> None:
    pair = _pair()
    for seq, payload in enumerate(payloads):
        if payload and data.draw(st.booleans()):
            buf = bytearray(payload)
            for _ in range(data.draw(st.integers(1, 3))):
                i = data.draw(st.integers(0, len(buf) - 1))
                buf[i] = data.draw(st.integers(0, 255))
            if data.draw(st.booleans()):
                buf = buf[: data.draw(st.integers(0, len(buf)))]
            payload = bytes(buf)
        _feed(pair, "w", seq, payload)
        _same(pair)


_workers = st.sampled_from(["w", "dp0", "dp1"])
_item_specs = st.one_of(
    st.tuples(st.just("batch"), _workers, _payload()),
    st.tuples(st.just("batch"), _workers, _payload()),
    st.tuples(st.just("batch"), _workers, _payload()),
    st.tuples(st.just("resync"), _workers, st.none()),
    st.tuples(st.just("restart"), _workers, st.none()),
)


@SETTINGS
@given(st.lists(_item_specs, min_size=1, max_size=16), st.data())
def test_runs_folded_in_one_call_agree_with_one_by_one(specs: list[tuple[str, str, Any]], data: st.DataObject) -> None:
    """IndexIngestor.on_items (runs of batches in one apply_raw_many) == the typed path, item by item."""
    typed, raw = _pair()
    items: list[SubscriberItem] = []
    for seq, (kind, worker, payload) in enumerate(specs):
        if kind == "resync":
            items.append(ResyncNeeded(worker, seq, seq + 1, "test", 0))
        elif kind == "restart":
            items.append(PublisherRestarted(worker, seq, 0, 1))
        else:
            try:
                batch = decode_batch(payload)
            except WireError:
                continue  # never delivered (the subscriber skips it)
            items.append(BatchReceived(worker, seq, batch, payload, b"", 10.0, 0, False))
    start = 0
    while start < len(items):
        end = start + data.draw(st.integers(1, len(items) - start))
        chunk = items[start:end]
        typed_failed = []
        for item in chunk:
            try:
                typed.on_item(item)
            except Exception as err:
                typed_failed.append((item, type(err)))
        raw_failed = [(item, type(err)) for item, err in raw.on_items(chunk)]
        assert raw_failed == typed_failed
        _same((typed, raw))
        start = end


@pytest.mark.parametrize("engine", sorted(p.name for p in CAPTURES.iterdir() if p.is_dir()))
def test_engine_captures_take_the_raw_path_with_the_same_result(engine: str) -> None:
    pair = _pair()
    taken = 0
    for name in ("dp0.sub.kvcap", "dp1.sub.kvcap"):
        worker = name.split(".")[0]
        for seq, record in enumerate(read_kvcap(CAPTURES / engine / name)):
            payload = record.frames[-1]
            taken += _native.scan_batch(payload) is not None
            assert _feed(pair, worker, seq, payload)
    _same(pair)
    assert taken > 0 and pair[1].raw_batches > 0  # the engines' own batches are the fast case
