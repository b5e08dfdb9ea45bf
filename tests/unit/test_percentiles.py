"""The one percentile helper: nearest rank, NaN for nothing, lists and arrays alike."""

import math

import numpy as np

from tokenspeed_router.percentiles import percentile


def test_nearest_rank_is_always_a_sample() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 99) == 5.0
    assert percentile(list(range(1, 101)), 99) == 99.0  # the worst-but-one of 100


def test_empty_is_nan_and_arrays_work() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile(np.array([3, 1, 2]), 50) == 2.0
