"""Nearest-rank percentiles: the one definition every report, metric and benchmark uses.

Nearest rank (the smallest value with at least ``p`` % of the samples at or
below it) is always one of the samples, so a p99 of 100 latencies is the
worst-but-one, never an interpolation between two runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["percentile"]


def percentile(values: Sequence[float] | np.ndarray, p: float) -> float:
    """The nearest-rank ``p``-th percentile (``p`` in 0..100); NaN when there are no values."""
    data = np.sort(np.asarray(values, dtype=np.float64), axis=None)
    if data.size == 0:
        return math.nan
    rank = math.ceil(p / 100.0 * data.size) - 1
    return float(data[max(0, min(data.size - 1, rank))])
