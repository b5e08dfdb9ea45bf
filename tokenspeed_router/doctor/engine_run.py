"""The probe sequence for one engine, and the evidence each check reads.

Sends, all to the engine's own API, each asking for one output token:

1. the token-id probe ``A`` (:data:`~.canary.PROBE_TOKENS` ids of a canary
   text, as the router's tokenizer gives them): its ``BlockStored`` must
   arrive within the lag bound (``events``), in blocks of one declared size;
2. ``A`` again: the engine must report ``cached_tokens`` (``usage``) and it
   must equal what the router predicts from the events it received
   (``reuse``), in the block size the events declare (``block_size``);
3. ``A`` plus :data:`~.canary.CONTINUATION_TOKENS` more: the new blocks'
   parent must be an id the engine published for ``A`` and the router's
   content hashes must chain through all of them (``hashes``);
4. a canary text and 5. a canary chat, as text: the token ids the engine
   caches for them (from its events) must be the ones the router's tokenizer
   and chat template give (``tokens``).

``spec`` compares the events' DP rank, LoRA and salt with the worker spec
(and, against a running router, the router's own state for the worker).

Then 6. a replay request for the seq the canary arrived with, to the spec's
``replay=`` (``events``: it must answer with the canary's blocks), and 7. a
short canary per DP rank with vLLM's rank header, one rank past the spec's
too (``spec``: each rank publishes on its own port, and no more ranks).

When something does not arrive, the run asks why before it blames the
configuration: the canary on another worker's stream (crossed specs), other
topics in the raw view, the canary published but never delivered (a replay
endpoint of another engine), the engine holding what it never announced
(lost events), a restart or reconnection meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenspeed_router.doctor.canary import CONTINUATION_TOKENS, PROBE_TOKENS, Canary
from tokenspeed_router.doctor.checks import CAUSES, CHECK_NAMES, Cause, Check
from tokenspeed_router.doctor.engine_api import Answer, EngineApi, EngineApiError
from tokenspeed_router.doctor.replay_probe import probe_replay
from tokenspeed_router.doctor.report import EngineReport
from tokenspeed_router.doctor.views import RouterView, ViewError
from tokenspeed_router.doctor.watcher import Seen, StreamTarget, Watcher
from tokenspeed_router.gateway.http1 import Http1Pool
from tokenspeed_router.gateway.truth import cap_prediction

__all__ = ["EngineTarget", "Options", "check_engine"]


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """One engine: its API url, its event streams (one per DP rank), what the router says of it."""

    worker: str
    url: str | None
    streams: tuple[StreamTarget, ...]
    router_problems: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Options:
    timeout_s: float = 10.0
    max_event_lag_s: float = 2.0
    block_size: int | None = None
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class _Probe:
    """Where a token sequence's blocks showed up in the events."""

    tokens: list[int]
    events: list[Seen] = field(default_factory=list)
    block_ids: dict[int, object] = field(default_factory=dict)  # block index -> engine id
    sizes: set[int] = field(default_factory=set)

    def locate(self, seen: Seen) -> int | None:
        """The block index where ``seen``'s tokens start inside ``tokens`` (None: not ours)."""
        ev = seen.event
        bs = ev.block_size
        if bs <= 0 or len(ev.token_ids) < bs:
            return None
        head = list(ev.token_ids[:bs])
        for i in range(0, len(self.tokens) - bs + 1, bs):
            if self.tokens[i : i + bs] == head:
                return i // bs
        return None

    def add(self, seen: Seen) -> bool:
        first = self.locate(seen)
        if first is None:
            return False
        ev = seen.event
        self.events.append(seen)
        self.sizes.add(ev.block_size)
        full = len(ev.token_ids) // ev.block_size
        for k, block_id in enumerate(ev.block_hashes[:full]):
            self.block_ids[first + k] = block_id
        return True

    def covers(self, start: int, stop: int) -> bool:
        return all(i in self.block_ids for i in range(start, stop))


