"""The follower loop: every replica (leader included) builds its index from the stream.

One thread per replica reads the stream with ``XREAD BLOCK`` from the last id
it applied and folds entries in through :class:`StreamApplier`. Besides
applying, it is the part that notices the stream changing under it:

* **Generation changed** (an entry or the ``gen`` key names another
  generation): Redis lost the stream and a leader re-seeded it; load that
  generation's seed snapshot into the live index and read on from there.
* **Generation missing**: Redis lost everything. If this replica holds the
  lease it seeds a new generation from its own index (atomically with the
  seed snapshot); otherwise it waits for the leader to do so, serving from
  memory meanwhile (degraded).
* **Counter gap** (entry ``n`` jumps): MAXLEN trimmed entries before we read
  them. If the latest snapshot covers the hole, reload it; otherwise clear
  every worker and mark it resyncing (never route on state known to be
  incomplete).
* **Redis unreachable**: keep the index, report degraded, retry with backoff.

It also writes periodic snapshots (any replica may; a short ``SET NX`` lock
keeps two from doing the same work, and the write script refuses to go
backwards).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tokenspeed_router.errors import SnapshotError, StateBackendError
from tokenspeed_router.state._client import Backoff, connect, transient_errors
from tokenspeed_router.state.applier import RESYNC_STREAM_TRIMMED, StreamApplier
from tokenspeed_router.state.config import RedisStateConfig
from tokenspeed_router.state.health import WarmStartReport
from tokenspeed_router.state.snapshot import SnapshotStore
from tokenspeed_router.state.stream import FencedError, decode_entry

__all__ = ["FollowerHooks", "StreamFollower"]

logger = logging.getLogger(__name__)

_CHECK_INTERVAL_S = 0.5
_SNAPSHOT_LOCK_MS = 30_000


@dataclass
class FollowerHooks:
    """How the follower talks to the leader side of its replica (all optional)."""

    #: Our fencing token if we hold the lease (we then seed a missing generation).
    seed_fence: Callable[[], int | None] = lambda: None
    #: A new generation was seeded by us (the writer re-appends its unconfirmed window).
    on_seeded: Callable[[str], None] = lambda generation: None
    #: Entries up to this id of this generation are applied here.
    on_progress: Callable[[str, bytes], None] = lambda generation, last_id: None


class StreamFollower:
    """Reads the stream into the applier on its own thread; see the module docstring."""

    def __init__(
        self,
        config: RedisStateConfig,
        applier: StreamApplier,
        hooks: FollowerHooks | None = None,
    ) -> None:
        self._config = config
        self._keys = config.keys
        self.applier = applier
        self.hooks = hooks or FollowerHooks()
        self._client = connect(config, block_ms=config.read_block_ms)
        self._store = SnapshotStore(self._client, self._keys)
        self._errors = transient_errors()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_check = 0.0
        self._last_snapshot_mono = time.monotonic()
        # status, read by health()
        self.connected = False
        self.waiting: str | None = None
        self.last_error: str | None = None
        self.stream_end_n = 0
        self.stream_gaps = 0
        self.resets_detected = 0
        self.snapshots_written = 0
        self.snapshot_version_loaded: int | None = None
        self.warm_start_report: WarmStartReport | None = None
        #: Set by any thread to have the loop write a snapshot at its next turn.
        self.force_snapshot = False
        self._warming = False

    # --------------------------------------------------------------- lifecycle

    def warm_start(self) -> WarmStartReport:
        """Load the latest snapshot and apply the stream tail, synchronously, and time it.

        Redis being down is not fatal: the replica starts cold and the loop
        catches up when Redis answers.
        """
        t0 = time.perf_counter()
        self._warming = True
        try:
            loaded = self._bootstrap()
            t1 = time.perf_counter()
            tail = 0
            while self.applier.generation is not None:
                count = self._read(block_ms=None)
                if count == 0:
                    break
                tail += count
            self.connected = True
        except self._errors as err:
            self._note_error(err)
            report = WarmStartReport("unavailable", None, 0, 0, 0, 0.0, 0.0,
                                     time.perf_counter() - t0, 0)
            self.warm_start_report = report
            return report
        finally:
            self._warming = False
        t2 = time.perf_counter()
        source: Literal["snapshot", "stream", "empty"] = "empty"
        if loaded is not None and loaded[0] > 0:
            source = "snapshot"
        elif tail:
            source = "stream"
        report = WarmStartReport(
            source=source,
            snapshot_version=loaded[2] if loaded else None,
            snapshot_n=loaded[0] if loaded else 0,
            snapshot_blocks=loaded[1] if loaded else 0,
            tail_entries=tail,
            load_s=t1 - t0, tail_s=t2 - t1, total_s=t2 - t0,
            num_blocks=self.applier.host.index.num_blocks(),
        )
        self.warm_start_report = report
        logger.info(
            "state: warm start from %s in %.3fs (snapshot v%s, %d blocks, %d tail entries)",
            report.source, report.total_s, report.snapshot_version, report.num_blocks,
            report.tail_entries,
        )
        return report

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="state-follower", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._client.close()

    def wake(self) -> None:
        """Make the loop re-check the generation soon (the leader just seeded or lost it)."""
        self._last_check = 0.0

    # -------------------------------------------------------------------- loop

    def _run(self) -> None:
        backoff = Backoff(self._config.backoff_min_s, self._config.backoff_max_s, self._stop)
        while not self._stop.is_set():
            try:
                if self.applier.generation is None:
                    self._bootstrap()
                    if self.applier.generation is None:
                        self._stop.wait(self._config.read_block_ms / 1000)
                        continue
                self._read(block_ms=self._config.read_block_ms)
                self._periodic()
            except self._errors as err:
                self._note_error(err)
                if backoff.wait():
                    return
                continue
            except (StateBackendError, SnapshotError) as err:
                self.last_error = str(err)
                logger.error("state follower: %s", err)
                if backoff.wait():
                    return
                continue
            except Exception as err:  # a bug must not silently freeze this replica's index
                self.last_error = f"{type(err).__name__}: {err}"
                logger.exception("state follower: unexpected error")
                if backoff.wait():
                    return
                continue
            if not self.connected:
                logger.info("state follower: Redis reachable again; catching up")
            self.connected = True
            backoff.reset()

    def _note_error(self, err: BaseException) -> None:
        if self.connected or self.last_error is None:
            logger.warning("state follower: Redis unreachable (%s); serving from memory", err)
        self.connected = False
        self.last_error = f"{type(err).__name__}: {err}"

    def _read(self, block_ms: int | None) -> int:
        """One XREAD; apply what came; return how many entries came."""
        applier = self.applier
        reply: Any = self._client.xread(
            {self._keys.stream: applier.last_id}, count=self._config.read_count, block=block_ms
        )
        if not reply:
            return 0
        entries = reply[0][1]
        generation = applier.generation
        for stream_id, fields in entries:
            try:
                entry = decode_entry(stream_id, fields)
            except StateBackendError as err:
                self._skip_foreign(stream_id, fields, err)
                continue
            if entry.generation != generation:
                self._on_generation(entry.generation)
                return len(entries)
            if entry.n <= applier.n:
                continue
            if entry.n != applier.n + 1 and self._on_gap(entry.n):
                return len(entries)  # reloaded a snapshot: read again from its id
            applier.advance(entry)
        assert generation is not None
        self.hooks.on_progress(generation, applier.last_id)
        self.stream_end_n = max(self.stream_end_n, applier.n)
        self._maybe_snapshot()
        return len(entries)

    def _skip_foreign(self, stream_id: bytes, fields: dict[bytes, bytes], err: Exception) -> None:
        """An entry we cannot read (written by something else): step over it, loudly."""
        self.applier.undecodable += 1
        self.applier.last_id = stream_id
        try:
            n = int(fields[b"n"])
        except (KeyError, ValueError):
            n = None
        if n is not None and n == self.applier.n + 1:
            self.applier.n = n  # counted, so the next entry is not taken for a gap
        logger.error("state follower: skipping unreadable stream entry: %s", err)

    def _periodic(self) -> None:
        """Every half second: is our generation still current, how long is the stream."""
        now = time.monotonic()
        if now - self._last_check < _CHECK_INTERVAL_S:
            return
        self._last_check = now
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self._keys.generation)
        pipe.get(self._keys.counter)
        raw_gen, raw_n = pipe.execute()
        current = raw_gen.decode() if raw_gen is not None else None
        if current != self.applier.generation:
            self._on_generation(current)
            return
        self.waiting = None
        self.stream_end_n = int(raw_n or 0)
        self._maybe_snapshot()

    # ---------------------------------------------------------- stream changes

    def _on_generation(self, current: str | None) -> None:
        self.resets_detected += 1
        logger.warning(
            "state follower: stream generation %s -> %s (Redis lost the stream?); resyncing",
            self.applier.generation, current,
        )
        self.applier.generation = None
        self._bootstrap()

    def _bootstrap(self) -> tuple[int, int, int] | None:
        """Attach to the current generation: seed it, or load its snapshot.

        Returns ``(snapshot n, snapshot blocks, version)`` when a snapshot was
        loaded, None otherwise (nothing to attach to yet, or we seeded).
        """
        raw: Any = self._client.get(self._keys.generation)
        if raw is None:
            fence = self.hooks.seed_fence()
            if fence is not None:
                self._seed(fence)
                return None
            self.waiting = "stream not seeded (waiting for a leader)"
            return None
        generation = raw.decode()
        loaded = self._store.load()
        if loaded is None or loaded[0].generation != generation:
            self.waiting = "stream generation has no snapshot yet"
            return None  # a re-seed is racing with us: try again on the next turn
        meta, envelope = loaded
        self.applier.install(envelope, fresh=self._warming)
        self.snapshot_version_loaded = meta.version
        self.stream_end_n = meta.n  # refreshed from the counter by _periodic
        self._last_snapshot_mono = time.monotonic()
        self.waiting = None
        logger.info("state follower: loaded snapshot v%d (gen %s, n=%d, %d blocks)",
                    meta.version, generation, meta.n, meta.num_blocks)
        return meta.n, meta.num_blocks, meta.version

    def _seed(self, fence: int) -> None:
        generation = uuid.uuid4().hex[:12]
        envelope, num_blocks = self.applier.make_envelope(
            self._config.replica_id, generation=generation, n=0, stream_id="0-0"
        )
        try:
            version = self._store.seed(fence, envelope, num_blocks=num_blocks)
        except FencedError as err:
            # The lease thread decides whether we still lead; try again next turn.
            logger.info("state follower: not seeding yet, fence %d is not current (%s)", fence, err)
            self.waiting = "stream not seeded (leader re-acquiring the lease)"
            return
        applier = self.applier
        applier.generation = generation
        applier.n = 0
        applier.last_id = b"0-0"
        applier.since_snapshot = 0
        self.stream_end_n = 0
        self.waiting = None
        self.snapshot_version_loaded = version
        logger.warning(
            "state: seeded stream generation %s from this replica's index (%d blocks, fence %d)",
            generation, num_blocks, fence,
        )
        self.hooks.on_seeded(generation)

    def _on_gap(self, got_n: int) -> bool:
        """Entries ``applier.n+1 .. got_n-1`` were trimmed; True if a snapshot was reloaded."""
        applier = self.applier
        lost = got_n - applier.n - 1
        self.stream_gaps += 1
        meta = self._store.meta()
        if (meta is not None and meta.generation == applier.generation
                and meta.n >= got_n - 1 and meta.n > applier.n):
            logger.warning(
                "state follower: %d stream entries trimmed before we read them; "
                "reloading snapshot v%d (n=%d)", lost, meta.version, meta.n,
            )
            self._bootstrap()
            return True
        workers = applier.mark_all_resyncing(RESYNC_STREAM_TRIMMED)
        logger.error(
            "state follower: %d stream entries were trimmed (MAXLEN) before this replica read "
            "them and no snapshot covers them; %d workers marked resyncing. Raise maxlen or "
            "snapshot more often.", lost, len(workers),
        )
        return False

    # ---------------------------------------------------------------- snapshots

    def _maybe_snapshot(self) -> None:
        applier = self.applier
        config = self._config
        if applier.since_snapshot == 0 or applier.generation is None:
            return
        now = time.monotonic()
        forced = self.force_snapshot
        if (not forced and applier.since_snapshot < config.snapshot_every_batches
                and now - self._last_snapshot_mono < config.snapshot_every_s):
            return
        self.force_snapshot = False
        meta = self._store.meta()
        if not forced and meta is not None and meta.generation == applier.generation:
            age_s = max(0.0, time.time() - meta.created_s)
            behind = applier.n - meta.n
            if behind < config.snapshot_every_batches and age_s < config.snapshot_every_s:
                applier.since_snapshot = max(0, behind)  # another replica just wrote one
                self._last_snapshot_mono = now - age_s
                return
        self._last_snapshot_mono = now
        if not self._client.set(self._keys.snapshot_lock, config.replica_id, nx=True,
                                px=_SNAPSHOT_LOCK_MS):
            return
        try:
            self.write_snapshot()
        finally:
            self._client.delete(self._keys.snapshot_lock)

    def write_snapshot(self) -> int | None:
        """Snapshot the index at the current stream point now (follower thread only)."""
        envelope, num_blocks = self.applier.make_envelope(self._config.replica_id)
        version = self._store.write(envelope, num_blocks=num_blocks)
        self.applier.since_snapshot = 0
        if version is not None:
            self.snapshots_written += 1
            logger.info("state: wrote snapshot v%d (n=%d, %d blocks)", version, envelope.n, num_blocks)
        return version
