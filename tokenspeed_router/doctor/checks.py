"""The named checks (DESIGN §13), and for each failure its likely cause and the flag that fixes it.

The causes are the ones users of KV-aware routers report most ("overlap is
always 0", "it behaves like round robin"): events that never arrive, a block
size that differs between the cache and its events, a tokenizer or chat
template that differs between router and engine, block ids hashed with
different seeds, usage without ``cached_tokens``, DP ranks, LoRA or salt
that disagree with the worker spec. Each is one entry of :data:`CAUSES`, so
the wording and the fix live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CAUSES", "CHECK_NAMES", "Cause", "Check"]

#: the check names, in the order they are reported
CHECK_NAMES = ("events", "block_size", "tokens", "hashes", "usage", "reuse", "spec")


@dataclass(frozen=True, slots=True)
class Cause:
    cause: str
    fix: str


@dataclass(frozen=True, slots=True)
class Check:
    """One check's outcome for one engine."""

    name: str
    ok: bool
    detail: str
    cause: str | None = None
    fix: str | None = None

    @classmethod
    def passed(cls, name: str, detail: str) -> Check:
        return cls(name, True, detail)

    @classmethod
    def failed(cls, name: str, detail: str, why: str | Cause) -> Check:
        c = CAUSES[why] if isinstance(why, str) else why
        return cls(name, False, detail, c.cause, c.fix)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "ok": self.ok, "detail": self.detail}
        if self.cause is not None:
            out["cause"] = self.cause
        if self.fix is not None:
            out["fix"] = self.fix
        return out


_EVENTS_CONFIG = ("vLLM: --kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                  "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' (with prefix "
                  "caching on); SGLang: --kv-events-config '{\"publisher\": \"zmq\", \"endpoint\": "
                  "\"tcp://*:5557\"}'; then events=tcp://HOST:5557 in --worker")

