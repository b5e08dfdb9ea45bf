"""One request's bookkeeping in the router, whoever carries its bytes.

The HTTP gateway (``proxy.py``) carries a request to an engine itself; the
endpoint picker (``epp/``) only names the engine and watches Envoy carry it.
Both keep the router's books the same way, through this one piece:

* :meth:`RequestAccounting.token_ids` — the prompt's token ids (as given, or
  the ``--tokenizer``; a failure is counted and routed on load alone);
* :meth:`RequestAccounting.plan` — the routing decision, counted in flight,
  turned into destinations, with the index's view of the chosen worker's
  prefix from the same walk (the truth loop's prediction);
* :meth:`RequestAccounting.prefill_done` — the first generated token: the
  prefill no longer queues (and the cost model fits its prefill rate);
* :meth:`RequestAccounting.learn` — the engine's ``usage.cached_tokens``
  against that prediction (the truth loop, ``truth.py``);
* :meth:`RequestAccounting.release` — the end, however it came.

Errors come out as :class:`~tokenspeed_router.gateway.openai.OpenAIError`
(a status and a message) for each front end to answer in its own shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenspeed_router.errors import NoWorkerAvailableError, TokenspeedError, api_error
from tokenspeed_router.gateway.host import GatewayHost
from tokenspeed_router.gateway.openai import OpenAIError, ParsedRequest
from tokenspeed_router.gateway.tokenize import PromptTokenizer, TokenizeError
from tokenspeed_router.gateway.truth import TruthLoop, TruthSample, cap_prediction
from tokenspeed_router.gateway.upstream import Target, Upstreams
from tokenspeed_router.router.decision import RouteDecision

__all__ = ["GatewayStats", "Plan", "RequestAccounting"]

logger = logging.getLogger(__name__)


class _UsageOnly(msgspec.Struct):
    """An answer's ``usage`` (msgspec skips every other field without building it)."""

    usage: Any = None


_usage_decoder = msgspec.json.Decoder(_UsageOnly)


