"""What router replicas exchange besides load: the prefixes they just routed.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["PeerPrediction", "PeerPredictions"]


@dataclass(frozen=True, slots=True)
class PeerPrediction:
    """Another replica routed a prompt with these block hashes to these workers."""

    workers: tuple[str, ...]
    hashes: tuple[int, ...]


@runtime_checkable
class PeerPredictions(Protocol):
    """Exchange of route predictions between replicas (both calls are cheap, never block).

    ``routed`` is called on the routing thread after every KV-aware route;
    ``take_predictions`` returns (and forgets) what the peers routed since the
    last call, oldest first. Both run under the router's caller lock.
    """

    def routed(self, workers: tuple[str, ...], hashes: Sequence[int]) -> None: ...

    def take_predictions(self) -> list[PeerPrediction]: ...
