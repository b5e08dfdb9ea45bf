"""What the state backend reports: role, degradation, lag, warm start, drops.

Frozen snapshots (STYLE §3 ``statistics()``), JSON-ready through ``to_dict``,
so ``/health`` and ``/metrics`` can show them without reaching into threads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

__all__ = ["Role", "StateHealth", "WarmStartReport"]

Role = Literal["starting", "follower", "leader", "stopped"]


@dataclass(frozen=True)
class WarmStartReport:
    """How a replica got its index: ``source`` is ``snapshot`` (+ stream tail),
    ``stream`` (no snapshot: rebuilt from the whole stream), ``empty`` (nothing
    in Redis yet) or ``unavailable`` (Redis down: started cold, catching up later).
    """

    source: Literal["snapshot", "stream", "empty", "unavailable"]
    snapshot_version: int | None
    snapshot_n: int
    snapshot_blocks: int
    tail_entries: int
    load_s: float
    tail_s: float
    total_s: float
    num_blocks: int

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class StateHealth:
    """One replica's view of the shared state.

    ``degraded`` is true while Redis is unreachable, while the stream is being
    re-seeded after Redis lost it, and while workers hit by lost entries
    (dropped by the leader's full buffer, or trimmed before this replica read
    them) are still resyncing; the replica keeps serving from memory meanwhile.
    ``stream_lag_entries``/``stream_lag_s``: how far this replica's index is
    behind the stream (entries, and age of the newest unapplied entry as far
    as it can tell). ``dropped``: entries the leader could not buffer while
    Redis was down (``dropped_workers`` were marked for resync because of it).
    """

    backend: str
    replica_id: str
    role: Role
    degraded: bool
    reason: str | None
    connected: bool
    leader_id: str | None
    fence: int | None
    generation: str | None
    applied_n: int
    stream_lag_entries: int
    stream_lag_s: float
    apply_lag_p50_s: float | None
    apply_lag_p99_s: float | None
    entries_applied: int
    duplicates_skipped: int
    stream_gaps: int
    resets_detected: int
    snapshots_written: int
    snapshot_version_loaded: int | None
    buffered: int
    appended: int
    dropped: int
    dropped_workers: tuple[str, ...]
    discarded_on_stepdown: int
    takeovers: int
    warm_start: WarmStartReport | None
    last_error: str | None

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["dropped_workers"] = list(self.dropped_workers)
        return data
