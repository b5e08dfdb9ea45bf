"""Who the router routes to: configured workers, their streams, roles and marks.

One job: membership bookkeeping and its rules (names and endpoints unique,
a DP rank is deleted through its worker, a worker's cold flag). No I/O, no
locks of its own: :class:`~tokenspeed_router.server.app.RouterService`
mutates it under its router lock, the same critical section in which it
tells the ``Router`` and the ``IndexIngestor``. Problems are domain errors
(``WorkerConflictError``, ``UnknownWorkerError``); the API maps them to
HTTP codes in one place (``server/api.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenspeed_router.errors import UnknownWorkerError, WorkerConflictError
from tokenspeed_router.router.router import WorkerRole
from tokenspeed_router.server.config import SubscriberSpec, WorkerSpec

__all__ = ["WorkerRegistry"]


class WorkerRegistry:
    """Configured workers (by name), streams (by stream name) and routable workers' roles."""

    def __init__(self) -> None:
        #: configured worker name -> spec (``--worker`` and ``PUT /workers``)
        self.specs: dict[str, WorkerSpec] = {}
        #: stream name (``NAME`` or ``NAME/dpR``) -> spec
        self.streams: dict[str, SubscriberSpec] = {}
        #: routable worker -> role (streams, and workers known only from a log)
        self.roles: dict[str, WorkerRole] = {}
        #: batches a worker's replay ring filled in, per worker
        self.replayed: dict[str, int] = {}
        #: workers whose prefix knowledge the gateway's truth loop distrusts (misaligned)
        self.distrusted: set[str] = set()
        #: workers the gateway found unreachable: out of routing until they answer
        self.unreachable: set[str] = set()

    def role_of_stream(self, name: str) -> WorkerRole:
        """The configured role of a stream (``both`` for one no spec names)."""
        sub = self.streams.get(name)
        return sub.role if sub is not None else WorkerRole.BOTH

    def routable(self, name: str) -> bool:
        """Known and not taken out of routing by the gateway."""
        return name in self.roles and name not in self.unreachable

    def cold(self, name: str, ingest_cold: bool) -> bool:
        """Route on load only: the index is not trusted for ``name`` (ingestion or truth loop)."""
        return ingest_cold or name in self.distrusted

    def names(self, also: Iterable[str] = ()) -> list[str]:
        """Every worker to report, streams first, in a stable order."""
        return list(dict.fromkeys([*self.streams, *self.roles, *also]))

    def check_put(self, spec: WorkerSpec) -> WorkerSpec | None:
        """Validate adding or replacing ``spec``; returns the spec it replaces (None if new).

        Names and endpoints of other workers may not be reused: two streams
        with one endpoint would feed one engine's events into two index entries.
        """
        old = self.specs.get(spec.name)
        taken = {
            ep: s.name
            for s in self.streams.values()
            if old is None or s.worker != spec.name
            for ep in (s.events, s.replay)
            if ep is not None
        }
        for sub in spec.subscribers():
            if sub.name in self.roles and (old is None or self.streams.get(sub.name, sub).worker != spec.name):
                raise WorkerConflictError(f"worker name {sub.name!r} is already in use")
            for ep in (sub.events, sub.replay):
                if ep is not None and ep in taken:
                    raise WorkerConflictError(f"endpoint {ep} is already used by worker {taken[ep]!r}")
        return old

    def streams_of(self, name: str) -> list[str]:
        """The stream names deleting ``name`` removes (a configured worker, or one stream)."""
        spec = self.specs.get(name)
        sub = self.streams.get(name)
        if spec is not None:
            return [s.name for s in spec.subscribers()]
        if sub is not None and sub.worker in self.specs:
            raise WorkerConflictError(f"{name!r} is one rank of worker {sub.worker!r}: delete {sub.worker!r}")
        if name in self.roles or name in self.streams:
            return [name]
        raise UnknownWorkerError(f"unknown worker {name!r}")

    def forget(self, names: Iterable[str]) -> None:
        """Drop streams (and what the gateway marked on them)."""
        for n in names:
            self.roles.pop(n, None)
            self.distrusted.discard(n)
            self.unreachable.discard(n)
            self.streams.pop(n, None)
            self.replayed.pop(n, None)
