"""What ``GET /workers`` and the per-worker Prometheus samples say about each worker.

One job: turn the service's state (its configured streams, the routing
core's index counts, ingestion statuses, load and marks, the subscribers'
statistics) into the reported shapes. The caller holds the core's locks
(``RoutingCore.locked``), so the shape of the answer lives in one place and
the locking in another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenspeed_router.router.core import RoutingCore
from tokenspeed_router.router.router import WorkerRole
from tokenspeed_router.server.ingest_lag import LagStatus
from tokenspeed_router.server.metrics import WorkerSample
from tokenspeed_router.server.workers import WorkerRegistry

__all__ = ["worker_entries", "worker_samples"]


def worker_entries(
    registry: WorkerRegistry,
    core: RoutingCore,
    stats: Mapping[str, Any],
    connected: Mapping[str, Any],
    now: float,
    *,
    peers: Mapping[str, Any] | None = None,
    ingest_lag: Mapping[str, LagStatus] | None = None,
    stream_problems: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``GET /workers``: ``{name: info}`` per stream, at the top level (DESIGN §6).

    ``info`` holds role, state, blocks held (``blocks``, also as
    ``blocks_held``), last seq, events applied and lag (``lag_s``: seconds
    since the worker's last batch timestamp, also as ``lag``), plus
    counters and endpoints, and ``index_core`` (``native`` or ``reference``:
    which KvIndex core runs). ``peers``: other router replicas' in-flight load
    per worker (shared load), reported as ``in_flight_peers``. ``ingest_lag``:
    the ingest lag's view (``lagging``: its events reach the index late;
    ``ingest_queued``, ``apply_delay_s``, ``shed_batches``). ``stream_problems``:
    why a stream delivers nothing (a failed handshake, a foreign topic), as
    ``stream_problem`` (None when there is none).
    """
    peers = peers or {}
    queue = ingest_lag or {}
    problems = stream_problems or {}
    index = core.index
    statuses = core.ingestor.statuses()
    load = core.router.load()
    roles = core.roles
    out: dict[str, Any] = {}
    for name in registry.names([*roles, *statuses]):
        st = statuses.get(name)
        sub = registry.streams.get(name)
        wl = load.get(name)
        blocks = index.num_blocks(name)
        lag = (now - st.last_batch_ts) if st is not None and st.last_batch_ts else None
        out[name] = {
            "worker": sub.worker if sub is not None else name,
            "dp_rank": sub.dp_rank if sub is not None else None,
            "role": roles.get(name, sub.role if sub is not None else WorkerRole.BOTH).value,
            "state": st.state.value if st is not None else "live",
            "blocks": blocks,
            "blocks_held": blocks,
            "blocks_by_tier": index.blocks_by_tier(name),
            "block_size": index.block_size_of(name),
            # the index core holding these blocks (same for every entry; an entry per
            # worker, since the answer's top level names workers only)
            "index_core": index.implementation,
            "last_seq": st.last_seq if st is not None else None,
            "epoch": st.epoch if st is not None else 0,
            "batches_applied": st.batches_applied if st is not None else 0,
            "events_applied": st.events_applied if st is not None else 0,
            "events_rejected": st.events_rejected if st is not None else 0,
            "resyncs": st.resyncs if st is not None else 0,
            "restarts": st.restarts if st is not None else 0,
            # recovery after lost events (router/recovery.py; docs/faults.md, "What is trusted when")
            "orphan_blocks": st.orphan_blocks if st is not None else 0,
            "adopted_blocks": st.adopted_blocks if st is not None else 0,
            "named_parents": st.named_parents if st is not None else 0,
            "inferred_blocks": st.inferred_blocks if st is not None else 0,
            "inferred_drops": st.inferred_drops if st is not None else 0,
            "replayed_batches": core.replayed.get(name, 0),
            "gaps": stats[name].gaps if name in stats else 0,
            "malformed_frames": stats[name].malformed_total if name in stats else 0,
            # skipped before sequencing, by cause (events/subscriber.py): none of them moved the seq
            "malformed_by_cause": dict(stats[name].malformed) if name in stats else {},
            "duplicates": stats[name].duplicates if name in stats else 0,
            "lag_s": lag,
            "lag": lag,
            "ingest_delay_s": st.lag_s if st is not None else None,
            "in_flight": getattr(wl, "active_requests", 0) if wl is not None else 0,
            # uncached prompt tokens routed there whose first token has not come out yet
            "queued_prefill_tokens": getattr(wl, "pending_prefill_tokens", 0) if wl is not None else 0,
            # requests other router replicas have in flight there (shared load)
            "in_flight_peers": peers[name].active_requests if name in peers else 0,
            "connected": connected.get(name),
            "stream_problem": problems.get(name),
            "lagging": queue[name].lagging if name in queue else False,
            "ingest_queued": queue[name].queued if name in queue else 0,
            "apply_delay_s": queue[name].apply_delay_s if name in queue else None,
            "shed_batches": queue[name].shed_batches if name in queue else 0,
            "events_endpoint": sub.events if sub is not None else None,
            "replay_endpoint": sub.replay if sub is not None else None,
            "topic": sub.topic if sub is not None else None,
        }
    return out


def worker_samples(
    core: RoutingCore,
    stats: Mapping[str, Any],
    now: float,
    lag: Mapping[str, LagStatus] | None = None,
) -> list[WorkerSample]:
    """One Prometheus sample per worker the ingestor knows (``/metrics``); ``lag``: the ingest lag's view."""
    index = core.index
    statuses = core.ingestor.statuses()
    load = core.router.load()
    roles = core.roles
    lag = lag or {}
    return [
        WorkerSample(
            name=name,
            role=roles.get(name, WorkerRole.BOTH).value,
            state=st.state.value,
            batches_applied=st.batches_applied,
            events_applied=st.events_applied,
            events_rejected=st.events_rejected,
            resyncs=st.resyncs,
            restarts=st.restarts,
            replayed_batches=core.replayed.get(name, 0),
            gaps=stats[name].gaps if name in stats else st.resyncs,
            replay_requests=stats[name].replay_requests if name in stats else 0,
            replay_timeouts=stats[name].replay_timeouts if name in stats else 0,
            malformed=stats[name].malformed_total if name in stats else 0,
            malformed_by_cause=dict(stats[name].malformed) if name in stats else {},
            duplicates=stats[name].duplicates if name in stats else 0,
            lag_s=(now - st.last_batch_ts) if st.last_batch_ts else None,
            blocks_by_tier=index.blocks_by_tier(name),
            in_flight_requests=getattr(load.get(name), "active_requests", 0),
            pending_prefill_tokens=getattr(load.get(name), "pending_prefill_tokens", 0),
            active_tokens=getattr(load.get(name), "active_tokens", 0),
            shed_batches=lag[name].shed_batches if name in lag else 0,
            queued=lag[name].queued if name in lag else 0,
            lagging=lag[name].lagging if name in lag else False,
            apply_delay_s=lag[name].apply_delay_s if name in lag else None,
        )
        for name, st in statuses.items()
    ]
