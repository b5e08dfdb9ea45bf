"""vllm-router ``kv_aware``, emulated from the source of the release it is compared with.

Reference: vllm-router **0.1.17** from PyPI, its sdist's Rust source
(``pip download vllm-router==0.1.17 --no-binary :all: --no-deps``):
``src/policies/kv_aware.rs`` (``MultiplicativeScorer``, ``TemperaturePicker``,
``KvAwarePolicy::pick_among``, ``credited_tokens``, ``InMemorySlotManager``),
``src/routers/http/router.rs`` (``LoadTrackedBody``: when a request's prefill
stops counting) and ``src/main.rs`` (CLI defaults). docs/compare-routers.md
has the full reading. A GitHub revision is not the reference: the policy was
rewritten between them (an earlier revision scored the longest prefix only,
with load as a fallback at score 0; 0.1.17 is a cost model).

For a prompt of ``n`` tokens and block size ``bs`` (``--kv-event-block-size``, 16)::

    credited(w)  = min(device_prefix_blocks(w), (n - 1) // bs) * bs        # capped at n - 1
    new(w)       = n - credited(w)                                        # >= 1: the last token
    cost(w)      = (new(w) + active_prefill_tokens(w)) * (active_requests(w) + 1)

* ``device_prefix_blocks``: leading blocks of the prompt the event-fed radix
  index says ``w`` holds on the GPU (host/external/disk continuations get
  credit 0.8/0.6/0.3; engine-sim publishes GPU blocks only);
* ``active_prefill_tokens``: the ``new`` tokens of requests routed to ``w``
  whose response has not yet sent its first body frame (for a streaming
  completion: the first token), router-side (``InMemorySlotManager``);
* ``active_requests``: requests routed to ``w`` and not finished
  (``max(slot count, Worker::load())``).

``--router-temperature`` defaults to 0: the argmin, the *first* minimum in the
worker order on a tie (``Iterator::min_by`` with ``total_cmp``). A cost of 0
(only a prompt without tokens) picks among the zero-cost workers by
(``ptoken``, ``active_requests``). Session affinity is off unless
``--kv-aware-session-affinity-ttl-secs`` is given. No speculative index
entries, no TTL: credit comes only from KV events (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``; a seq gap replays from the replay
endpoint or drops the worker's entries; a seq going back is a restart and
drops them too), which the emulation's ``KvIndex``/``IndexIngestor`` path
does alike.

The multiplication is what balances it: a holder with ``k`` requests in
flight costs ``k + 1`` times its prefill work, so a hot shared prefix
spreads over the fleet once its holder is busy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from tokenspeed_router.sim.peers.base import PeerBackend, RouteInput

__all__ = ["VllmKvAwareBackend", "vllm_kv_aware_choice", "vllm_kv_aware_costs", "vllm_new_prefill_tokens"]


def vllm_new_prefill_tokens(num_tokens: int, device_blocks: int, block_size: int) -> int:
    """``request_prefill_tokens``: the prompt minus its credited prefix (the last token never credited)."""
    if num_tokens <= 0:
        return 0
    credited = min(device_blocks, (num_tokens - 1) // block_size) * block_size
    return num_tokens - min(credited, num_tokens - 1)


def vllm_kv_aware_costs(
    workers: Sequence[str],
    num_tokens: int,
    device_blocks: Mapping[str, int],
    active_prefill_tokens: Mapping[str, int],
    active_requests: Mapping[str, int],
    block_size: int,
) -> dict[str, tuple[float, int, int]]:
    """Per worker: (``MultiplicativeScorer``'s cost, ``ptoken``, ``batchsize``)."""
    out: dict[str, tuple[float, int, int]] = {}
    for w in workers:
        ptoken = vllm_new_prefill_tokens(num_tokens, device_blocks.get(w, 0), block_size) \
            + active_prefill_tokens.get(w, 0)
        batch = active_requests.get(w, 0)
        out[w] = (float(ptoken * (batch + 1)), ptoken, batch)
    return out


def vllm_kv_aware_choice(workers: Sequence[str], costs: Mapping[str, tuple[float, int, int]],
                         has_tokens: bool = True) -> str:
    """``pick_among`` at temperature 0: the first minimum cost; zero costs by (ptoken, batchsize)."""
    zero = [w for w in workers if costs[w][0] == 0.0]
    if zero:
        return min(zero, key=lambda w: (costs[w][1] if has_tokens else 0, costs[w][2]))  # first minimum
    return min(workers, key=lambda w: costs[w][0])  # min() keeps the first of equal keys, as min_by


class VllmKvAwareBackend(PeerBackend):
    """``--policy vllm_kv_aware``: vllm-router 0.1.17 ``--policy kv_aware`` with its defaults."""

    name = "vllm_kv_aware"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._costs: dict[str, tuple[float, int, int]] = {}

    def choose(self, inp: RouteInput, tokens: np.ndarray) -> str:
        loads = inp.loads
        self._costs = costs = vllm_kv_aware_costs(
            inp.workers, inp.num_tokens, inp.matched_blocks,
            {w: loads[w].prefill_tokens() for w in inp.workers},
            {w: loads[w].requests for w in inp.workers}, inp.block_size)
        return vllm_kv_aware_choice(inp.workers, costs, has_tokens=inp.num_tokens > 0)

    def prefill_tokens(self, inp: RouteInput, worker: str) -> int:
        return vllm_new_prefill_tokens(inp.num_tokens, inp.matched_blocks.get(worker, 0), inp.block_size)

    def predicted_hit(self, inp: RouteInput, worker: str) -> int | None:
        return inp.num_tokens - self.prefill_tokens(inp, worker)
