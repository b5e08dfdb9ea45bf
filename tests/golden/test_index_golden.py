"""Golden: real engine captures, decoded and folded into KvIndex, give the manifest's answers.

Every capture folder in tests/data/captures (TokenSpeed, vLLM with int and bytes
hashes, SGLang) is read frame by frame (format in captures/README.md), the
dp1 gap (seqs 2, 3) is healed from the replay records, each worker's batches
are applied in seq order, and then every manifest query must give exactly
``matched_blocks`` and the final state must equal ``expected_final_state``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import captures_dir

from tokenspeed_router.events import decode_batch
from tokenspeed_router.events.kvcap import read_kvcap
from tokenspeed_router.router.index import KvIndex

_END = b"\xff" * 8
CAPTURES = sorted(p.name for p in captures_dir().iterdir() if (p / "manifest.json").is_file())


def _records(path: Path) -> list[tuple[int, bytes]]:
    """(seq, payload) of every message in a .kvcap file, end markers dropped."""
    out = []
    for rec in read_kvcap(path):
        frames = list(rec.frames)
        if len(frames) == 4 and frames[0] == b"":  # DEALER: "", topic, seq, payload
            frames = frames[1:]
        elif len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8:  # TokenSpeed replay
            frames = [b"", frames[1], frames[2]]
        assert len(frames) == 3, f"{path.name}: unexpected record of {len(frames)} frames"
        _topic, seq, payload = frames
        if seq == _END:
            continue
        out.append((int.from_bytes(seq, "big"), payload))
    return out


def _worker_batches(folder: Path, manifest: dict[str, Any]) -> dict[str, list[tuple[int, bytes]]]:
    per: dict[str, dict[int, bytes]] = {}
    for file in sorted(folder.glob("*.kvcap")):
        worker = file.name.split(".", 1)[0]
        for seq, payload in _records(file):
            per.setdefault(worker, {}).setdefault(seq, payload)
    # the gap must have been healed: dp1 holds every seq up to its last one
    missing = manifest["dp1_gap_missing_seqs"]
    assert set(missing) <= set(per["dp1"]), "replay records must fill the dp1 gap"
    for worker, seqs in per.items():
        assert sorted(seqs) == list(range(max(seqs) + 1)), f"{worker}: seqs not contiguous"
    return {w: sorted(seqs.items()) for w, seqs in per.items()}


def _build(name: str) -> tuple[KvIndex, dict[str, Any]]:
    folder = captures_dir() / name
    manifest = json.loads((folder / "manifest.json").read_text())
    index = KvIndex()
    for worker, records in _worker_batches(folder, manifest).items():
        for _seq, payload in records:
            index.apply(worker, decode_batch(payload))
    return index, manifest


@pytest.mark.parametrize("capture", CAPTURES)
def test_capture_queries_match_manifest(capture: str) -> None:
    index, manifest = _build(capture)
    assert len(CAPTURES) == 4
    for query in manifest["queries"]:
        expected = query["matched_blocks"]  # every worker, zeros included (DESIGN §5)
        got = index.match(query["tokens"])
        assert got == expected, f"{capture}: {query['description']}"
        detail = index.match_detail(query["tokens"])
        assert detail.scores == expected
        assert detail.tiers.keys() == detail.block_size.keys() == expected.keys()
        for worker, score in detail.scores.items():
            assert sum(detail.tiers[worker].values()) == score
            assert detail.block_size[worker] == manifest["block_size"]
        best = max(got.values(), default=0)
        assert sorted(w for w, n in got.items() if n == best and best) == sorted(query["best_workers"])


@pytest.mark.parametrize("capture", CAPTURES)
def test_capture_final_state(capture: str) -> None:
    index, manifest = _build(capture)
    bs = manifest["block_size"]
    stats = index.statistics()
    assert stats["unknown_parents"] == 0
    for worker, state in manifest["expected_final_state"].items():
        assert index.num_blocks(worker) == state["num_blocks"], f"{capture}/{worker}"
        assert index.block_size_of(worker) == bs
        for chain in state["cached_prefixes"]:
            tokens = [t for block in chain for t in block]
            assert index.match(tokens).get(worker, 0) == len(chain)
            for k in range(1, len(chain)):
                assert index.match(tokens[: k * bs]).get(worker, 0) == k
        for chain in state["partial_tail_chains"]:
            assert len(chain[-1]) < bs
            tokens = [t for block in chain for t in block]
            # the partial tail is kept (counted in num_blocks) but never matched
            assert index.match(tokens).get(worker, 0) == len(chain) - 1


@pytest.mark.parametrize("capture", CAPTURES)
def test_capture_state_survives_snapshot_and_dump(capture: str) -> None:
    index, manifest = _build(capture)
    restored = KvIndex.restore(index.snapshot())
    rebuilt = KvIndex()
    for worker, batches in index.dump_events().items():
        for batch in batches:
            rebuilt.apply(worker, batch)
    for other in (restored, rebuilt):
        for worker in manifest["expected_final_state"]:
            assert other.num_blocks(worker) == index.num_blocks(worker)
        for query in manifest["queries"]:
            assert other.match_detail(query["tokens"]) == index.match_detail(query["tokens"])
