"""Request traces with KV-block identity, and deterministic token synthesis.

The Mooncake FAST'25 traces (``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids``) publish no tokens: each ``hash_id`` names one
512-token block *together with its whole prefix*. Real caches and the real
index hash token ids, so every hash id is turned into a deterministic token
block: ``tokens(hash_id)[k] = mix(key, hash_id, k) % vocab_size`` with a
SplitMix64-style finaliser (vectorised in numpy). Equal ids give equal tokens,
different ids give different blocks with overwhelming probability, so prefix
sharing in the trace becomes prefix sharing of token ids, at *any* simulated
page size (a 512-token trace block is 32 pages of 16). A partial last block
keeps the first ``input_length - 512 * (n - 1)`` tokens of its block.

Why a keyed hash rather than ``random.Random(hash_id)``: no generator object
per block (288k blocks per trace), no global state, and the key lets two runs
use disjoint vocabularies on purpose.
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

import numpy as np

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.percentiles import percentile

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "TokenSynthesizer",
    "TraceRequest",
    "TraceWindow",
    "ideal_load",
    "load_mooncake",
    "parse_mooncake",
    "mooncake_line",
    "sample_prefix_groups",
    "trace_summary",
    "write_mooncake",
]

#: Tokens per hash id in the Mooncake release.
MOONCAKE_BLOCK_TOKENS = 512
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival time, lengths and prefix-block identity.

    ``hash_ids`` are prefix-chained block ids of ``block_tokens`` tokens each;
    the last one may cover fewer tokens (``input_length`` decides).
    """

    request_id: str
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def block_length(self, i: int) -> int:
        """Tokens covered by block ``i`` (the last may be partial)."""
        n = len(self.hash_ids)
        if i < n - 1:
            return self.block_tokens
        return max(0, min(self.block_tokens, self.input_length - self.block_tokens * (n - 1)))


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceWindow:
    """Which part of a trace to replay, and how fast.

    ``rate_scale`` multiplies the arrival rate (2.0 = inter-arrival times
    halved), so offered load is set by time-scaling the trace rather than by
    changing the prefill rate (research/workloads.md §3.3). ``start_s`` and
    ``duration_s`` are in the trace's own time (before scaling); arrivals are
    re-based so the window starts at 0.
    """

    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    rate_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.rate_scale <= 0:
            raise ConfigError(f"rate_scale must be > 0, got {self.rate_scale}")
        if self.start_s < 0:
            raise ConfigError(f"start_s must be >= 0, got {self.start_s}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ConfigError(f"duration_s must be > 0, got {self.duration_s}")
        if self.max_requests is not None and self.max_requests <= 0:
            raise ConfigError(f"max_requests must be > 0, got {self.max_requests}")


def parse_mooncake(
    lines: Iterable[str],
    window: TraceWindow | None = None,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    source: str = "trace",
) -> list[TraceRequest]:
    """Parse Mooncake JSON lines into requests, applying ``window``.

    Checks the invariant ``len(hash_ids) == ceil(input_length / block_tokens)``
    and raises :class:`ConfigError` naming the line when it fails, because a
    mismatched block size silently corrupts every hit ratio downstream.
    """
    window = window or TraceWindow()
    out: list[TraceRequest] = []
    end_s = None if window.duration_s is None else window.start_s + window.duration_s
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
            ts_s = float(row["timestamp"]) / 1000.0
            input_length = int(row["input_length"])
            output_length = int(row["output_length"])
            hash_ids = tuple(int(h) for h in row["hash_ids"])
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{source}:{lineno}: not a Mooncake trace line: {err}") from err
        if len(hash_ids) != math.ceil(input_length / block_tokens):
            raise ConfigError(
                f"{source}:{lineno}: {len(hash_ids)} hash ids for input_length "
                f"{input_length} does not fit block_tokens={block_tokens}"
            )
        if ts_s < window.start_s:
            continue
        if end_s is not None and ts_s >= end_s:
            break
        out.append(
            TraceRequest(
                request_id=f"r{lineno - 1}",
                arrival_s=(ts_s - window.start_s) / window.rate_scale,
                input_length=input_length,
                output_length=output_length,
                hash_ids=hash_ids,
                block_tokens=block_tokens,
            )
        )
        if window.max_requests is not None and len(out) >= window.max_requests:
            break
    return out


def load_mooncake(
    path: str | Path,
    window: TraceWindow | None = None,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Load a Mooncake-format ``.jsonl`` trace file (see :func:`parse_mooncake`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"trace file not found: {path}")
    try:
        with path.open(encoding="utf-8") as fh:
            return parse_mooncake(fh, window, block_tokens=block_tokens, source=str(path))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not a Mooncake trace (not UTF-8 text: {err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"cannot read trace {path}: {err.strerror or err}") from None


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


class TokenSynthesizer:
    """Turns trace hash ids into token ids, deterministically for a key.

    ``vocab_size`` defaults to Llama-3's 128,256 (the value only matters for
    realism of the wire payloads). A small bounded memo keeps hot blocks (a
    shared system prompt) from being recomputed on every request.
    """

    def __init__(self, *, key: int = 0, vocab_size: int = 128_256, memo_blocks: int = 4096):
        if vocab_size <= 1:
            raise ConfigError(f"vocab_size must be > 1, got {vocab_size}")
        self._key = np.uint64(key & 0xFFFFFFFFFFFFFFFF)
        self._vocab = np.uint64(vocab_size)
        self._memo: dict[tuple[int, int], np.ndarray] = {}
        self._memo_blocks = memo_blocks

    def block(self, hash_id: int, length: int) -> np.ndarray:
        """The first ``length`` tokens of the block named ``hash_id`` (int64)."""
        key = (hash_id, length)
        got = self._memo.get(key)
        if got is not None:
            return got
        with np.errstate(over="ignore"):
            seed = _splitmix64(np.array([hash_id & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) ^ self._key)
            pos = np.arange(length, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
            toks = (_splitmix64(pos ^ seed) % self._vocab).astype(np.int64)
        if len(self._memo) >= self._memo_blocks:
            self._memo.pop(next(iter(self._memo)))
        self._memo[key] = toks
        return toks

    def tokens(self, request: TraceRequest) -> np.ndarray:
        """All ``input_length`` prompt tokens of ``request`` (int64 array)."""
        parts = [
            self.block(h, request.block_length(i)) for i, h in enumerate(request.hash_ids)
        ]
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(parts)


def _ideal_reuse(requests: Sequence[TraceRequest]) -> tuple[int, int, int, int]:
    """Tokens, tokens an infinite single cache already held, blocks, blocks it held.

    The one count behind ``trace_summary``'s ideal hit ratios and
    :func:`ideal_load`: a block hits when some earlier request had its id.
    """
    seen: set[int] = set()
    total = hit = blocks = blocks_hit = 0
    for r in requests:
        for i, h in enumerate(r.hash_ids):
            n = r.block_length(i)
            total += n
            blocks += 1
            if h in seen:
                hit += n
                blocks_hit += 1
        seen.update(r.hash_ids)
    return total, hit, blocks, blocks_hit


def trace_summary(requests: list[TraceRequest]) -> dict[str, float]:
    """Counts used in reports: requests, span, rate, lengths, ideal hit ratios, ideal prefill demand.

    The ideal hit ratio (infinite single cache, trace block granularity) is
    the ceiling no routing policy can exceed: ``ideal_hit_ratio`` weighs
    blocks by their tokens, ``ideal_block_hit_ratio`` counts blocks (the
    fraction of blocks some earlier request already had).
    ``ideal_prefill_tokens_per_s`` is the prefill demand with that ideal
    reuse: the tokens the ideal cache misses, per second of the trace's span
    (0 when the span is 0); :func:`ideal_load` divides it by a capacity.
    """
    total, hit, blocks, blocks_hit = _ideal_reuse(requests)
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    inputs = [r.input_length for r in requests]
    return {
        "requests": float(len(requests)),
        "span_s": span,
        "req_per_s": len(requests) / span if span > 0 else 0.0,
        "input_tokens": float(total),
        "input_mean": total / len(requests) if requests else 0.0,
        "input_p50": percentile(inputs, 50) if requests else 0.0,
        "input_p99": percentile(inputs, 99) if requests else 0.0,
        "output_mean": sum(r.output_length for r in requests) / len(requests) if requests else 0.0,
        "ideal_hit_ratio": hit / total if total else 0.0,
        "ideal_block_hit_ratio": blocks_hit / blocks if blocks else 0.0,
        "ideal_prefill_tokens_per_s": (total - hit) / span if span > 0 else 0.0,
    }


def ideal_load(requests: list[TraceRequest], capacity_tokens_per_s: float) -> float:
    """The trace's prefill demand with ideal reuse, as a fraction of ``capacity_tokens_per_s``.

    Demand is ``trace_summary``'s ``ideal_prefill_tokens_per_s``: the tokens
    one infinite cache would still have to prefill (those the ideal hit ratio
    leaves), per second of the trace's span. Capacity is the cluster's
    prefill rate (engines x tokens/s each, in the trace's tokens). 0.35 means
    that even a router that reused every block perfectly would keep the
    cluster's prefill busy 35 % of the time; no router can do better, and a
    worse one spends more. A trace of one instant (span 0) has load 0.
    """
    if not (math.isfinite(capacity_tokens_per_s) and capacity_tokens_per_s > 0):
        raise ConfigError(f"capacity_tokens_per_s must be a finite number > 0, got {capacity_tokens_per_s}")
    return trace_summary(requests)["ideal_prefill_tokens_per_s"] / capacity_tokens_per_s


def mooncake_line(request: TraceRequest) -> str:
    """One Mooncake JSON line for ``request`` (timestamp in whole milliseconds), no newline."""
    return json.dumps({"timestamp": round(request.arrival_s * 1000.0), "input_length": request.input_length,
                       "output_length": request.output_length, "hash_ids": list(request.hash_ids)})


def write_mooncake(requests: Iterable[TraceRequest], out: str | Path | TextIO) -> int:
    """Write ``requests`` as a Mooncake ``.jsonl`` trace (to a path or an open text file).

    The inverse of :func:`load_mooncake` for arrivals in whole milliseconds:
    the four fields of the format and nothing else, so any Mooncake reader
    (AIPerf, Dynamo, SGLang's ``mooncake`` dataset) takes the file. Returns
    the number of lines written.
    """
    if not isinstance(out, (str, Path)):
        return _write_lines(requests, out)
    path = Path(out)
    try:
        with path.open("w", encoding="utf-8") as fh:
            return _write_lines(requests, fh)
    except OSError as err:
        raise ConfigError(f"cannot write trace {path}: {err.strerror or err}") from None


def _write_lines(requests: Iterable[TraceRequest], fh: TextIO) -> int:
    n = 0
    for r in requests:
        fh.write(mooncake_line(r) + "\n")
        n += 1
    return n


def sample_prefix_groups(
    requests: Sequence[TraceRequest], *, prefix_blocks: int, groups: int, seed: int,
    min_size: int = 3, speedup: float = 1.0,
) -> list[TraceRequest]:
    """Whole groups of requests that share their first ``prefix_blocks`` hash ids.

    A trace's first minutes hold little reuse (its sessions and documents come
    back later), so a prefix of the file is a poor slice. Keeping ``groups``
    whole groups (drawn with ``random.Random(seed)`` among groups of at least
    ``min_size`` requests) keeps the reuse structure at a fraction of the
    size. This is how the demo's shipped slice was cut (synthetic trace,
    ``prefix_blocks=1, groups=60, seed=1``). Arrivals are re-based to 0 and
    divided by ``speedup``; trace order is kept.
    """
    if prefix_blocks < 1 or groups < 1 or speedup <= 0:
        raise ConfigError("prefix_blocks and groups must be >= 1 and speedup > 0")
    members: dict[tuple[int, ...], int] = defaultdict(int)
    for r in requests:
        members[r.hash_ids[:prefix_blocks]] += 1
    candidates = sorted(k for k, n in members.items() if n >= min_size)
    if len(candidates) < groups:
        raise ConfigError(f"only {len(candidates)} prefix groups of >= {min_size} requests, "
                          f"{groups} asked")
    chosen = set(random.Random(seed).sample(candidates, groups))
    picked = [r for r in requests if r.hash_ids[:prefix_blocks] in chosen]
    t0 = picked[0].arrival_s if picked else 0.0
    return [replace(r, arrival_s=(r.arrival_s - t0) / speedup) for r in picked]
