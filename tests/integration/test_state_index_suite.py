"""The index behaviour suite, run against every state backend.

``backend`` is (a) a plain in-memory KvIndex fed directly (on the native core, and again on
the pure-Python reference core), and (b) an index
fed through the Redis stream: a leader replica appends each batch, a second
replica applies it from the stream, and the queries go to that second
replica (the leader's own index is checked to agree). The same checks must
give the same answers on both.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import wait_until
from support.state_harness import make_config

from tokenspeed_router.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from tokenspeed_router.events.log import open_event_source
from tokenspeed_router.events.subscriber import BatchReceived
from tokenspeed_router.router import index as index_module
from tokenspeed_router.router.index import KvIndex
from tokenspeed_router.router.ingest import IndexIngestor
from tokenspeed_router.state import LocalIndexHost, RedisStateReplica

TOKENS = list(range(1000, 1064))  # 16 blocks of 4


class MemoryBackend:
    """In-memory: items applied straight to the index through the ingestor."""

    def __init__(self) -> None:
        self.host = LocalIndexHost()
        self._seq: dict[str, int] = {}

    def apply(self, worker: str, *events: Any, payload: bytes | None = None) -> None:
        batch = KVEventBatch(time.time(), list(events))
        data = payload if payload is not None else encode_batch(batch)
        seq = self._seq[worker] = self._seq.get(worker, -1) + 1
        self.submit(BatchReceived(worker, seq, decode_batch(data), data, b"", time.time(), 0, False))

    def submit(self, item: BatchReceived) -> None:
        self.host.apply_item(item)

    def sync(self) -> None:
        pass

    def match(self, tokens: list[int], **kw: Any) -> dict[str, int]:
        self.sync()
        with self.host.locked():
            return self.host.index.match(tokens, **kw)

    def detail(self, tokens: list[int], **kw: Any) -> Any:
        self.sync()
        with self.host.locked():
            return self.host.index.match_detail(tokens, **kw)

    def num_blocks(self, worker: str | None = None) -> int:
        self.sync()
        with self.host.locked():
            return self.host.index.num_blocks(worker)

    def state(self, worker: str) -> str:
        self.sync()
        with self.host.locked():
            return str(self.host.ingestor.status(worker).state.value)

    def close(self) -> None:
        pass


class RedisBackend(MemoryBackend):
    """Through Redis: the leader appends, a follower replica applies from the stream."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.leader = RedisStateReplica(make_config(url, "leader"), LocalIndexHost())
        self.leader.start()
        wait_until(lambda: self.leader.is_leader, 15, what="the lease")
        self.follower = RedisStateReplica(make_config(url, "follower"), self.host)
        self.follower.start()

    def submit(self, item: BatchReceived) -> None:
        self.leader.submit(item)

    def sync(self) -> None:
        want = {w: s for w, s in self._seq.items()}

        def applied(replica: RedisStateReplica) -> bool:
            positions = replica.applier.positions_copy()
            return all(positions.get(w, (0, -1))[1] >= s for w, s in want.items())

        wait_until(lambda: applied(self.follower) and applied(self.leader), 15,
                   what=f"the stream to deliver {want}")

    def match(self, tokens: list[int], **kw: Any) -> dict[str, int]:
        answer = super().match(tokens, **kw)
        leader_host = self.leader.host
        with leader_host.locked():
            assert leader_host.index.match(tokens, **kw) == answer  # the leader agrees
        return answer

    def close(self) -> None:
        self.follower.close()
        self.leader.close()


@pytest.fixture(params=["memory", "memory-reference-core", "redis"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryBackend]:
    made: MemoryBackend
    if request.param == "memory-reference-core":
        # the same suite on the pure-Python reference index core
        monkeypatch.setattr(index_module, "_DEFAULT_CORE", "reference")
        made = MemoryBackend()
        assert made.host.index.implementation == "reference"
    elif request.param == "memory":
        made = MemoryBackend()
    else:
        made = RedisBackend(request.getfixturevalue("redis_url"))
    yield made
    made.close()


def _stored(hashes: list[BlockHash], parent: int | None, start_block: int, **kw: Any) -> BlockStored:
    tokens = TOKENS[start_block * 4 : (start_block + len(hashes)) * 4]
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=4, **kw)


