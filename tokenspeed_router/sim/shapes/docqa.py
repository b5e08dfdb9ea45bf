"""The ``docqa`` shape: many questions over a few very long documents."""

from __future__ import annotations

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

__all__ = ["DocQAShape"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DocQAShape(Shape):
    """Long-document QA: a long shared prefix (instructions + one document), a short unique question.

    ``documents`` long documents are fixed for the whole trace; each request
    asks one question about one of them (uniform by default, Zipf with
    ``popularity_s`` > 0). Every request's prompt is the shared instructions,
    the whole document (the same block ids for every question on it), then
    its own short question. Single-turn, Poisson arrivals.

    Grounding: LooGLE (Li et al., ACL'24; abstract and dataset card) has
    documents of over 24,000 tokens and about 6,000 questions on them (776
    documents, 6,448 questions in a secondary summary); Preble
    (Srivatsa et al., ICLR'25) evaluates long-document QA on LooGLE, its
    configuration ``e2e_loogle_config.py`` (WukLab/preble) uses 24 documents,
    168-673 requests at 0.3-1.2 req/s and a 32,768-token context. Document
    lengths are drawn between LooGLE's 24 k and that 32 k context. Output
    lengths are the Mooncake synthetic trace's fit (its sources include
    LooGLE). Question lengths and the instructions are choices.
    """

    NAME: ClassVar[str] = "docqa"
    SUMMARY: ClassVar[str] = ("many questions over a few very long documents: 24 documents of 24-32k tokens "
                              "shared as prefixes, short unique questions")
    SOURCES: ClassVar[tuple[str, ...]] = (
        "LooGLE, Li et al., ACL'24: documents of over 24,000 tokens, about 6,000 questions (776 documents, "
        "6,448 questions: secondary summary)",
        "Preble, Srivatsa et al., ICLR'25, long-document QA on LooGLE; WukLab/preble "
        "multi_node/benchmarks/multi_exp_configs/e2e_loogle_config.py: 24 documents, 0.3-1.2 req/s, "
        "32,768-token context",
        "Mooncake FAST'25 synthetic trace (includes LooGLE): output median 69, mean 149 (our statistics)",
    )
    RATE: ClassVar[str] = "rate_per_s"

    documents: int = param(24, "long documents asked about (count; Preble's LooGLE runs)")
    document_min_tokens: int = param(24000, "shortest document, uniform draw (tokens; LooGLE > 24k)")
    document_max_tokens: int = param(32000, "longest document, uniform draw (tokens; under Preble's 32,768 "
                                            "context)")
    popularity_s: float = param(0.0, "Zipf exponent of document popularity, 0 = uniform (choice)")
    instruction_tokens: int = param(200, "instructions before the document, shared by all (tokens; choice)")
    question_tokens_median: int = param(30, "median question, lognormal (tokens; choice)")
    question_tokens_sigma: float = param(0.5, "log-space sigma of questions (choice)")
    output_tokens_median: int = param(69, "median answer, lognormal (tokens; Mooncake synthetic trace)")
    output_tokens_sigma: float = param(1.24, "log-space sigma of answers (mean 149; Mooncake synthetic trace)")
    output_tokens_max: int = param(893, "longest answer (tokens; Mooncake synthetic trace max)")
    rate_per_s: float = param(1.0, "questions per second, Poisson (1/s; Preble's LooGLE runs use 0.3-1.2)")

    def __post_init__(self) -> None:
        require(self.documents >= 1, "documents must be >= 1")
        require(0 < self.document_min_tokens <= self.document_max_tokens,
                "need 0 < document_min_tokens <= document_max_tokens")
        require(self.popularity_s >= 0, "popularity_s must be >= 0")
        require(self.instruction_tokens >= 1 and self.question_tokens_median >= 1
                and self.output_tokens_median >= 1, "token lengths must be >= 1")
        require(self.output_tokens_median <= self.output_tokens_max, "output_tokens_median > output_tokens_max")
        require(min(self.question_tokens_sigma, self.output_tokens_sigma) >= 0, "sigmas must be >= 0")
        require(self.rate_per_s > 0, "rate_per_s must be > 0")

    def turns(self, rng: random.Random, requests: int, block: int) -> list[Turn]:
        mint = IdMint()
        instructions = Prompt().extended(self.instruction_tokens, block, mint)
        docs = [instructions.extended(rng.randint(self.document_min_tokens, self.document_max_tokens),
                                      block, mint)
                for _ in range(self.documents)]
        pick = ZipfSampler(self.documents, self.popularity_s)

        def start(t: float, session: int, _key: object) -> Turn:
            doc = pick(rng)
            question = lognormal_int(rng, self.question_tokens_median, self.question_tokens_sigma, 1, 1 << 20)
            output = lognormal_int(rng, self.output_tokens_median, self.output_tokens_sigma, 1,
                                   self.output_tokens_max)
            return Turn(t, docs[doc].extended(question, block, mint), output, session, doc)

        return single_turns(rng, requests, self.rate_per_s, start)