@dataclass
class GatewayStats:
    """Plain counters, mutated on the event loop only and exported at scrape time."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (worker, outcome) -> n
    retries: int = 0
    tokenize_failures: int = 0
    disconnects: int = 0

    def count(self, worker: str, outcome: str) -> None:
        key = (worker, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1


@dataclass
class Plan:
    """A routing decision turned into destinations."""

    request_id: str
    site: Target  # where the prompt is prefilled
    decode: Target  # where tokens are generated (== site unless remote prefill)
    remote_prefill: bool
    predicted: int  # index view of the site's prefix, in tokens (0 when unknown)
    block_size: int  # the site's, from the index (0: it has stored nothing yet)
    peer_block_size: int  # what the other workers use (the truth loop's unit when block_size is 0)
    decision: RouteDecision


class RequestAccounting:
    """The router's books for requests (module docstring); one per front end."""

    def __init__(self, service: GatewayHost, upstreams: Upstreams, tokenizer: PromptTokenizer,
                 truth: TruthLoop, stats: GatewayStats) -> None:
        self._service = service
        self._up = upstreams
        self._tokenizer = tokenizer
        self._truth = truth
        self.stats = stats
        self._turn = 0
        self._warned_tokenize = False

    # --- token ids -----------------------------------------------------------------

    async def token_ids(self, req: ParsedRequest) -> list[int]:
        """The prompt's token ids; ``[]`` (route on load) when tokenizing fails."""
        if req.token_ids is not None:
            return req.token_ids
        self._turn += 1
        url = self._up.any_url(self._turn)
        try:
            if req.kind == "chat":
                return await self._tokenizer.chat_tokens(req.body, url)
            assert req.text is not None
            return await self._tokenizer.completion_tokens(req.text, req.body, url)
        except TokenizeError as err:
            self.stats.tokenize_failures += 1
            if not self._warned_tokenize:
                self._warned_tokenize = True
                logger.warning("tokenizing a prompt failed (%s): routing such requests on load only "
                               "(tokenspeed_gateway_tokenize_failures_total counts them)", err)
            return []

    # --- routing -------------------------------------------------------------------

    def plan(self, tokens: list[int], request_id: str, explain: bool = False) -> Plan:
        """Route ``tokens`` (counted in flight under ``request_id``) and find the destinations."""
        return self.plan_with(lambda: self._service.route(tokens, request_id=request_id, explain=explain), tokens)

    def plan_with(self, decide: Callable[[], RouteDecision], tokens: list[int]) -> Plan:
        """:meth:`plan` with the decision taken by ``decide()`` (the picker's ranked route)."""
        service = self._service
        try:
            decision = decide()
            # the truth loop's prediction: the event index's view from the routing walk itself;
            # a policy that reads no index (a baseline, approx) leaves it to one walk here
            view = decision.index_match
            if view is None and tokens:
                view = service.match(tokens)
        except NoWorkerAvailableError as err:
            down = sorted(self._up.down())
            message = f"no worker available (down: {', '.join(down)})" if down else api_error(err).message
            raise OpenAIError(503, message, code="no_worker_available") from None
        except TokenspeedError as err:
            refused = api_error(err)
            raise OpenAIError(refused.status, refused.message, code="invalid_value") from None
        request_id = decision.request_id
        targets = self._up.targets()
        site_name = decision.worker
        decode_name = decision.decode_worker
        site = targets.get(site_name)
        decode = targets.get(decode_name)
        if site is None or decode is None:
            service.release(request_id)
            missing = site_name if site is None else decode_name
            if not targets:
                raise OpenAIError(503, "no worker has a url: give workers url=http://HOST:PORT to proxy to them",
                                  code="no_worker_available")
            raise OpenAIError(503, f"the router chose worker {missing!r}, which has no url to proxy to",
                              code="no_worker_available")
        predicted, block_size, peer_block_size = 0, 0, 16
        if view is not None:
            block_size = view.block_size.get(site_name) or 0
            predicted = view.scores.get(site_name, 0) * block_size
            peer_block_size = max(view.block_size.values(), default=16) or 16
        return Plan(request_id, site, decode, decision.prefill_worker is not None, predicted, block_size,
                    peer_block_size, decision)

    def prefill_done(self, request_id: str) -> None:
        """The first generated token came out: the prefill no longer queues."""
        self._service.mark_prefill_done(request_id)

    def release(self, request_id: str) -> None:
        """The request ended (answered, failed, or its client went away)."""
        self._service.release(request_id)

    # --- truth loop -------------------------------------------------------------------

    def learn_json(self, stream: str, plan: Plan, tokens: list[int], content: bytes) -> None:
        """:meth:`learn` from a whole JSON answer (its ``usage``, when it has one)."""
        if b'"usage"' not in content:
            return
        try:
            answer = _usage_decoder.decode(content)
        except msgspec.DecodeError:  # ValidationError (not an object) included
            return
        self.learn(stream, plan, tokens, answer.usage)

    def learn(self, stream: str, plan: Plan, tokens: list[int], usage: Any) -> None:
        """Compare the engine's reported reuse with the index's prediction for ``stream``."""
        if not tokens or not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details")
        reported = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(reported) is not int:
            self._truth.observe_unreported(stream)
            return
        # a lock-free read of one worker's state (benign race: at worst one sample more or less)
        if self._service.is_cold(stream):
            return  # its index entries are known to be incomplete (stale, resyncing): no evidence
        prompt_tokens = usage.get("prompt_tokens")
        n = prompt_tokens if type(prompt_tokens) is int and prompt_tokens > 0 else len(tokens)
        # the worker had published nothing we held when routed: judge in the block size its peers use
        bs = plan.block_size if plan.block_size > 0 else plan.peer_block_size
        predicted = cap_prediction(plan.predicted, n, bs)
        sample = TruthSample(predicted, reported, bs)
        if sample.too_high():
            # Did events explain it meanwhile (a sibling's blocks)? A second look, taken now,
            # only for the rare answer that reused more than predicted.
            view = self._service.match(tokens)
            after = view.scores.get(stream, 0) * (view.block_size.get(stream) or bs)
            if after:
                sample = TruthSample(predicted, reported, bs, cap_prediction(after, n, bs))
        self._truth.observe(stream, sample)
