"""The compiled content hash is bit-identical to the pure-Python definition (HASH_VERSION 1)."""

from __future__ import annotations

import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed_router.errors import WireError
from tokenspeed_router.hashing import block_hashes, reference_block_hashes, root_seed

native = pytest.importorskip("tokenspeed_router._native")

TOKENS = st.lists(st.integers(0, 2**64 - 1), max_size=300)
SEEDS = st.one_of(st.just(root_seed()), st.integers(0, 2**64 - 1))


@settings(max_examples=300, deadline=None)
@given(tokens=TOKENS, block_size=st.integers(1, 40), seed=SEEDS)
def test_native_chain_equals_reference(tokens: list[int], block_size: int, seed: int) -> None:
    want = reference_block_hashes(tokens, block_size, seed)
    assert native.hash_blocks(tokens, block_size, seed) == want
    assert native.hash_blocks(tuple(tokens), block_size, seed) == want
    assert native.hash_blocks(array.array("Q", tokens), block_size, seed) == want
    assert native.hash_blocks(np.array(tokens, dtype=np.uint64), block_size, seed) == want


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), max_size=200), block_size=st.integers(1, 20))
def test_every_integer_buffer_hashes_alike(tokens: list[int], block_size: int) -> None:
    want = reference_block_hashes(tokens, block_size, root_seed(3, "t"))
    for dtype in (np.int64, np.int32, np.uint32):
        got = native.hash_blocks(np.array(tokens, dtype=dtype), block_size, root_seed(3, "t"))
        assert got == want, dtype
    assert block_hashes(tokens, block_size, lora_id=3, salt="t") == want


def test_bad_tokens_are_refused() -> None:
    for bad in ([-1, 2], [2**64], [0.5], b"abcdefgh", np.array([1.5, 2.0]), np.array([-3], dtype=np.int64)):
        with pytest.raises((TypeError, OverflowError, ValueError)):
            native.hash_blocks(bad, 1, 0)
    with pytest.raises(WireError):
        block_hashes([-1, 2], 1)
