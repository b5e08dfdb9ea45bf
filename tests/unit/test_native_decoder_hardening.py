"""What fuzzing and the audit of csrc/ found in the native decoders, each pinned by a test.

* msgpack_tokens read past the end of its input when an array's count fit the
  bytes left but its items were wider (fuzz/fuzz_msgpack.c, ASan): it must
  say "truncated", as msgspec does, and read nothing after the view it got.
* The raw decoder kept the payload offsets of bin ids as u32: an id after the
  first 4 GiB of a payload was remembered with the wrong bytes.
* set_media wrote the table it was handed as it parsed it: a call refused
  halfway left the raw decoder a half-new table.
* Pointer arithmetic past the end of a buffer is undefined (``p + 3 <= end``):
  csrc/ compares lengths (``end - p >= 3``) instead.
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import msgspec
import pytest

from tokenspeed_router.errors import WireError
from tokenspeed_router.events import KVEventBatch
from tokenspeed_router.events.schema import BlockStored
from tokenspeed_router.router.index import NATIVE_AVAILABLE, KvIndex
from tokenspeed_router.router.tiers import known_media

pytestmark = pytest.mark.skipif(not NATIVE_AVAILABLE, reason="the compiled core is not built")

if NATIVE_AVAILABLE:
    from tokenspeed_router import _native

CSRC = Path(__file__).resolve().parents[2] / "csrc"
REGRESSIONS = Path(__file__).resolve().parents[2] / "fuzz" / "regressions"


@pytest.mark.parametrize("raw", [
    b"\x92\xcc\x05",  # two items announced, the first takes both bytes left
    b"\x98\xcd\x13\xa8\xcd\x13\xa9\xcd\x13\xaa\xcd\x13\xae\xcd\x13\xaf",  # what the fuzzer found
    b"\xdc\x00\x03\xd1\x00\x01\xd1\x00\x02",
])
def test_msgpack_tokens_stops_at_the_end_of_its_view(raw: bytes) -> None:
    # the bytes after the view are valid items: reading them would change the verdict
    backing = bytearray(raw + b"\x01" * 16)
    with pytest.raises(ValueError, match=r"^Input data was truncated$"):
        _native.msgpack_tokens(memoryview(backing)[: len(raw)])
    with pytest.raises(msgspec.DecodeError, match="truncated"):
        msgspec.msgpack.decode(raw)


def test_msgpack_tokens_regression_inputs_are_refused() -> None:
    for path in sorted((REGRESSIONS / "msgpack").iterdir()):
        with pytest.raises(ValueError):
            _native.msgpack_tokens(path.read_bytes())


def _indexed() -> KvIndex:
    index = KvIndex(core="native")
    index.apply("w", KVEventBatch(1.0, [BlockStored(block_hashes=[1], parent_block_hash=None,
                                                     token_ids=[9, 9, 9, 9], block_size=4)]))
    return index


def test_empty_id_and_token_lists_in_raw_batches() -> None:
    """An empty list made the decoder compute NULL + 0 (UBSan, fuzz/regressions/ingest)."""
    index = _indexed()
    payload = msgspec.msgpack.encode([1.0, [["BlockRemoved", []], {"type": "BlockStored", "block_hashes": [2],
                                                                    "parent_block_hash": None, "token_ids": [],
                                                                    "block_size": 4}]])
    assert _native.scan_batch(payload) is None  # a prehashed store: the typed path's
    got = index.apply_raw("w", msgspec.msgpack.encode([1.0, [["BlockRemoved", []]]]))
    assert got is not None and got.stats.removed_blocks == 0
    for path in sorted((REGRESSIONS / "ingest").iterdir()):
        _native.scan_batch(path.read_bytes()[2:])  # the fuzz input's payload, after its two control bytes


def test_bin_ids_past_4_gib_keep_their_bytes() -> None:
    """A bin id whose offset in the payload does not fit 32 bits is remembered with its own bytes."""
    pad = (1 << 32) - 1  # the largest bin32: an unknown key the decoder skips without reading it
    head = (b"\x92" + msgspec.msgpack.encode(1.0) + b"\x91\x86"
            + msgspec.msgpack.encode("type") + msgspec.msgpack.encode("BlockStored")
            + msgspec.msgpack.encode("pad") + b"\xc6" + pad.to_bytes(4, "big"))
    tail = b"".join(msgspec.msgpack.encode(x) for x in (
        "block_hashes", [b"abc"], "parent_block_hash", None, "token_ids", [1, 2, 3, 4], "block_size", 4))
    size = len(head) + pad + len(tail)
    try:
        buf = mmap.mmap(-1, size)  # untouched pages cost nothing: two are written
    except (OSError, OverflowError, MemoryError) as err:
        pytest.skip(f"cannot map {size} bytes here: {err}")
    try:
        buf[: len(head)] = head
        buf[size - len(tail) :] = tail
        assert size - len(tail) > 1 << 32  # the id's bytes start past 4 GiB
        assert _native.scan_batch(buf) == 1.0
        index = _indexed()
        got = index.apply_raw("w", buf)  # type: ignore[arg-type]  # any buffer
        assert got is not None and got.stats.stored_blocks == 1
        ids = [h for batch in index.dump_events()["w"] for ev in batch.events for h in ev.block_hashes]
        assert sorted(ids, key=repr) == [1, b"abc"]
    finally:
        buf.close()


def test_a_refused_set_media_leaves_the_old_table_whole() -> None:
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [5], None, [7, 7, 7, 7], 4, None, "cpu"]]])
    assert _native.scan_batch(payload) == 1.0
    try:
        with pytest.raises(TypeError):
            _native.set_media([("zzz", 1), ("yyy", 2), (b"not a str", 4)])
        assert _native.scan_batch(payload) == 1.0, "the spelling 'cpu' was lost"
        index = _indexed()
        got = index.apply_raw("w", payload)
        assert got is not None and index.worker_info("w").cpu == 1
        with pytest.raises(ValueError):
            _native.set_media([("x", 1)] * 65)  # too many: refused before any change
        assert _native.scan_batch(payload) == 1.0
    finally:
        _native.set_media(sorted(known_media().items()))


def test_no_pointer_arithmetic_past_an_end_in_csrc() -> None:
    """``p + n <= end`` may form a pointer past the buffer (undefined): compare ``end - p`` instead."""
    bad = re.compile(r"\b\w+\s*\+\s*\w+\s*(<=|<|>|>=)\s*\w*end\b|\bend\w*\s*(<=|<|>|>=)\s*\w+\s*\+\s*\w+")
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted(CSRC.glob("*.[ch]"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert not found, found


@pytest.mark.parametrize("core", ["native", "reference"])
def test_a_block_size_beyond_64_bits_is_a_wire_error(core: str) -> None:
    """Found by fuzz_ingest: one block of 16 tokens with block_size 2**64 - 5 passed validation
    (a partial block) and the native core raised OverflowError out of apply, which the ingestor
    does not count as a malformed batch. Now both cores refuse it as malformed, unchanged."""
    index = KvIndex(core=core)
    index.apply("w", KVEventBatch(1.0, [BlockStored(block_hashes=[1], parent_block_hash=None,
                                                     token_ids=[9] * 16, block_size=16)]))
    before = index.snapshot()
    for bs in (2**63, 2**64 - 5):
        bad = BlockStored(block_hashes=[2], parent_block_hash=1, token_ids=list(range(16)), block_size=bs)
        with pytest.raises(WireError, match="block size"):
            index.apply("w", KVEventBatch(2.0, [bad]))
        with pytest.raises(WireError):
            index.apply("fresh", KVEventBatch(2.0, [bad]))
        assert index.snapshot() == before and index.workers() == ["w"]
    big = BlockStored(block_hashes=[3], parent_block_hash=1, token_ids=list(range(16)), block_size=2**63 - 1)
    index.apply("w", KVEventBatch(3.0, [big]))  # the largest the core holds: another grid, kept unmatchable
    assert index.worker_info("w").unmatchable == 1
