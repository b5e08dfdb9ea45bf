"""Storage tiers of a cached block: normalising the engines' ``medium`` strings.

Engines name tiers differently (vLLM ``"GPU"``/``"CPU"``/``"STORAGE"``, one vLLM
connector lowercase ``"cpu"``, SGLang ``"GPU"``/``"CPU_PINNED"``/``"DISK"``/
``"EXTERNAL"``, TokenSpeed nothing at all, Dynamo ``"device"``), so the index
keeps a block's tiers as a 3-bit code and reports them under three names:
``"gpu"`` > ``"cpu"`` > ``"storage"`` (best first). ``None`` means GPU, the
engines' default. Unknown names map to ``"storage"`` (the most conservative
credit: a router values it least) and are counted, never fatal.

Pure functions, O(1), no state except the unknown-medium counter (read by
``KvIndex.statistics``); safe to call from any thread.
"""

from __future__ import annotations

import logging
from typing import Final

__all__ = [
    "ALL_TIERS",
    "CPU",
    "GPU",
    "STORAGE",
    "TIER_NAMES",
    "best_tier",
    "known_media",
    "medium_code",
    "normalize_medium",
    "tier_names",
    "unknown_media",
]

logger = logging.getLogger(__name__)

GPU: Final = 1
CPU: Final = 2
STORAGE: Final = 4
ALL_TIERS: Final = GPU | CPU | STORAGE

#: tier names, best first; index i names bit ``1 << i``
TIER_NAMES: Final = ("gpu", "cpu", "storage")

_CODE_OF_NAME: dict[str, int] = {
    "gpu": GPU,
    "device": GPU,
    "hbm": GPU,
    "cuda": GPU,
    "cpu": CPU,
    "cpu_pinned": CPU,
    "host": CPU,
    "dram": CPU,
    "storage": STORAGE,
    "disk": STORAGE,
    "external": STORAGE,
    "ssd": STORAGE,
    "nvme": STORAGE,
    "remote": STORAGE,
}

#: exact spellings seen on the wire -> code (the hot path's one dict lookup)
_CODE_CACHE: dict[str | None, int] = {None: GPU}
_unknown: dict[str, int] = {}


def medium_code(medium: str | None) -> int:
    """Tier bit of an engine's ``medium`` (None -> GPU; unknown -> STORAGE, counted)."""
    code = _CODE_CACHE.get(medium)
    if code is not None:
        return code
    assert medium is not None
    code = _CODE_OF_NAME.get(str(medium).strip().lower())
    if code is None:
        # Counted on every occurrence, warned once per spelling: an operator
        # must learn that an engine speaks a tier we do not know.
        first = medium not in _unknown
        _unknown[medium] = _unknown.get(medium, 0) + 1
        if first:
            logger.warning("unknown KV cache medium %r: treated as 'storage'", medium)
        return STORAGE
    if len(_CODE_CACHE) < 1024:
        _CODE_CACHE[medium] = code
    return code


def known_media() -> dict[str, int]:
    """Every known spelling (lowercase, stripped) and its tier code, e.g. for the native decoder."""
    return dict(_CODE_OF_NAME)


def normalize_medium(medium: str | None) -> str:
    """``"gpu"``, ``"cpu"`` or ``"storage"`` for an engine's medium string."""
    return TIER_NAMES[medium_code(medium).bit_length() - 1]


def best_tier(code: int) -> str:
    """Name of the best tier present in a non-empty tier code."""
    if code & GPU:
        return "gpu"
    if code & CPU:
        return "cpu"
    return "storage"


def tier_names(code: int) -> list[str]:
    """Names of every tier in ``code``, best first."""
    return [name for i, name in enumerate(TIER_NAMES) if code >> i & 1]


def unknown_media() -> dict[str, int]:
    """Occurrences of every unknown medium spelling seen by this process."""
    return dict(_unknown)
