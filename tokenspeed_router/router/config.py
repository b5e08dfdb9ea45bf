"""The router's configuration and the value types its callers see.

:class:`RouterConfig` holds what the cost model (``router/cost.py``) and the
router (``router/router.py``) read, validated once on construction; the
rest are the small types that cross the router's boundary (roles, the
load-provider and peer-load seams, frozen statistics snapshots).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.router.scoring import CostWeights, Policy, WorkerLoad

__all__ = [
    "EngineEstimate",
    "LoadProvider",
    "PeerLoad",
    "RouterConfig",
    "RouterStatistics",
    "WorkerInfo",
    "WorkerRole",
]


class WorkerRole(str, enum.Enum):
    """What a worker may do in disaggregated serving."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


#: ``load_provider(worker) -> WorkerLoad | None``: the caller's view of a
#: worker's load (e.g. the simulator's real queues). ``None`` means "use the
#: router's own in-flight tracking for this worker".
LoadProvider = Callable[[str], "WorkerLoad | None"]


class PeerLoad(Protocol):
    """Load that other router replicas have in flight, per worker.

    ``peers()`` is read once per routing decision and must be cheap (a cached
    mapping, never a network round trip); ``changed()`` is called whenever this
    router's own in-flight load changes (admit, release, prefill done, expiry)
    so the implementation can publish it soon. Both run under the caller's
    lock, on the routing thread.
    """

    def peers(self) -> Mapping[str, WorkerLoad]: ...

    def changed(self) -> None: ...