def test_store_and_match_leading_blocks(backend: MemoryBackend) -> None:
    backend.apply("w0", _stored([1, 2, 3], None, 0))
    backend.apply("w1", _stored([11], None, 0), _stored([12], 11, 1))
    assert backend.match(TOKENS) == {"w0": 3, "w1": 2}
    assert backend.match(TOKENS[:7]) == {"w0": 1, "w1": 1}  # a partial block never matches
    assert backend.match([5, 6, 7, 8]) == {"w0": 0, "w1": 0}  # every known worker is listed
    assert backend.num_blocks() == 5


def test_remove_stops_the_match(backend: MemoryBackend) -> None:
    backend.apply("w0", _stored([1, 2, 3, 4], None, 0))
    backend.apply("w0", BlockRemoved(block_hashes=[4]))
    assert backend.match(TOKENS) == {"w0": 3}
    backend.apply("w0", BlockRemoved(block_hashes=[2]))
    assert backend.match(TOKENS)["w0"] == 1


def test_clear_drops_only_that_worker(backend: MemoryBackend) -> None:
    backend.apply("w0", _stored([1, 2], None, 0))
    backend.apply("w1", _stored([7, 8], None, 0))
    backend.apply("w0", AllBlocksCleared())
    assert backend.match(TOKENS) == {"w0": 0, "w1": 2}
    assert backend.num_blocks("w0") == 0


def test_lora_and_tiers(backend: MemoryBackend) -> None:
    backend.apply("w0", _stored([1, 2], None, 0, lora_id=5))
    backend.apply("w1", _stored([3, 4], None, 0, medium="CPU"))
    assert backend.match(TOKENS, lora_id=5) == {"w0": 2, "w1": 0}
    assert backend.match(TOKENS) == {"w0": 0, "w1": 2}
    detail = backend.detail(TOKENS)
    assert detail.tiers["w1"]["cpu"] == 2 and detail.scores == {"w0": 0, "w1": 2}


def test_unknown_parent_marks_worker_resyncing(backend: MemoryBackend) -> None:
    backend.apply("w0", _stored([1, 2], None, 0))
    backend.apply("w0", _stored([9], 999, 2))  # parent never stored: an event was lost
    assert backend.state("w0") == "resyncing"
    assert backend.match(TOKENS).get("w0", 0) <= 2


def _capture_queries(records: list[Any]) -> list[list[int]]:
    """Full token prefixes of every stored chain in a capture (parent chains followed)."""
    prefix: dict[Any, list[int]] = {}
    out: list[list[int]] = []
    for rec in records:
        for ev in decode_batch(rec.payload).events:
            if not isinstance(ev, BlockStored):
                continue
            base = prefix.get(ev.parent_block_hash, []) if ev.parent_block_hash is not None else []
            tokens = base + list(ev.token_ids)
            for i, h in enumerate(ev.block_hashes):
                prefix[h] = tokens[: len(base) + (i + 1) * ev.block_size]
            out.append(tokens)
    return out


@pytest.mark.parametrize("engine", ["vllm-0.33.0", "sglang-0.5.23", "tokenspeed-0.1.1"])
def test_golden_capture_answers(backend: MemoryBackend, captures: Path, engine: str) -> None:
    records = list(open_event_source(captures / engine))
    # the golden answers: a plain index rebuilt by log replay (a different path)
    golden_index = KvIndex()
    golden = IndexIngestor(golden_index)
    for rec in records:
        golden.on_record(rec.worker, rec.seq, decode_batch(rec.payload), rec.recv_time_s,
                         payload=rec.payload)
        backend._seq[rec.worker] = rec.seq - 1
        backend.apply(rec.worker, payload=rec.payload)
    queries = _capture_queries(records)
    assert queries
    expected = [golden_index.match(q) for q in queries]
    assert any(expected)
    assert [backend.match(q) for q in queries] == expected
