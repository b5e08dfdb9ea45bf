"""The index under its threading contract, on both cores: one writer, readers on other threads.

Readers (list and numpy queries, long enough to run without the GIL) run
while a writer applies stores, removals, clears and worker changes; every
answer must be one the index could give at some instant (a leading run of
what the writer ever stored), and nothing may crash or deadlock.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tokenspeed_router.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from tokenspeed_router.router.index import NATIVE_AVAILABLE, KvIndex

CORES = ["native", "reference"] if NATIVE_AVAILABLE else ["reference"]

BS = 16
CHAIN = 300  # blocks: 4,800 tokens, past the GIL-free threshold
TOKENS = list(range(7, 7 + CHAIN * BS))


@pytest.mark.parametrize("core", CORES)
def test_readers_run_while_one_writer_applies(core: str) -> None:
    index = KvIndex(core=core)
    ids = list(range(1, CHAIN + 1))
    stop = threading.Event()
    errors: list[BaseException] = []
    answers = [0]

    def writer() -> None:
        try:
            k = 0
            while not stop.is_set():
                name = f"w{k % 5}"
                index.apply(name, KVEventBatch(0.0, [
                    BlockStored(block_hashes=ids, parent_block_hash=None, token_ids=TOKENS, block_size=BS)]))
                index.apply(name, KVEventBatch(0.0, [BlockRemoved(block_hashes=ids[CHAIN // 2 :])]))
                if k % 7 == 0:
                    index.apply(name, KVEventBatch(0.0, [AllBlocksCleared()]))
                if k % 11 == 0:
                    index.remove_worker(f"w{(k + 2) % 5}")
                k += 1
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    def reader(as_numpy: bool) -> None:
        query = np.asarray(TOKENS, dtype=np.int64) if as_numpy else TOKENS
        try:
            while not stop.is_set():
                for name, blocks in index.match(query).items():
                    assert name.startswith("w") and 0 <= blocks <= CHAIN
                detail = index.match_detail(query)
                assert all(sum(t.values()) == detail.scores[w] for w, t in detail.tiers.items())
                answers[0] += 1
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=writer)] + [
        threading.Thread(target=reader, args=(flag,)) for flag in (True, False, True)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and not errors:
        threads[0].join(0.05)
    stop.set()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a thread is stuck"
    assert not errors, errors[0]
    assert answers[0] > 0
    # the final state is exact again once the writer stopped
    for name in index.workers():
        index.clear_worker(name)
    index.apply("w0", KVEventBatch(0.0, [
        BlockStored(block_hashes=ids, parent_block_hash=None, token_ids=TOKENS, block_size=BS)]))
    assert index.match(TOKENS)["w0"] == CHAIN