def _all_but_one_block(tokens: list[int], block_size: int) -> int:
    """Cached tokens an engine reports for a full hit of ``tokens``, less one block of slack."""
    return (len(tokens) // block_size) * block_size - block_size


def _full_tokens(seen: Seen) -> list[int]:
    ev = seen.event
    bs = ev.block_size
    return list(ev.token_ids[: (len(ev.token_ids) // bs) * bs]) if bs > 0 else []


class _EngineRun:
    def __init__(self, target: EngineTarget, view: RouterView, watcher: Watcher,
                 pool: Http1Pool, options: Options) -> None:
        self.t = target
        self.view = view
        self.watcher = watcher
        self.options = options
        self.streams = [s.name for s in target.streams]
        self.api = EngineApi(pool, target.url or "", model=options.model, timeout_s=options.timeout_s,
                             headers=options.headers)
        self.canary = Canary()
        self.checks: dict[str, Check] = {}
        self.rank_problems: list[str] = []

    # ------------------------------------------------------------------ helpers

    async def _wait(self, predicate: Any, timeout_s: float | None = None) -> Any:
        return await asyncio.to_thread(self.watcher.wait, predicate, timeout_s or self.options.timeout_s)

    def _collect(self, probe: _Probe, since_s: float, start: int, stop: int) -> bool:
        probe.events.clear()
        probe.block_ids.clear()
        probe.sizes.clear()
        for seen in self.watcher.stored(self.streams, since_s):
            probe.add(seen)
        return bool(probe.sizes) and probe.covers(start, stop)

    async def _probe_tokens(self) -> tuple[list[int], str | None]:
        """Canary token ids, as the router's tokenizer gives them (synthetic ids if it cannot)."""
        text = self.canary.text("ids", PROBE_TOKENS + CONTINUATION_TOKENS + 64)
        problem: str | None = None
        try:
            ids = await self.view.text_tokens(self.t.worker, self.t.url, text)
        except ViewError as err:
            ids, problem = [], str(err)
        need = PROBE_TOKENS + CONTINUATION_TOKENS
        if len(ids) < need:
            ids = self.canary.token_ids("ids", need)
        return ids[:need], problem

    # ------------------------------------------------------------------ the run

    async def run(self) -> EngineReport:
        if self.t.url is None:
            return self._all_failed("the worker spec has no url=: the doctor sends canaries to the engine's API")
        joined = await self._wait(lambda: all(self.watcher.joined(s) for s in self.streams))
        if self.options.model is None:
            self.api.model = await self.api.first_model()
        ids, tokenize_problem = await self._probe_tokens()
        a, ab = ids[:PROBE_TOKENS], ids
        try:
            await self._run_probes(a, ab, joined)
            await self._tokens_check(tokenize_problem)
            await self._rank_probes()
        except EngineApiError as err:
            if not joined and "events" not in self.checks:
                where = ", ".join(s.events for s in self.t.streams)
                self.checks["events"] = Check.failed(
                    "events", f"could not connect to {where} within {self.options.timeout_s:g} s", "not_connected")
            for name in CHECK_NAMES:
                self.checks.setdefault(name, Check.failed(name, f"not run: {err}", "engine_api"))
        self._spec_check()
        self._blame_events()
        self._blame_restart()
        return EngineReport(self.t.worker, [self.checks[n] for n in CHECK_NAMES])

    def _blame_restart(self) -> None:
        """A restart during the run explains the event failures it caused (not a misconfiguration)."""
        seen = [self.watcher.restarts(s) for s in self.streams]
        restarts, reconnects = sum(r for r, _ in seen), sum(c for _, c in seen)
        if not restarts and not reconnects:
            return
        what = (f"the publisher restarted {restarts} time(s) meanwhile" if restarts
                else f"the events connection dropped and came back {reconnects} time(s) meanwhile")
        for name, check in list(self.checks.items()):
            if not check.ok and check.cause in (CAUSES["no_events"].cause, CAUSES["lost_events"].cause):
                self.checks[name] = Check.failed(
                    name, f"{check.detail} ({what})", "restarted")

    def _blame_events(self) -> None:
        """Checks not run for want of events share the events check's cause (crossed, topic, ...).

        So does ``reuse`` when none of this engine's canary events reached its
        streams: the router then predicts from what the spec's endpoints carry
        (another engine's stream when they are crossed, nothing when they are
        dead), and "reused another number than predicted" would hide why.
        """
        events = self.checks.get("events")
        if events is None or events.ok or events.cause is None or events.fix is None:
            return
        cause = Cause(events.cause, events.fix)
        blind = not getattr(self, "probe_a", _Probe([])).events
        for name, check in list(self.checks.items()):
            if name == "events" or check.ok:
                continue
            if check.cause == CAUSES["no_events"].cause:
                self.checks[name] = Check.failed(name, check.detail, cause)
            elif name == "reuse" and blind and check.cause == CAUSES["reuse"].cause:
                self.checks[name] = Check.failed(
                    name, f"{check.detail}: no BlockStored of this engine reached the spec's events endpoint, "
                    "so the prediction could not be this engine's", cause)

    def _all_failed(self, detail: str) -> EngineReport:
        return EngineReport(self.t.worker, [Check.failed(n, detail, "engine_api") for n in CHECK_NAMES])

    async def _run_probes(self, a: list[int], ab: list[int], joined: bool) -> None:
        first = await self.api.complete(a)
        probe = _Probe(a)

        def arrived() -> bool:
            if not self._collect(probe, first.sent_s, 0, 1):
                return False
            d = min(probe.sizes)
            return probe.covers(0, len(a) // d)

        done = await self._wait(arrived)
        self.probe_a = probe
        await self._events_check(first, probe, done, joined)
        second = await self.api.complete(a)
        self._usage_check(first, second)
        d = min(probe.sizes) if probe.sizes else None
        predicted = await self._prediction(a, d, len(a) // d if d else 0)
        self._reuse_check(second, predicted, probe)
        third = await self.api.complete(ab)
        cont = _Probe(ab)
        if d is not None:
            k = len(a) // d
            await self._wait(lambda: self._collect(cont, third.sent_s, k, len(ab) // d))
        await self._hashes_check(ab, probe, cont, d)
        self._block_size_check(probe, second, third, d, len(a))

    async def _held_anyway(self, tokens: list[int], at_least: int) -> int | None:
        """Send ``tokens`` again: the cached tokens it reports if ``at_least`` (None otherwise).

        For blocks whose ``BlockStored`` never came: held anyway means the events went
        astray. ``at_least``: :func:`_all_but_one_block`, or half the prompt when the
        block size is unknown.
        """
        held = (await self.api.complete(tokens)).cached_tokens
        return held if held is not None and held >= at_least else None

    async def _prediction(self, tokens: list[int], d: int | None, expect_blocks: int) -> tuple[int, int | None]:
        """The router's matched blocks on the canary's stream (waiting for its view to catch up)."""
        stream = self.probe_a.events[0].stream if self.probe_a.events else self.streams[0]
        deadline = time.monotonic() + self.options.timeout_s
        while True:
            blocks, bs = await self.view.prediction(stream, tokens)
            if blocks >= expect_blocks or time.monotonic() >= deadline:
                return blocks, bs
            await asyncio.sleep(0.05)  # the router applies the events on its own clock: poll it

    # ------------------------------------------------------------------ checks

    async def _events_check(self, first: Answer, probe: _Probe, done: bool, joined: bool) -> None:
        where = ", ".join(s.events for s in self.t.streams)
        if not probe.events:
            self.checks["events"] = await self._why_no_events(first, probe, joined, where)
            return
        last = max(s.recv_s for s in probe.events)
        lag = max(0.0, last - first.answered_s)
        since_sent = last - first.sent_s
        if not done:
            partial = f"only {len(probe.block_ids)} of the canary's blocks arrived within {self.options.timeout_s:g} s"
            held = await self._held_anyway(probe.tokens, _all_but_one_block(probe.tokens, min(probe.sizes)))
            self.checks["events"] = (
                Check.failed("events", f"{partial}, though the engine holds them all (sent again: {held} cached "
                             "tokens)", "lost_events") if held is not None
                else Check.failed("events", partial, "no_events"))
            return
        replay_failure, replay_note = await self._replay_check(probe)  # only once all came
        if replay_failure is not None:
            self.checks["events"] = replay_failure
        elif lag > self.options.max_event_lag_s:
            self.checks["events"] = Check.failed(
                "events", f"BlockStored arrived {lag * 1000:.0f} ms after the answer (bound "
                f"{self.options.max_event_lag_s * 1000:.0f} ms)", "event_lag")
        else:
            self.checks["events"] = Check.passed(
                "events", f"BlockStored for {len(probe.block_ids)} blocks arrived {lag * 1000:.0f} ms after the "
                f"answer ({since_sent * 1000:.0f} ms after sending); {replay_note}")

    async def _why_no_events(self, first: Answer, probe: _Probe, joined: bool, where: str) -> Check:
        """The events check when none of the canary's blocks came on this worker's streams."""
        elsewhere = [s for s in self.watcher.all_stored(first.sent_s)
                     if s.stream not in self.streams and probe.locate(s) is not None]
        if elsewhere:
            other = self.watcher.target(elsewhere[0].stream)
            return Check.failed(
                "events", f"the canary sent to {self.t.url} came back on {other.events}, the events endpoint "
                f"of worker {other.worker!r}, not on {where}", "crossed_events")
        for st in self.t.streams:
            foreign = {t: n for t, n in self.watcher.topics(st.name).items() if not t.startswith(st.topic)}
            if st.topic and foreign:
                seen = ", ".join(f"{t!r} ({n})" for t, n in sorted(foreign.items()))
                return Check.failed(
                    "events", f"{st.events} publishes under topic(s) {seen}, the spec subscribes to "
                    f"{st.topic!r}: nothing matches", "topic")
        for st in self.t.streams:
            raw = [s for s in self.watcher.raw_stored(st.name, first.sent_s) if probe.locate(s) is not None]
            if not raw:
                continue
            seq = min(s.seq for s in raw)
            lost = (f"the engine published the canary on {st.events} (seq {seq}), but the router's subscriber "
                    "never delivered it")
            if st.replay is not None:
                failure = await self._replay_failure(st, seq, {b for s in raw for b in s.event.block_hashes})
                if failure is not None:
                    return Check.failed("events", f"{lost}: {failure[0]}", failure[1])
            return Check.failed("events", f"{lost} (dropped in sequencing)", "no_events")
        if not joined:
            return Check.failed(
                "events", f"could not connect to {where} within {self.options.timeout_s:g} s", "not_connected")
        batches = sum(self.watcher.batches(s) for s in self.streams)
        missing = (f"no BlockStored for the canary on {where} within {self.options.timeout_s:g} s "
                   f"({batches} batch(es) received in all)")
        if batches:  # the stream works: does the engine hold the canary it never announced?
            held = await self._held_anyway(probe.tokens, len(probe.tokens) // 2)
            if held is not None:
                return Check.failed("events", f"{missing}, though the engine holds it (sent again: {held} "
                                    "cached tokens)", "foreign_stream")
        return Check.failed("events", missing, "no_events")

    async def _replay_failure(self, target: StreamTarget, seq: int,
                              wanted: set[object]) -> tuple[str, str] | None:
        """Replay ``target`` from ``seq``: (detail, cause) when the ``wanted`` blocks do not come back."""
        assert target.replay is not None
        endpoint = target.replay
        answer = await asyncio.to_thread(probe_replay, endpoint, seq, self.options.timeout_s, target.curve)
        if answer.error is not None or not (answer.answered or answer.replies):
            why = answer.error or f"no answer within {self.options.timeout_s:g} s"
            return f"the replay endpoint {endpoint} did not answer a replay from seq {seq}: {why}", "no_replay"
        if not wanted & answer.block_ids:
            return (f"the replay endpoint {endpoint} answered a replay from seq {seq} with {answer.replies} "
                    "batch(es), none carrying the canary's blocks", "replay_mismatch")
        return None

    async def _replay_check(self, probe: _Probe) -> tuple[Check | None, str]:
        """Ask the replay endpoint of the stream that carried the canary for its batch again.

        (A failure, or None) and a note for the passing detail.
        """
        seen = min(probe.events, key=lambda s: s.seq)
        target = self.watcher.target(seen.stream)
        if target.replay is None:
            return None, "no replay endpoint in the spec (a gap in the stream forces a full resync)"
        if seen.seq < 0:
            return None, "replay not checked"
        failure = await self._replay_failure(target, seen.seq, set(probe.block_ids.values()))
        if failure is not None:
            return Check.failed("events", failure[0], failure[1]), ""
        return None, f"replay from seq {seen.seq} at {target.replay} returns them"

    def _usage_check(self, first: Answer, second: Answer) -> None:
        if second.cached_tokens is None:
            has = "no usage at all" if second.usage is None else "usage without prompt_tokens_details.cached_tokens"
            self.checks["usage"] = Check.failed("usage", f"the second send's answer has {has}", "no_usage")
        else:
            self.checks["usage"] = Check.passed(
                "usage", f"cached_tokens reported: {first.cached_tokens} on the first send, "
                f"{second.cached_tokens} on the second")

    def _reuse_check(self, second: Answer, predicted: tuple[int, int | None], probe: _Probe) -> None:
        blocks, bs = predicted
        if bs is None:
            bs = min(probe.sizes) if probe.sizes else None
        if second.cached_tokens is None:
            self.checks["reuse"] = Check.failed("reuse", "cannot compare: the engine reports no cached_tokens",
                                                "no_usage")
            return
        if bs is None:
            self.checks["reuse"] = Check.failed(
                "reuse", f"the engine reused {second.cached_tokens} tokens; the router knows no block of it "
                "(no events)", "no_events")
            return
        want = cap_prediction(blocks * bs, len(probe.tokens), bs)
        if want == second.cached_tokens:
            self.checks["reuse"] = Check.passed(
                "reuse", f"the engine reused {second.cached_tokens} tokens, as the router predicted")
        else:
            self.checks["reuse"] = Check.failed(
                "reuse", f"the router predicted {want} cached tokens ({blocks} blocks of {bs}), the engine "
                f"reused {second.cached_tokens}", "reuse")

    async def _hashes_check(self, ab: list[int], a_probe: _Probe, cont: _Probe, d: int | None) -> None:
        if d is None:
            self.checks["hashes"] = Check.failed("hashes", "not run: no events for the canary", "no_events")
            return
        k = len(a_probe.tokens) // d
        new = [s for s in cont.events if (cont.locate(s) or 0) >= k]
        if not new:
            missing = f"no BlockStored for the continuation (blocks {k}..{len(ab) // d - 1}) within " \
                      f"{self.options.timeout_s:g} s"
            held = await self._held_anyway(ab, _all_but_one_block(ab, d))  # held, never announced?
            if held is not None:
                self.checks["hashes"] = Check.failed(
                    "hashes", f"{missing}, though the engine holds them (sent again: {held} cached tokens) "
                    "and its seqs show no gap", "lost_events")
            else:
                self.checks["hashes"] = Check.failed("hashes", missing, "no_events")
            return
        first_new = min(new, key=lambda s: cont.locate(s) or 0)
        parent = first_new.event.parent_block_hash
        expected_parent = a_probe.block_ids.get(k - 1)
        published = set(a_probe.block_ids.values())
        blocks, _ = await self._prediction(ab, d, len(ab) // d)
        if parent is not None and parent != expected_parent:
            known = "an id it published for another block" if parent in published else "an id it never published"
            self.checks["hashes"] = Check.failed(
                "hashes", f"the continuation's parent is {parent!r}, {known} (block {k - 1} was published as "
                f"{expected_parent!r}); the router chains {blocks} of {len(ab) // d} blocks", "hash_seed")
        elif blocks != len(ab) // d:
            self.checks["hashes"] = Check.failed(
                "hashes", f"the router's content hashes reproduce {blocks} of the {len(ab) // d} blocks the "
                "engine stored", "content_hash")
        else:
            self.checks["hashes"] = Check.passed(
                "hashes", f"{blocks} blocks chained: parent ids consistent, the router's content hashes equal "
                "the prompt's")

    def _block_size_check(self, probe: _Probe, second: Answer, third: Answer, d: int | None, n: int) -> None:
        if d is None:
            self.checks["block_size"] = Check.failed("block_size", "not run: no events for the canary", "no_events")
            return
        if len(probe.sizes) > 1:
            self.checks["block_size"] = Check.failed(
                "block_size", f"the canary's events declare several block sizes: {sorted(probe.sizes)}", "block_size")
            return
        bad = [s for s in probe.events if len(s.event.token_ids) != len(s.event.block_hashes) * d
               and len(s.event.block_hashes) != 1]
        if bad:
            ev = bad[0].event
            self.checks["block_size"] = Check.failed(
                "block_size", f"an event declares block_size {d} but carries {len(ev.token_ids)} tokens for "
                f"{len(ev.block_hashes)} blocks", "block_size")
            return
        expected = self.options.block_size
        if expected is not None and expected != d:
            self.checks["block_size"] = Check.failed(
                "block_size", f"the events declare block_size {d}, expected {expected}", "block_size_spec")
            return
        reported = [r for r in (second.cached_tokens, third.cached_tokens) if r]
        off = [r for r in reported if r % d]
        if off:
            self.checks["block_size"] = Check.failed(
                "block_size", f"the events declare block_size {d}, but the engine reports cached_tokens "
                f"{reported} (not multiples of {d}: its cache uses a smaller block size)", "block_size")
            return
        hit = second.cached_tokens
        larger = next((g for g in range(2 * d, n, d) if hit and hit == (n - 1) // g * g != (n - 1) // d * d), None)
        if larger is not None:
            self.checks["block_size"] = Check.failed(
                "block_size", f"the events declare block_size {d}, but a full hit of {n} tokens reports "
                f"cached_tokens {hit}, as blocks of {larger} do", "block_size")
            return
        evidence = f", cached_tokens {reported} agree" if reported else " (no cached_tokens to confirm it)"
        self.checks["block_size"] = Check.passed("block_size", f"{d} tokens per block{evidence}")

    async def _stored_for(self, answer: Answer, expect_tokens: int) -> list[int]:
        """Token ids the engine stored (full blocks) for a probe sent at ``answer.sent_s``."""
        ours = _Probe(list(self.probe_a.tokens))  # the id probe's blocks are not this probe's

        def gathered() -> list[Seen]:
            got = [s for s in self.watcher.stored(self.streams, answer.sent_s) if ours.locate(s) is None]
            total = sum(len(_full_tokens(s)) for s in got)
            return got if got and total >= expect_tokens else []

        # No event at all for the id probe: nothing will come for this one either (events
        # check), and whatever else the streams carry is not this canary's (another
        # engine's, when the spec's endpoints are crossed): compare the token counts only.
        if not self.probe_a.events:
            return []
        got = await self._wait(gathered)
        if not got:
            got = [s for s in self.watcher.stored(self.streams, answer.sent_s) if ours.locate(s) is None]
        out: list[int] = []
        for s in got:
            out.extend(_full_tokens(s))
        return out

    async def _tokens_check(self, tokenize_problem: str | None) -> None:
        d = min(self.probe_a.sizes) if self.probe_a.sizes else 16
        words = max(4 * d, 64) + 3
        if tokenize_problem is not None:
            self.checks["tokens"] = Check.failed("tokens", f"the router could not tokenize: {tokenize_problem}",
                                                 "tokenize_failed")
            return
        text = self.canary.text("text", words)
        messages = self.canary.messages(words)
        try:
            want_text = await self.view.text_tokens(self.t.worker, self.t.url, text)
            want_chat = await self.view.chat_tokens(self.t.worker, self.t.url, messages)
        except ViewError as err:
            self.checks["tokens"] = Check.failed("tokens", f"the router could not tokenize: {err}", "tokenize_failed")
            return
        text_answer = await self.api.complete(text)
        got_text = await self._stored_for(text_answer, ((text_answer.prompt_tokens or len(want_text)) // d) * d)
        chat_answer = await self.api.chat(messages)
        got_chat = await self._stored_for(chat_answer, ((chat_answer.prompt_tokens or len(want_chat)) // d) * d)
        text_diff = _difference(got_text, want_text, text_answer.prompt_tokens)
        chat_diff = _difference(got_chat, want_chat, chat_answer.prompt_tokens)
        if text_diff is not None:
            self.checks["tokens"] = Check.failed("tokens", f"text: {text_diff}", "tokenizer")
        elif chat_diff is not None:
            self.checks["tokens"] = Check.failed("tokens", f"chat (text agrees): {chat_diff}", "chat_template")
        else:
            self.checks["tokens"] = Check.passed(
                "tokens", f"text ({len(want_text)} tokens) and chat ({len(want_chat)} tokens) canaries: the "
                f"engine caches the token ids {self.view.description} gives")

    async def _rank_probes(self) -> None:
        """Every DP rank the spec names must publish its canaries where the spec looks, and no more ranks.

        The main canaries go wherever the engine's own balancer sends them, so
        a rank the spec names but the engine lacks (or publishes elsewhere), or
        a rank the engine has but the spec lacks, would pass unseen. Each rank
        that has not shown a canary block yet gets a short canary of its own,
        sent with vLLM's ``X-data-parallel-rank`` header, and so does the first
        rank past the spec's: the engine must refuse it or store it on a
        stream the router follows (an engine that ignores the header does).
        """
        if not self.probe_a.events:
            return
        covered = {s.stream for s in self.watcher.stored(self.streams, 0.0)
                   if self.probe_a.locate(s) is not None}
        for st in self.t.streams:
            if st.name in covered:
                continue
            if not self.watcher.joined(st.name):
                self.rank_problems.append(f"rank {st.dp_rank}: nothing publishes on {st.events} (the spec has "
                                          f"dp_ranks={len(self.t.streams)}; rank r publishes on port + r)")
                continue
            await self._rank_probe(st.dp_rank, st.name)
        await self._rank_probe(len(self.t.streams), None)

    async def _rank_probe(self, rank: int, stream: str | None) -> None:
        """One short canary for ``rank``: on ``stream`` it must arrive (None: a rank past the spec's)."""
        ids = self.canary.token_ids(f"rank-{rank}", 4 * min(self.probe_a.sizes))
        try:
            answer = await self.api.complete(ids, dp_rank=rank)
        except EngineApiError as err:
            if stream is not None:
                self.rank_problems.append(f"rank {rank}: the engine refused a request for it ({err})")
            return  # past the spec's ranks: refusing is right
        probe = _Probe(ids)
        arrived = await self._wait(lambda: self._collect(probe, answer.sent_s, 0, 4))
        n = len(self.t.streams)
        if stream is None:
            if not arrived:
                self.rank_problems.append(
                    f"the engine accepted a request for rank {rank} and stored it on no stream the spec "
                    f"names: it has more data-parallel ranks than dp_ranks={n}")
            return
        if not arrived:
            self.rank_problems.append(f"rank {rank}: its canary's blocks did not arrive on {self.watcher.target(stream).events}")
            return
        stray = sorted({s.stream for s in probe.events if s.stream != stream})
        if stray:
            self.rank_problems.append(f"rank {rank}: its canary's blocks arrived on {', '.join(stray)}")

    def _spec_check(self) -> None:
        problems: list[tuple[str, str]] = []
        events = getattr(self, "probe_a", _Probe([])).events
        ranks = {s.name: s.dp_rank for s in self.t.streams}
        endpoints = {s.name: s.events for s in self.t.streams}
        for seen in events:
            if seen.batch_rank is not None and seen.batch_rank != ranks[seen.stream]:
                problems.append((f"events on {endpoints[seen.stream]} carry data_parallel_rank {seen.batch_rank}; "
                                 f"the spec puts rank {ranks[seen.stream]} there "
                                 f"(dp_ranks={len(self.t.streams)})", "dp_rank"))
                break
        loras = {(s.event.lora_id, s.event.lora_name) for s in events} - {(None, None)}
        if loras:
            problems.append((f"the canary's blocks are stored under LoRA {sorted(map(str, loras))} "
                             "though it named none", "lora"))
        salts = {str(s.event.cache_salt) for s in events if s.event.cache_salt is not None}
        if salts:
            problems.append((f"the canary's blocks are stored under cache salt {sorted(salts)} "
                             "though it carried none", "salt"))
        for problem in self.rank_problems:
            problems.append((problem, "dp_ranks"))
        for problem in self.t.router_problems:
            problems.append((problem, "router_state"))
        if problems:
            detail, why = problems[0]
            more = "; ".join(p for p, _ in problems[1:])
            self.checks["spec"] = Check.failed("spec", detail + (f"; also: {more}" if more else ""), why)
        elif not events:
            self.checks["spec"] = Check.failed("spec", "not run: no events for the canary", "no_events")
        else:
            rank = events[0].batch_rank
            self.checks["spec"] = Check.passed(
                "spec", f"DP rank {rank if rank is not None else 'unset'} on {endpoints[events[0].stream]} "
                f"({len(self.t.streams)} rank(s) in the spec), no LoRA, no salt, as the spec says")


def _difference(got: list[int], want: list[int], prompt_tokens: int | None) -> str | None:
    """How the engine's cached tokens differ from the router's (None when they agree)."""
    if got and want[: len(got)] == got:
        if prompt_tokens is not None and prompt_tokens != len(want):
            return f"the engine counts {prompt_tokens} prompt tokens, the router {len(want)}"
        return None
    if not got:
        if prompt_tokens is not None and prompt_tokens != len(want):
            return f"the engine counts {prompt_tokens} prompt tokens, the router {len(want)}"
        return None if prompt_tokens is not None else "no events and no usage to compare with"
    for k in range(1, min(9, len(got))):  # a shift must leave tokens to compare
        if len(want) >= k + len(got) and want[k : k + len(got)] == got:
            return (f"the router's token ids start with {k} token(s) the engine does not cache "
                    f"({want[:k]}), so every block is shifted")
        if got[k:] == want[: len(got) - k]:
            return f"the engine caches {k} leading token(s) the router does not add ({got[:k]})"
    i = next((j for j, (x, y) in enumerate(zip(got, want, strict=False)) if x != y), min(len(got), len(want)))
    return f"token {i} differs: the engine cached {got[i:i + 4]}, the router computes {want[i:i + 4]}"


async def check_engine(target: EngineTarget, view: RouterView, watcher: Watcher,
                       pool: Http1Pool, options: Options) -> EngineReport:
    """Run every check against one engine (DESIGN §13)."""
    return await _EngineRun(target, view, watcher, pool, options).run()


def stream_targets(worker: str, specs: Sequence[Any]) -> tuple[StreamTarget, ...]:
    """StreamTargets of a worker's subscriber specs (``server.worker_spec.SubscriberSpec``)."""
    return tuple(StreamTarget(name=s.name, worker=worker, dp_rank=s.dp_rank, events=s.events,
                              replay=s.replay, topic=s.topic, curve=s.curve) for s in specs)
