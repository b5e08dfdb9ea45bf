"""Golden: every record of every engine capture decodes to what its manifest says.

Captures come from the engines' own publisher code (``tests/data/captures/``).
For each folder we check the framing, the record and event counts per batch,
the block hash types and ranges, and that replaying the events rebuilds the
manifest's final cache state (chains of token ids) and query answers. Never
skipped: a missing captures folder is a failure (see ``support.data_dir``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tokenspeed_router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    LogRecord,
    decode_batch,
    encode_batch,
    open_event_source,
    read_kvcap,
)
from tokenspeed_router.events.frames import END_SEQ, decode_seq

FOLDERS = ["tokenspeed-0.1.1", "vllm-0.33.0", "vllm-0.33.0-bytes-hashes", "sglang-0.5.23"]

#: (hash kind, event encoding, replay frames after the DEALER delimiter)
EXPECTED_SHAPE = {
    "tokenspeed-0.1.1": ("u64", "array", 2),
    "vllm-0.33.0": ("u64", "map", 3),
    "vllm-0.33.0-bytes-hashes": ("bytes", "map", 3),
    "sglang-0.5.23": ("i64", "map", 3),
}


def _manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "manifest.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(params=FOLDERS)
def folder(request: pytest.FixtureRequest, captures: Path) -> Path:
    path = captures / request.param
    assert path.is_dir(), f"capture folder {path} is missing"
    return path


def test_all_capture_folders_are_covered(captures: Path) -> None:
    found = sorted(p.name for p in captures.iterdir() if (p / "manifest.json").is_file())
    assert found == sorted(FOLDERS)


def test_files_framing_and_seqs(folder: Path) -> None:
    manifest = _manifest(folder)
    topic = manifest["topic"].encode()
    _, _, replay_len = EXPECTED_SHAPE[folder.name]
    for name, description in manifest["files"].items():
        records = list(read_kvcap(folder / name))
        assert len(records) == int(description.split()[0]), name
    for worker, seqs in manifest["live_seqs_received"].items():
        live = list(read_kvcap(folder / f"{worker}.sub.kvcap"))
        assert all(len(r.frames) == 3 and r.frames[0] == topic for r in live)
        assert [decode_seq(r.frames[1]) for r in live] == seqs
    replay = list(read_kvcap(folder / "dp1.replay.kvcap"))
    assert all(r.frames[0] == b"" and len(r.frames) == 1 + replay_len for r in replay)
    *body, end = replay
    assert END_SEQ in end.frames and end.frames[-1] == b""
    missing = manifest["dp1_gap_missing_seqs"]
    request_hex = manifest["replay_request_frames_hex"]
    assert bytes.fromhex(request_hex[1]) == missing[0].to_bytes(8, "big")
    replay_seqs = [decode_seq(r.frames[-2]) for r in body]
    assert replay_seqs[: len(missing)] == missing
    if replay_len == 3:
        assert all(r.frames[1] == topic for r in body)


def _batches_per_rank(folder: Path) -> dict[str, list[tuple[LogRecord, KVEventBatch]]]:
    out: dict[str, list[tuple[LogRecord, KVEventBatch]]] = {}
    for rec in open_event_source(folder):
        out.setdefault(rec.worker, []).append((rec, decode_batch(rec.payload)))
    return out


def test_event_counts_match_scenario(folder: Path) -> None:
    manifest = _manifest(folder)
    per_rank = _batches_per_rank(folder)
    for rank in (0, 1):
        worker = f"dp{rank}"
        steps = [
            s["events"] for s in manifest["scenario"] if s["rank"] == rank and s["events"] != 0
        ]
        got = per_rank[worker]
        assert [rec.seq for rec, _ in got] == list(range(len(steps)))
        assert [[type(e).__name__ for e in b.events] for _, b in got] == steps
        assert all(b.data_parallel_rank == rank for _, b in got)


def test_hash_types_and_encoding(folder: Path) -> None:
    kind, encoding, _ = EXPECTED_SHAPE[folder.name]
    hashes: list[object] = []
    raw = msgspec.msgpack.Decoder()
    for _, batches in _batches_per_rank(folder).items():
        for rec, batch in batches:
            for item in raw.decode(rec.payload)[1]:
                assert isinstance(item, list if encoding == "array" else dict)
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    hashes.extend(ev.block_hashes)
                    if ev.parent_block_hash is not None:
                        hashes.append(ev.parent_block_hash)
                    assert ev.block_size == 16
                elif isinstance(ev, BlockRemoved):
                    hashes.extend(ev.block_hashes)
    assert hashes
    if kind == "bytes":
        assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
        return
    assert all(isinstance(h, int) and not isinstance(h, bool) for h in hashes)
    ints = [h for h in hashes if isinstance(h, int)]
    if kind == "u64":
        assert all(0 <= h < 2**64 for h in ints)
        if folder.name.startswith("tokenspeed"):
            assert any(h >= 2**63 for h in ints), "TokenSpeed FNV hashes span the u64 range"
    else:
        assert all(-(2**63) <= h < 2**63 for h in ints)
        assert any(h < 0 for h in ints), "SGLang publishes signed int64"


class _ReferenceCache:
    """Brute-force model of one worker's cache, keyed by the engine's block hash."""

    def __init__(self) -> None:
        self.blocks: dict[object, tuple[object | None, tuple[int, ...]]] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                assert parent is None or parent in self.blocks, f"unknown parent {parent!r}"
                size = ev.block_size
                for i, h in enumerate(ev.block_hashes):
                    self.blocks[h] = (parent, tuple(ev.token_ids[i * size : (i + 1) * size]))
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self.blocks.pop(h, None)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.blocks.clear()

    def chain(self, h: object) -> list[list[int]]:
        out: list[list[int]] = []
        cur: object | None = h
        while cur is not None:
            parent, tokens = self.blocks[cur]
            out.append(list(tokens))
            cur = parent
        return out[::-1]

    def leaves(self, block_size: int) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
        parents = {p for p, _ in self.blocks.values()}
        full: list[list[list[int]]] = []
        partial: list[list[list[int]]] = []
        for h, (_, tokens) in self.blocks.items():
            if h in parents:
                continue
            (full if len(tokens) == block_size else partial).append(self.chain(h))
        return sorted(full), sorted(partial)

    def matched_blocks(self, tokens: list[int], block_size: int) -> int:
        held = {tuple(t for block in self.chain(h) for t in block) for h in self.blocks}
        n = 0
        while (n + 1) * block_size <= len(tokens) and tuple(tokens[: (n + 1) * block_size]) in held:
            n += 1
        return n


def test_final_state_and_queries_from_events(folder: Path) -> None:
    manifest = _manifest(folder)
    block_size = manifest["block_size"]
    caches: dict[str, _ReferenceCache] = {}
    for worker, batches in _batches_per_rank(folder).items():
        cache = caches.setdefault(worker, _ReferenceCache())
        for _, batch in batches:
            cache.apply(batch)
    for worker, expected in manifest["expected_final_state"].items():
        full, partial = caches[worker].leaves(block_size)
        assert full == sorted(expected["cached_prefixes"]), worker
        assert partial == sorted(expected["partial_tail_chains"]), worker
        assert len(caches[worker].blocks) == expected["num_blocks"], worker
    for query in manifest["queries"]:
        got = {w: c.matched_blocks(query["tokens"], block_size) for w, c in caches.items()}
        assert got == query["matched_blocks"], query["description"]


def test_reencoding(folder: Path) -> None:
    """Our encoder: TokenSpeed arrays come out byte-identical; maps decode the same."""
    _, encoding, _ = EXPECTED_SHAPE[folder.name]
    for rec in open_event_source(folder):
        batch = decode_batch(rec.payload)
        for wire_format in ("map", "array"):
            again = encode_batch(batch, wire_format)
            assert decode_batch(again) == batch
            if wire_format == encoding == "array":
                assert again == rec.payload


# Golden bytes of our own encoder: a byte diff catches wire breaks round trips miss.
_GOLDEN_BATCH = KVEventBatch(
    1700000000.5,
    [
        BlockStored([2**64 - 1, -5], None, list(range(20)), 16, medium="GPU"),
        BlockStored([b"\x01" * 4], 7, [1, 2], 16, lora_id=3, lora_name="l"),
        BlockRemoved([9], medium="CPU"),
        AllBlocksCleared(),
    ],
    2,
)
_GOLDEN_HEX = {
    "map": (
        "93cb41d954fc402000009488a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368"
        "657392cffffffffffffffffffbb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69"
        "6473dc0014000102030405060708090a0b0c0d0e0f10111213aa626c6f636b5f73697a6510a76c6f"
        "72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c088a474797065ab426c6f636b"
        "53746f726564ac626c6f636b5f68617368657391c40401010101b1706172656e745f626c6f636b5f"
        "6861736807a9746f6b656e5f696473920102aa626c6f636b5f73697a6510a76c6f72615f696403a6"
        "6d656469756dc0a96c6f72615f6e616d65a16c83a474797065ac426c6f636b52656d6f766564ac62"
        "6c6f636b5f6861736865739109a66d656469756da343505581a474797065b0416c6c426c6f636b73"
        "436c656172656402"
    ),
    "array": (
        "93cb41d954fc402000009497ab426c6f636b53746f72656492cffffffffffffffffffbc0dc001400"
        "0102030405060708090a0b0c0d0e0f1011121310c0a347505598ab426c6f636b53746f72656491c4"
        "0401010101079201021003c0a16c93ac426c6f636b52656d6f7665649109a343505591b0416c6c42"
        "6c6f636b73436c656172656402"
    ),
}


@pytest.mark.parametrize("wire_format", ["map", "array"])
def test_golden_bytes_of_our_encoder(wire_format: str) -> None:
    payload = encode_batch(_GOLDEN_BATCH, wire_format)  # type: ignore[arg-type]
    assert payload.hex() == _GOLDEN_HEX[wire_format]
    assert decode_batch(payload) == _GOLDEN_BATCH