CAUSES: dict[str, Cause] = {
    "no_events": Cause(
        "the engine publishes no KV events for the canary: event publishing is off (no "
        "--kv-events-config), prefix caching is off, the worker spec's events endpoint/topic "
        "is not the one the engine publishes on, or the engine has more DP ranks than the spec's "
        "dp_ranks= (the canary went to a rank nobody follows: rank r publishes on port + r)",
        _EVENTS_CONFIG),
    "not_connected": Cause(
        "nothing accepts a connection on the worker spec's events endpoint: the engine does not "
        "publish there (no --kv-events-config, another port or host)",
        _EVENTS_CONFIG),
    "crossed_events": Cause(
        "the worker spec's url= and events= belong to different engines: the canary sent to this "
        "worker's url= was published on another worker's events endpoint, so the router credits "
        "each engine's cache to the wrong worker",
        "give every --worker the url=, events= and replay= of one and the same engine (swap the "
        "crossed endpoints back)"),
    "topic": Cause(
        "the worker spec's topic= is not the topic the engine publishes under: ZeroMQ drops "
        "every message whose topic does not start with the subscription, so the router sees "
        "nothing",
        "topic= in --worker equal to the engine's topic (vLLM: \"topic\" in --kv-events-config), "
        "or leave topic= out to accept any"),
    "no_replay": Cause(
        "nothing answers on the worker spec's replay endpoint: the router cannot heal a gap in "
        "the stream and falls back to a full resync of the worker on every lost message",
        "replay= in --worker equal to the engine's replay_endpoint (vLLM: \"replay_endpoint\" in "
        "--kv-events-config; rank r on port + r); without one, leave replay= out"),
    "replay_mismatch": Cause(
        "the worker spec's replay endpoint answers, but not with this stream's batches: it "
        "belongs to another engine or DP rank, so a replay would feed the router another "
        "engine's history",
        "replay= in --worker must be the replay_endpoint of the engine (and rank) whose events= "
        "it pairs with"),
    "lost_events": Cause(
        "the engine holds blocks whose BlockStored never reached the stream, with no gap in the "
        "seqs: events are lost before they are numbered (a publisher queue that overflows, or a "
        "publisher that drops), so the router never learns of part of the cache",
        "look for dropped-event warnings in the engine's log; vLLM: a larger buffer/queue in "
        "--kv-events-config (buffer_steps, hwm, max_queue_size); keep the engine host from "
        "starving its publisher thread"),
    "foreign_stream": Cause(
        "the events endpoint carries batches, but none for the canary this engine stored: events= "
        "names another engine's publisher (or this engine loses every event it publishes)",
        "events= (and replay=) in --worker must be this engine's own endpoints (vLLM: "
        "\"endpoint\" in --kv-events-config, rank r on port + r)"),
    "restarted": Cause(
        "the engine restarted while the doctor ran (its publisher began again at seq 0, its "
        "cache empty): what it published around the restart is gone, and the check saw that",
        "run the doctor again once the engine is stable; if it restarts on its own, its log "
        "says why (out of memory, a crash loop)"),
    "event_lag": Cause(
        "the engine's BlockStored arrives later than the bound: a backed-up publisher, an "
        "overloaded engine host or network; routing decides on a stale view that long",
        "find what delays the publisher (engine CPU, network); a relay beside the engine "
        "(tokenspeed-router relay) keeps the router's view whole; raise --max-event-lag only if "
        "that delay is acceptable"),
    "block_size": Cause(
        "the engine's cache uses another block size than its events declare (the router hashes "
        "in the declared size, so every prediction is off)",
        "make the publisher declare the cache's real size: vLLM --block-size, SGLang --page-size, "
        "one value for every engine of the worker"),
    "block_size_spec": Cause(
        "the engine's blocks are not the size the operator expects (--block-size given to doctor)",
        "vLLM --block-size / SGLang --page-size on the engine, or correct the expectation"),
    "tokenizer": Cause(
        "the router's tokenizer gives other token ids for the same text than the engine caches "
        "(another tokenizer, or BOS/special tokens added differently)",
        "serve --tokenizer engine (ask the engine's own /tokenize), or --tokenizer PATH pointing "
        "at the engine's exact tokenizer files"),
    "chat_template": Cause(
        "text prompts agree but chat prompts do not: the router renders chat messages with "
        "another chat template than the engine serves",
        "serve --tokenizer engine, or --tokenizer PATH whose tokenizer_config.json carries the "
        "template the engine serves (vLLM --chat-template)"),
    "tokenize_failed": Cause(
        "the router could not tokenize the canary (the engine has no /tokenize, or the local "
        "tokenizer failed): such requests are routed on load only",
        "serve --tokenizer PATH with the engine's tokenizer files, or an engine that serves "
        "POST /tokenize (vLLM, SGLang)"),
    "hash_seed": Cause(
        "the engine's block ids are not stable: a continuation names as its parent an id the "
        "engine never published, so the router cannot chain it (processes hashing with "
        "different seeds)",
        "vLLM: the same PYTHONHASHSEED for every process and instance (or "
        "--prefix-caching-hash-algo sha256_cbor); SGLang/TokenSpeed: one engine version per fleet"),
    "content_hash": Cause(
        "the router's content hashes of the engine's blocks do not reproduce the prompt's: the "
        "blocks are stored under another LoRA or salt, or the events' token ids are not the "
        "prompt's",
        "see the spec and tokens checks; events must carry the prompt's token ids"),
    "no_usage": Cause(
        "the engine does not report usage.prompt_tokens_details.cached_tokens: the router's truth "
        "loop is blind (it cannot see a misaligned worker)",
        "vLLM: --enable-prompt-tokens-details; SGLang reports it by default (check the version)"),
    "reuse": Cause(
        "the engine reused another number of tokens than the router predicted from its events",
        "see the other checks of this engine: block size, tokens, hashes, spec"),
    "dp_rank": Cause(
        "the events' data-parallel rank is not the rank the worker spec puts on that endpoint",
        "dp_ranks=N in --worker matching the engine's --data-parallel-size (rank r publishes on "
        "port + r)"),
    "dp_ranks": Cause(
        "the worker spec's dp_ranks= is not the engine's data-parallel size: a rank the spec names "
        "does not publish where the spec looks (port + r), or the engine has ranks the router "
        "never follows",
        "dp_ranks=N in --worker equal to the engine's --data-parallel-size, with events= (and "
        "replay=) the ports of rank 0"),
    "lora": Cause(
        "the canary carried no LoRA, but its blocks are stored under one: the router matches "
        "them only for that LoRA, never for base-model requests",
        "check the engine's LoRA configuration and the lora_id/lora_name its events carry"),
    "salt": Cause(
        "the canary carried no cache salt, but its blocks are stored under one: unsalted "
        "requests never match them",
        "check the engine's cache_salt defaults (vLLM: cache_salt in requests)"),
    "router_state": Cause(
        "the router itself reports this worker unhealthy (stale, resyncing or misaligned)",
        "GET /workers on the router names the state and the truth loop's cause"),
    "engine_api": Cause(
        "the engine refused or failed the canary request",
        "check the worker spec's url= and that the engine serves the OpenAI API there"),
}
