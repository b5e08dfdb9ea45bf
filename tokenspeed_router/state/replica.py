"""One router replica on the shared Redis state: follower always, leader when it holds the lease.

Threads (all daemons, all stopped by :meth:`RedisStateReplica.close`):

``state-follower``  reads the stream into the index (:mod:`.follower`)
``state-writer``    appends what the leader received (:mod:`.leader`)
``state-lease``     acquires / renews the lease, takes over, steps down (here)

Takeover, in order: take the lease (new fencing token; from now on a stale
leader's appends fail), wait until our follower has applied the whole
stream, compute each worker's last position, start accepting items, and ask
the host to subscribe to the workers, each from its last seq + 1 (the
workers' replay rings fill in what happened since). Because the stream is
fenced and applied by position, nothing is lost and nothing is applied twice.

Losing the lease (renewal refused, or an append fenced off): stop accepting,
drop what was buffered (the next leader replays it from the workers), ask
the host to unsubscribe. While Redis is merely unreachable the leader keeps
its role and buffers: nobody else can take the lease then either, and if
somebody did, the fence rejects our late appends when Redis answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from tokenspeed_router.events.subscriber import SubscriberItem
from tokenspeed_router.state._client import connect, transient_errors
from tokenspeed_router.state.applier import IndexHost, StreamApplier
from tokenspeed_router.state.config import RedisStateConfig
from tokenspeed_router.state.follower import FollowerHooks, StreamFollower
from tokenspeed_router.state.health import Role, StateHealth, WarmStartReport
from tokenspeed_router.state.leader import LeaderWriter
from tokenspeed_router.state.lease import Lease
from tokenspeed_router.state.stream import parse_id

__all__ = ["IngestionControl", "RedisStateReplica"]

logger = logging.getLogger(__name__)

#: ``start(start_seqs)`` subscribes to the workers (worker -> first seq to ask for);
#: ``stop()`` unsubscribes. Called from the lease thread.
IngestionControl = tuple[Callable[[Mapping[str, int]], None], Callable[[], None]]


class RedisStateReplica:
    """The Redis state backend of one replica; also the ``IngestSink`` (``submit``)."""

    def __init__(
        self,
        config: RedisStateConfig,
        host: IndexHost,
        *,
        ingestion: IngestionControl | None = None,
    ) -> None:
        self.config = config
        self.host = host
        self._ingestion = ingestion
        self._errors = transient_errors()
        self.applier = StreamApplier(host)
        self.writer = LeaderWriter(config, on_fenced=self._on_fenced)
        self.follower = StreamFollower(config, self.applier, FollowerHooks(
            seed_fence=lambda: self.writer.fence,
            on_seeded=self._on_seeded,
            on_progress=self.writer.on_progress,
        ))
        self._client = connect(config)
        self._lease = Lease(self._client, config.keys, config.replica_id, config.lease_ttl_s)
        self._role: Role = "starting"
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._fenced_by: int | None = None
        self._thread: threading.Thread | None = None
        self._last_renew = 0.0
        self._closed = False
        self.takeovers = 0
        self.lease_connected = True
        self.last_error: str | None = None
        self.start_seqs: dict[str, int] = {}
        #: The lease holder as last seen by the lease loop (ourselves while leading).
        self.leader_id: str | None = None

    # --------------------------------------------------------------- lifecycle

    def start(self) -> WarmStartReport:
        """Warm start (snapshot + stream tail, timed), then run the threads."""
        report = self.follower.warm_start()
        self._role = "follower"
        self.follower.start()
        self.writer.start()
        self._thread = threading.Thread(target=self._run, name="state-lease", daemon=True)
        self._thread.start()
        return report

    def set_ingestion(self, ingestion: IngestionControl) -> None:
        """Set the subscribe/unsubscribe callbacks (before :meth:`start`)."""
        self._ingestion = ingestion

    def close(self, *, flush_timeout_s: float = 5.0) -> None:
        """Clean shutdown: flush the leader's buffer, release the lease, stop threads."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()  # no takeover or step-down from now on
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self._role == "leader":
            self._stop_ingestion()  # nothing new comes in; what came is flushed
            if not self.writer.wait_flushed(flush_timeout_s):
                logger.warning("state: %d entries not flushed at shutdown; the next leader "
                               "replays them from the workers", self.writer.buffered)
            try:
                self._lease.release()
            except self._errors as err:
                logger.warning("state: could not release the lease (%s); it expires by itself", err)
        self.writer.stop()
        self.follower.stop()
        self._client.close()
        self._role = "stopped"

    # ------------------------------------------------------------------- seam

    def submit(self, item: SubscriberItem) -> None:
        """IngestSink: queue an item for the stream (leader only; dropped otherwise)."""
        self.writer.submit(item)

    @property
    def role(self) -> Role:
        return self._role

    @property
    def is_leader(self) -> bool:
        return self._role == "leader"

    def write_snapshot_soon(self) -> None:
        """Ask for a snapshot at the next opportunity (operators, tests)."""
        self.follower.force_snapshot = True

    # -------------------------------------------------------------- lease loop

    def _run(self) -> None:
        interval = self.config.renew_interval_s
        while not self._stop.is_set():
            try:
                current = self._fenced_by
                if current is not None:
                    self._fenced_by = None
                    token = self._lease.token
                    if token is not None and token >= current:
                        self.writer.set_fence(token)  # we re-acquired meanwhile
                    elif self._role == "leader":
                        self._step_down(f"a newer leader (fence {current}) fenced our appends")
                if self._role == "leader":
                    self._renew()
                else:
                    token = self._lease.try_acquire(floor=self.applier.max_fence)
                    if token is not None:
                        self._take_over(token)
                    else:
                        holder = self._lease.holder()
                        self.leader_id = holder.replica_id if holder is not None else None
                if not self.lease_connected:
                    logger.info("state lease: Redis reachable again")
                self.lease_connected = True
            except self._errors as err:
                if self.lease_connected:
                    logger.warning("state lease: Redis unreachable (%s)", err)
                self.lease_connected = False
                self.last_error = f"{type(err).__name__}: {err}"
            except Exception as err:  # a bug must not silently end leader election
                logger.exception("state lease: unexpected error")
                self.last_error = f"{type(err).__name__}: {err}"
            self._wake.wait(interval)
            self._wake.clear()

    def _renew(self) -> None:
        old = self._lease.token
        if self._lease.renew():
            self._last_renew = time.monotonic()
            return
        # Expired (we were cut off past the TTL) or Redis lost it: try to get it back.
        assert old is not None
        token = self._lease.try_acquire(floor=max(old, self.applier.max_fence))
        if token is not None and token == old + 1:
            # Nobody held it in between: keep buffer, window and subscriptions.
            logger.warning("state lease: lease had lapsed; re-acquired with fence %d", token)
            self.writer.set_fence(token)
            self._last_renew = time.monotonic()
            self.follower.wake()
            return
        self._step_down("lease lost")
        if token is not None:
            self._take_over(token)

    def _take_over(self, token: int) -> None:
        logger.info("state lease: acquired with fence %d; catching up before ingesting", token)
        self.writer.prepare(token)
        self.follower.wake()
        if not self._wait_caught_up():
            logger.error("state lease: could not catch up with the stream; giving the lease back")
            self.writer.deactivate()
            self._lease.release()
            return
        positions = self.applier.positions_copy()
        base = {w: p[0] for w, p in positions.items()}
        self.start_seqs = {w: p[1] + 1 for w, p in positions.items()}
        self.writer.activate(self.applier.generation, base)
        self._last_renew = time.monotonic()
        self.takeovers += 1
        logger.warning("state: this replica (%s) is now the ingestion leader (fence %d)",
                       self.config.replica_id, token)
        if self._ingestion is not None:
            try:
                self._ingestion[0](dict(self.start_seqs))
            except Exception:
                logger.exception("state: could not subscribe to the workers; giving the lease back")
                self.writer.deactivate()
                self._stop_ingestion()
                self._lease.release()
                return
        self._role = "leader"

    def _wait_caught_up(self) -> bool:
        """Wait (renewing) until the follower applied everything written before our fence."""
        deadline = time.monotonic() + max(10.0, 4 * self.config.lease_ttl_s)
        next_renew = time.monotonic() + self.config.renew_interval_s
        target: tuple[int, int] | None = None
        while not self._stop.is_set() and time.monotonic() < deadline:
            if time.monotonic() >= next_renew:
                if not self._lease.renew():
                    return False
                next_renew = time.monotonic() + self.config.renew_interval_s
            generation = self.applier.generation
            if generation is not None:
                if target is None:
                    pipe = self._client.pipeline(transaction=False)
                    pipe.get(self.config.keys.generation)
                    pipe.xrevrange(self.config.keys.stream, count=1)
                    raw_gen, last = pipe.execute()
                    if raw_gen is None or raw_gen.decode() != generation:
                        self._stop.wait(0.01)
                        continue
                    target = parse_id(last[0][0]) if last else (0, 0)
                if parse_id(self.applier.last_id) >= target:
                    return True
            self._stop.wait(0.005)
        return False

    def _step_down(self, why: str) -> None:
        discarded = self.writer.deactivate()
        self._lease.forget()
        self._role = "follower"
        logger.warning("state: stepping down as leader (%s); %d buffered entries left to the "
                       "next leader's replay", why, discarded)
        self._stop_ingestion()

    def _stop_ingestion(self) -> None:
        if self._ingestion is not None:
            try:
                self._ingestion[1]()
            except Exception:
                logger.exception("state: unsubscribing from the workers failed")

    def _on_fenced(self, current: int) -> None:
        self._fenced_by = current
        self._wake.set()

    def _on_seeded(self, generation: str) -> None:
        self.writer.on_seeded(generation)

    # ------------------------------------------------------------------ status

    def health(self) -> StateHealth:
        """What ``/health`` and ``/metrics`` show about the shared state."""
        follower, writer, applier = self.follower, self.writer, self.applier
        connected = follower.connected and writer.connected and self.lease_connected
        reasons = []
        if not connected:
            reasons.append("redis unreachable")
        if follower.waiting:
            reasons.append(follower.waiting)
        # Lost entries degrade us while the workers they hit are still resyncing.
        if writer.dropped:
            hurt = applier.still_resyncing(set(writer.dropped_workers))
            if hurt:
                reasons.append(f"leader dropped {writer.dropped} entries while Redis was down; "
                               "resyncing: " + ", ".join(hurt))
        if applier.gap_reason is not None:
            hurt = applier.still_resyncing(set(applier.gap_workers))
            if hurt:
                reasons.append("stream entries were trimmed before they were read; resyncing: "
                               + ", ".join(hurt))
        lag_entries = max(0, follower.stream_end_n - applier.n)
        lag_s = 0.0
        if lag_entries and applier.last_leader_time_s:
            lag_s = max(0.0, time.time() - applier.last_leader_time_s)
        p50, p99 = applier.apply_lag_percentiles()
        errors = [e for e in (follower.last_error, writer.last_error, self.last_error) if e]
        return StateHealth(
            backend="redis",
            replica_id=self.config.replica_id,
            role=self._role,
            degraded=bool(reasons),
            reason="; ".join(reasons) or None,
            connected=connected,
            leader_id=self.config.replica_id if self._role == "leader" else self.leader_id,
            fence=writer.fence,
            generation=applier.generation,
            applied_n=applier.n,
            stream_lag_entries=lag_entries,
            stream_lag_s=lag_s,
            apply_lag_p50_s=p50,
            apply_lag_p99_s=p99,
            entries_applied=applier.entries_applied,
            duplicates_skipped=applier.duplicates,
            stream_gaps=follower.stream_gaps,
            resets_detected=follower.resets_detected,
            snapshots_written=follower.snapshots_written,
            snapshot_version_loaded=follower.snapshot_version_loaded,
            buffered=writer.buffered,
            appended=writer.appended,
            dropped=writer.dropped,
            dropped_workers=tuple(sorted(writer.dropped_workers)),
            discarded_on_stepdown=writer.discarded_on_stepdown,
            takeovers=self.takeovers,
            warm_start=follower.warm_start_report,
            last_error=errors[0] if errors else None,
        )

