"""The ``rag`` shape: questions over a large document pool whose popularity drifts."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import ClassVar

from tokenspeed_router.sim.shapes._core import (
    IdMint,
    Prompt,
    Shape,
    Turn,
    ZipfSampler,
    lognormal_int,
    param,
    require,
    single_turns,
)

__all__ = ["RagShape"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RagShape(Shape):
    """Retrieval-augmented requests: shared instructions + a retrieved document + a unique question.

    Each request retrieves one document of a pool of ``documents``; its prompt
    is the instructions every request shares, then the document (the same
    block ids for every request that retrieves it), then the question. Which
    document is retrieved follows a Zipf law over a popularity *ranking*, and
    the ranking drifts: every ``drift_interval_s`` a random
    ``drift_fraction`` of the ranks is reshuffled among themselves, so hot
    documents cool down and cold ones heat up while the skew stays. Requests
    are single-turn, Poisson.

    Grounding: RAGCache (Jin et al., arXiv 2404.12457; secondary summary):
    3 % of the documents receive 60 % of the retrievals, and retrieved
    documents add over 1,000 tokens to requests of about 100 tokens. The
    default exponent gives the top 3 % of the 2,000 documents 60 % of the
    requests (a unit test checks it). Output lengths are a lognormal fit
    (median 69, mean 149) to the Mooncake FAST'25 synthetic trace, which its
    authors built from ShareGPT, L-Eval and LooGLE. Pool size, document
    lengths and the drift are choices.
    """

    NAME: ClassVar[str] = "rag"
    SUMMARY: ClassVar[str] = ("RAG / document QA over a 2,000-document pool: Zipf popularity whose ranking "
                              "drifts over time, shared instructions, unique questions")
    SOURCES: ClassVar[tuple[str, ...]] = (
        "RAGCache, Jin et al., arXiv 2404.12457: 3 % of documents take 60 % of retrievals; retrieved "
        "documents add > 1,000 tokens to ~100-token requests (secondary summary)",
        "Mooncake FAST'25 synthetic trace (ShareGPT + L-Eval + LooGLE): output median 69, mean 149 "
        "(our statistics; Table 2 mean 149)",
        "choices: pool size, document lengths, drift interval and fraction",
    )
    RATE: ClassVar[str] = "rate_per_s"

    documents: int = param(2000, "documents in the pool (count; choice)")
    popularity_s: float = param(1.03, "Zipf exponent of document popularity (RAGCache: top 3 % -> 60 %)")
    drift_interval_s: float = param(60.0, "the popularity ranking drifts this often (s; choice)")
    drift_fraction: float = param(0.1, "share of ranks reshuffled at each drift, 0 = no drift (choice)")
    instruction_tokens: int = param(300, "instructions every request shares (tokens; choice)")
    document_tokens_median: int = param(2500, "median document length, lognormal (tokens; choice above "
                                              "RAGCache's > 1,000)")
    document_tokens_sigma: float = param(0.6, "log-space sigma of document lengths (choice)")
    document_tokens_max: int = param(16384, "longest document (tokens; choice)")
    question_tokens_median: int = param(100, "median question, lognormal (tokens; RAGCache ~100)")
    question_tokens_sigma: float = param(0.5, "log-space sigma of questions (choice)")
    output_tokens_median: int = param(69, "median answer, lognormal (tokens; Mooncake synthetic trace)")
    output_tokens_sigma: float = param(1.24, "log-space sigma of answers (mean 149; Mooncake synthetic trace)")
    output_tokens_max: int = param(893, "longest answer (tokens; Mooncake synthetic trace max)")
    rate_per_s: float = param(4.0, "requests per second, Poisson (1/s; choice, the Mooncake traces run at "
                                   "3.4-3.9)")

    def __post_init__(self) -> None:
        require(self.documents >= 1, "documents must be >= 1")
        require(self.popularity_s >= 0, "popularity_s must be >= 0")
        require(self.drift_interval_s > 0 and 0 <= self.drift_fraction <= 1,
                "drift_interval_s must be > 0 and drift_fraction in [0, 1]")
        require(self.instruction_tokens >= 1 and self.document_tokens_median >= 1
                and self.question_tokens_median >= 1 and self.output_tokens_median >= 1,
                "token lengths must be >= 1")
        require(self.document_tokens_median <= self.document_tokens_max
                and self.output_tokens_median <= self.output_tokens_max, "a median is above its max")
        require(min(self.document_tokens_sigma, self.question_tokens_sigma, self.output_tokens_sigma) >= 0,
                "sigmas must be >= 0")
        require(self.rate_per_s > 0, "rate_per_s must be > 0")

    def turns(self, rng: random.Random, requests: int, block: int) -> list[Turn]:
        mint = IdMint()
        instructions = Prompt().extended(self.instruction_tokens, block, mint)
        lengths = [lognormal_int(rng, self.document_tokens_median, self.document_tokens_sigma, 1,
                                 self.document_tokens_max) for _ in range(self.documents)]
        docs: dict[int, Prompt] = {}  # built on first retrieval: ids in order of first use
        ranking = list(range(self.documents))  # rank -> document
        rng.shuffle(ranking)
        pick_rank = ZipfSampler(self.documents, self.popularity_s)
        reshuffle = round(self.drift_fraction * self.documents)
        epoch = [0]

        def drift_to(t: float) -> None:
            now = max(0, math.floor(t / self.drift_interval_s))
            while epoch[0] < now:
                epoch[0] += 1
                if reshuffle >= 2:
                    ranks = rng.sample(range(self.documents), reshuffle)
                    moved = [ranking[r] for r in ranks]
                    rng.shuffle(moved)
                    for r, d in zip(ranks, moved, strict=True):
                        ranking[r] = d

        def start(t: float, session: int, _key: object) -> Turn:
            drift_to(t)
            doc = ranking[pick_rank(rng)]
            prompt = docs.get(doc)
            if prompt is None:
                prompt = docs[doc] = instructions.extended(lengths[doc], block, mint)
            question = lognormal_int(rng, self.question_tokens_median, self.question_tokens_sigma, 1, 1 << 20)
            output = lognormal_int(rng, self.output_tokens_median, self.output_tokens_sigma, 1,
                                   self.output_tokens_max)
            return Turn(t, prompt.extended(question, block, mint), output, session, doc)

        return single_turns(rng, requests, self.rate_per_s, start)