def _finite_nonneg(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """Routing policy and the cost model's knobs (validated on construction).

    The cost of a candidate is an estimated time to first token in seconds
    (``router/cost.py``): ``queue_weight`` times the engine's queue clock,
    plus the wait for cache room (``admission_wait``), plus this request's
    own prefill there -- its per-prefill overhead and ``prefill_weight``
    times its uncached prompt tokens over the engine's prefill rate --
    multiplied by the sessions in flight there (``inflight_factor``; the
    queue is not multiplied); plus ``decode_weight``
    times the context tokens in flight there and ``request_weight`` times
    its requests in flight over the rate (fitted from first tokens, starting
    from ``prefill_tokens_per_s`` / ``prefill_overhead_s``).
    Credits are trimmed to the blocks expected to survive until the prefill
    starts; a routed prompt is predicted on its engine until that engine's
    ``BlockStored`` can have arrived (``predict_on_route_ttl_s`` at most).
    What each default rests on, and on which workloads it was chosen, is in
    docs/routing.md.
    """

    #: One of :class:`Policy` (a plain string such as ``"round_robin"`` works).
    policy: Policy | str = Policy.KV_AWARE
    prefill_weight: float = 1.0
    #: A hot prefix (one at least two engines hold) that a candidate lacks is priced at
    #: its recompute time (weight 1), not at ``prefill_weight``: when its holders queue
    #: longer than recomputing it elsewhere costs, it goes to one more engine
    #: (docs/routing.md, "Hot prefixes"). False: every uncached token at ``prefill_weight``.
    replicate_hot_prefixes: bool = True
    queue_weight: float = 1.0
    decode_weight: float = 0.02
    request_weight: float = 0.0
    #: Sessions in flight push new work away: this request's own prefill time on an engine
    #: (overhead and uncached tokens; not the queue) is multiplied by ``1 + inflight_factor *
    #: share * requests in flight there``, where ``share`` is the learnt fraction of requests that carry a
    #: session's own history (docs/routing.md, "Sessions in flight"). 0 turns it off.
    inflight_factor: float = 1.0
    #: Price the wait for cache room: a prompt whose new blocks do not fit beside the
    #: blocks that requests in flight pin waits for some of them to finish
    #: (docs/routing.md, "Room in the cache"). Only with the router's own load tracking.
    admission_wait: bool = True
    #: Fraction of a block's prefill a CPU-tier (resp. storage-tier) hit saves.
    cpu_hit_credit: float = 0.75
    storage_hit_credit: float = 0.25
    #: 0 = argmin of the cost; > 0 = softmax sampling over range-normalised costs.
    temperature: float = 0.0
    #: Seed of the router's own ``random.Random`` when none is passed in.
    seed: int = 0
    #: In-flight entries not released within this time stop counting as load.
    inflight_timeout_s: float = 300.0
    #: P/D: skip remote prefill when the decode worker misses at most this many tokens.
    local_prefill_threshold_tokens: int = 512
    #: Approximate prefix store (workers without events, ``approx`` policy).
    approx_block_size: int = 64
    approx_ttl_s: float = 120.0
    approx_max_blocks_per_worker: int = 100_000
    #: > 0: credit a routed prompt on its engine (the deeper of index and prediction)
    #: until the engine's BlockStored can have arrived, at most this long, so that
    #: siblings arriving before the events still co-locate (Dynamo's predict-on-route).
    #: 0 disables it.
    predict_on_route_ttl_s: float = 15.0
    #: Prefix of generated request ids; None = a random one per Router.
    request_id_prefix: str | None = None
    #: The cost model: ``"v2"``, the only one (the token-unit ``"v1"`` of earlier
    #: releases was removed; a config naming it is refused with that reason).
    cost_model: str = "v2"
    #: prior prefill rate and per-prefill overhead, until fitted from first tokens
    prefill_tokens_per_s: float = 10_000.0
    prefill_overhead_s: float = 0.020
    #: fit rate and overhead per engine from observed prefills (False: keep the priors)
    fit_prefill: bool = True
    #: a prediction ends this long after its request's first token at the latest
    #: (the wait for the engine's BlockStored; the first BlockStored batch ends it sooner)
    prediction_grace_s: float = 1.0
    #: an engine's KV capacity in tokens for the survival estimate; 0 = learn it
    #: from its events (the blocks it held when it first evicted)
    engine_capacity_tokens: int = 0
    #: blocks whose age is within this fraction below the horizon count half
    survival_band: float = 0.2

    def __post_init__(self) -> None:
        try:
            policy = Policy(self.policy)
        except ValueError:
            names = ", ".join(p.value for p in Policy)
            raise ConfigError(f"unknown policy {self.policy!r}; expected one of {names}") from None
        object.__setattr__(self, "policy", policy)
        for name in ("prefill_weight", "queue_weight", "decode_weight", "request_weight", "inflight_factor"):
            _finite_nonneg(name, getattr(self, name))
        for name in ("cpu_hit_credit", "storage_hit_credit"):
            value = getattr(self, name)
            _finite_nonneg(name, value)
            if value > 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {value!r}")
        _finite_nonneg("temperature", self.temperature)
        _positive("inflight_timeout_s", self.inflight_timeout_s)
        _positive("approx_ttl_s", self.approx_ttl_s)
        _finite_nonneg("predict_on_route_ttl_s", self.predict_on_route_ttl_s)
        if self.cost_model != "v2":
            why = " (cost model v1 was removed: the router runs one cost model)" if self.cost_model == "v1" else ""
            raise ConfigError(f"cost_model must be 'v2', got {self.cost_model!r}{why}")
        _positive("prefill_tokens_per_s", self.prefill_tokens_per_s)
        _finite_nonneg("prefill_overhead_s", self.prefill_overhead_s)
        _finite_nonneg("prediction_grace_s", self.prediction_grace_s)
        _finite_nonneg("survival_band", self.survival_band)
        if self.survival_band >= 1.0:
            raise ConfigError(f"survival_band must be in [0, 1), got {self.survival_band!r}")
        for name in ("fit_prefill", "replicate_hot_prefixes", "admission_wait"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in (
            "local_prefill_threshold_tokens",
            "engine_capacity_tokens",
            "approx_block_size",
            "approx_max_blocks_per_worker",
            "seed",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{name} must be an int, got {value!r}")
        if self.local_prefill_threshold_tokens < 0 or self.engine_capacity_tokens < 0:
            raise ConfigError("local_prefill_threshold_tokens and engine_capacity_tokens must be >= 0")
        if self.approx_block_size <= 0 or self.approx_max_blocks_per_worker <= 0:
            raise ConfigError("approx_block_size and approx_max_blocks_per_worker must be > 0")

    @property
    def policy_name(self) -> str:
        """The policy as its string value."""
        return Policy(self.policy).value

    def weights(self) -> CostWeights:
        """The cost weights as one struct (for ``scoring.worker_cost``)."""
        return CostWeights(
            prefill_weight=self.prefill_weight,
            queue_weight=self.queue_weight,
            decode_weight=self.decode_weight,
            request_weight=self.request_weight,
            inflight_factor=self.inflight_factor,
            followup_share=0.0,
            cpu_hit_credit=self.cpu_hit_credit,
            storage_hit_credit=self.storage_hit_credit,
        )


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """How the router knows a worker."""

    role: WorkerRole
    events: bool
    cold: bool


@dataclass(frozen=True, slots=True)
class RouterStatistics:
    """Counters since construction (a frozen snapshot)."""

    routed: int
    released: int
    expired: int
    in_flight: int
    remote_prefills: int
    local_prefills: int


@dataclass(frozen=True, slots=True)
class EngineEstimate:
    """What cost model v2 believes about one engine (``Router.engine_estimates``).

    ``queue_s``: seconds of prefill queued ahead of a request routed now;
    ``queued_prefills``: prefills queued or running; the fitted
    ``prefill_tokens_per_s`` and ``prefill_overhead_s`` (``fit_samples``
    prefills seen); ``capacity_tokens``: the eviction horizon (None: unknown,
    no eviction seen yet); ``predictions``: requests whose store is bridged;
    ``resident_new_tokens``: the new tokens the requests in flight there pin,
    and ``residence_s`` how long a request stays (the cache-room wait).
    """

    queue_s: float
    queued_prefills: int
    prefill_tokens_per_s: float
    prefill_overhead_s: float
    fit_samples: int
    capacity_tokens: int | None
    predictions: int
    resident_new_tokens: int = 0
    residence_s: float = 0.0

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "queue_s": self.queue_s,
            "queued_prefills": self.queued_prefills,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "prefill_overhead_s": self.prefill_overhead_s,
            "fit_samples": self.fit_samples,
            "capacity_tokens": self.capacity_tokens,
            "predictions": self.predictions,
            "resident_new_tokens": self.resident_new_tokens,
            "residence_s": self.residence_s,
        }


