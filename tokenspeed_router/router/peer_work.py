"""What router replicas exchange besides load totals: their requests, one event at a time.

Between routing a prompt to a worker and that engine's ``BlockStored``
arriving, a router bridges the gap with a prediction (predict-on-route: the
worker will hold the prompt's blocks). Each replica's predictions used to be
private, so a second replica sent the next request with the same prefix
elsewhere, exactly in the window where sharing matters. A peer-load provider
that also implements :class:`PeerPredictions` publishes every route's
prefix hashes and hands the peers' to the router, which remembers them as
if it had routed them itself (``Router._remember``).

The hashes are the router's approximate-store content hashes (§4 chained
block hashes at ``approx_block_size``): identical in every process, so a
peer's prediction means the same blocks here.

The cost model also keeps each engine's prefill queue as a clock of the
prefills routed there (``router/cost.py``). A route event carries the
request's key and its predicted uncached tokens, and the peer's first token
and end follow as :class:`PeerPrefillDone` and :class:`PeerEnded`, so every
replica's clock holds every replica's prefills in order: with the messages
delivered at once, replicas decide exactly as one router (DESIGN §8). Keys
are unique across replicas (the provider prefixes the replica's id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["PeerEnded", "PeerEvent", "PeerPrediction", "PeerPredictions", "PeerPrefillDone"]


@dataclass(frozen=True, slots=True)
class PeerPrediction:
    """Another replica routed a prompt with these block hashes to these workers.

    ``workers[0]`` prefills it; ``request`` (its replica-unique key) and
    ``uncached`` (the prompt tokens it predicted that worker computes) put
    the prefill on that engine's clock here too. A peer of an older release
    sends neither (``request`` empty): only the prediction is kept.
    ``history``: the prompt carried a session's own history there
    (``router/cost.py``, "Sessions in flight"), so every replica learns the
    same share of such requests.
    """

    workers: tuple[str, ...]
    hashes: tuple[int, ...]
    request: str = ""
    uncached: int = 0
    at: float | None = None
    """When it was received, on the receiving router's clock (None: when taken)."""
    history: bool = False


@dataclass(frozen=True, slots=True)
class PeerPrefillDone:
    """The first token of a peer's request came out: its prefill left the engine's queue."""

    request: str
    at: float | None = None


@dataclass(frozen=True, slots=True)
class PeerEnded:
    """A peer's request finished (released, or expired there)."""

    request: str
    at: float | None = None


PeerEvent = PeerPrediction | PeerPrefillDone | PeerEnded


@runtime_checkable
class PeerPredictions(Protocol):
    """Exchange of requests between replicas (every call is cheap, never blocks).

    ``routed`` is called on the routing thread after every route of a cost
    policy, ``prefill_done`` at its first token, ``ended`` when it is
    released or expires; ``take_predictions`` returns (and forgets) the
    peers' events since the last call, oldest first. All run under the
    router's caller lock.
    """

    def routed(self, workers: tuple[str, ...], hashes: Sequence[int], request: str = "",
               uncached: int = 0, *, history: bool = False) -> None: ...

    def prefill_done(self, request: str) -> None: ...

    def ended(self, request: str) -> None: ...

    def take_predictions(self) -> list[PeerEvent]: ...
