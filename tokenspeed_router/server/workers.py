"""Who the router process is configured to follow: workers and their streams.

One job: configuration bookkeeping and its rules (names and endpoints
unique, a DP rank is deleted through its worker). What routing knows of a
worker -- its role, cold flag, the gateway's marks -- lives in the routing
core (``router/core.py``), which :meth:`check_put` and :meth:`streams_of`
consult through the ``roles`` mapping they are given. No I/O, no locks of its
own. Problems are domain errors (``WorkerConflictError``,
``UnknownWorkerError``); the API maps them to HTTP codes in one place
(``server/api.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tokenspeed_router.errors import UnknownWorkerError, WorkerConflictError
from tokenspeed_router.router.router import WorkerRole
from tokenspeed_router.server.config import SubscriberSpec, WorkerSpec

__all__ = ["WorkerRegistry"]


class WorkerRegistry:
    """Configured workers (by name) and streams (by stream name)."""

    def __init__(self) -> None:
        #: configured worker name -> spec (``--worker`` and ``PUT /workers``)
        self.specs: dict[str, WorkerSpec] = {}
        #: stream name (``NAME`` or ``NAME/dpR``) -> spec
        self.streams: dict[str, SubscriberSpec] = {}

    def role_of_stream(self, name: str) -> WorkerRole:
        """The configured role of a stream (``both`` for one no spec names)."""
        sub = self.streams.get(name)
        return sub.role if sub is not None else WorkerRole.BOTH

    def names(self, also: Iterable[str] = ()) -> list[str]:
        """Every worker to report, streams first, in a stable order."""
        return list(dict.fromkeys([*self.streams, *also]))

    def check_put(self, spec: WorkerSpec, roles: Mapping[str, WorkerRole]) -> WorkerSpec | None:
        """Validate adding or replacing ``spec``; returns the spec it replaces (None if new).

        Names and endpoints of other workers may not be reused: two streams
        with one endpoint would feed one engine's events into two index entries.
        ``roles``: the workers routing knows (the routing core's).
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
            if sub.name in roles and (old is None or self.streams.get(sub.name, sub).worker != spec.name):
                raise WorkerConflictError(f"worker name {sub.name!r} is already in use")
            for ep in (sub.events, sub.replay):
                if ep is not None and ep in taken:
                    raise WorkerConflictError(f"endpoint {ep} is already used by worker {taken[ep]!r}")
        return old

    def streams_of(self, name: str, roles: Mapping[str, WorkerRole]) -> list[str]:
        """The stream names deleting ``name`` removes (a configured worker, or one stream)."""
        spec = self.specs.get(name)
        sub = self.streams.get(name)
        if spec is not None:
            return [s.name for s in spec.subscribers()]
        if sub is not None and sub.worker in self.specs:
            raise WorkerConflictError(f"{name!r} is one rank of worker {sub.worker!r}: delete {sub.worker!r}")
        if name in roles or name in self.streams:
            return [name]
        raise UnknownWorkerError(f"unknown worker {name!r}")

    def forget(self, names: Iterable[str]) -> None:
        """Drop streams."""
        for n in names:
            self.streams.pop(n, None)
