"""Issue 28: bad frames cannot fool the sequencing -- a stateful test against a reference model.

A hypothesis state machine plays an engine's event stream: valid batches
(stores that start or extend chains, removals of chain tails, whole-cache
clears), exact duplicates, reorders (with a replay endpoint), real restarts
(seq back to 0, a new process with an empty ring), losses (with a replay
endpoint they are healed, without one they cost a resync) and every
malformed class of ``support.raw_stream`` under seqs picked to do the most
harm (the last seq, the one due, 0, one ahead). The frames go through a real
ZeroMQ socket into a real :class:`EventSubscriber`, an
:class:`IndexIngestor` and a :class:`KvIndex`; after every step the index
must answer what a reference model, which sees only the valid batches and
knows the documented rules, says it holds -- and the restart and resync
counts must agree with it.

The same machine runs on the native core's raw path, its typed path, and
the reference core; and the same scripts, written to an event log, are
replayed by ``replay``'s own loop (:func:`cli_replay.replay_into`).
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support import wait_until
from support.raw_stream import BAD_PAYLOADS, RawStream, bad_frames, seq_bytes
from support.server import BLOCK, batch, removed, stored, tokens

from tokenspeed_router.events import (
    AllBlocksCleared,
    EventLogReader,
    EventLogWriter,
    EventSubscriber,
    encode_batch,
)
from tokenspeed_router.events.schema import Event
from tokenspeed_router.router import KvIndex
from tokenspeed_router.router.index import NATIVE_AVAILABLE
from tokenspeed_router.router.ingest import IndexIngestor

RECOVERY_BATCHES = 8
MAX_BLOCKS = 4
_BAD_NAMES = sorted(BAD_PAYLOADS)
_FILLERS = {"unknown_tag_map", "unknown_tag_array"}


# ------------------------------------------------------------------ the model


@dataclass
class RouterModel:
    """What the index must hold for the worker: the ingestor's rules over valid batches only.

    After a loss (docs/faults.md, "What is trusted when"): stores under a block
    the index does not hold are held back (``pool``: root -> its events, in
    order) and applied when the root is stored again; ``resyncing`` ends at a
    clear, or after ``RECOVERY_BATCHES`` clean storing batches with nothing held
    back (no capacity is known here, so no turnover is asked). A refused batch
    on a worker exact since its last empty point is a resync; on one that lost
    events before, it is taken event by event with its entries kept.
    """

    held: set[tuple[int, int]] = field(default_factory=set)  # (chain, block index)
    resyncing: bool = False
    clean: int = 0
    restarts: int = 0
    resyncs: int = 0
    exact: bool = True
    recovering: bool = False
    pool: dict[tuple[int, int], list[tuple]] = field(default_factory=dict)  # root -> held-back ops
    pool_of: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # block -> its root

    def restart(self) -> None:
        self.held.clear()
        self.restarts += 1
        self.resyncing = False
        self.clean = 0
        self.exact = True
        self.recovering = False
        self._drop_pool()

    def resync(self) -> None:
        self.held.clear()
        self.resyncs += 1
        self.resyncing = True
        self.clean = 0
        self.exact = False
        self.recovering = True
        self._drop_pool()

    def _drop_pool(self) -> None:
        self.pool.clear()
        self.pool_of.clear()

    @staticmethod
    def _step(held: set[tuple[int, int]], op: tuple) -> bool:
        kind = op[0]
        if kind == "store":
            _, chain, first, count = op
            if first and (chain, first - 1) not in held:
                return False
            held.update((chain, i) for i in range(first, first + count))
        elif kind == "remove":
            held.discard((op[1], op[2]))
        else:
            held.clear()
        return True

    def apply(self, ops: list[tuple]) -> None:
        if not self.recovering:
            trial = set(self.held)
            if all(self._step(trial, op) for op in ops):
                self.held = trial
                clears = any(op[0] == "clear" for op in ops)
                if clears:
                    self.exact = True
                if self.resyncing:
                    if clears:
                        self.resyncing = False
                        self.clean = 0
                    elif any(op[0] == "store" for op in ops):
                        self.clean += 1
                        if self.clean >= RECOVERY_BATCHES:
                            self.resyncing = False
                            self.clean = 0
                return
            if self.exact:  # an unknown parent on an exact worker: a lost event; drop the worker
                self.resync()
            else:  # what the engine kept from before a loss: entries kept
                self.recovering = True
                self.resyncing = True
                self.clean = 0
        self._apply_recovering(ops)

    def _apply_recovering(self, ops: list[tuple]) -> None:
        held_back = 0
        stores = clears = False
        for op in ops:
            if op[0] == "store":
                stores = True
                _, chain, first, count = op
                parent = (chain, first - 1) if first else None
                blocks = [(chain, i) for i in range(first, first + count)]
                if parent is not None and parent in self.pool_of:
                    self._hold(self.pool_of[parent], op, blocks)
                    held_back += 1
                elif parent is None or parent in self.held:
                    self.held.update(blocks)
                    for b in blocks:
                        if b in self.pool:
                            self._adopt(b)
                else:
                    self._hold(parent, op, blocks)
                    held_back += 1
            elif op[0] == "remove":
                block = (op[1], op[2])
                root = self.pool_of.pop(block, None)
                if root is None:
                    self.held.discard(block)
                    continue
                held_back += 1
                if any(r == root for r in self.pool_of.values()):
                    self.pool[root].append(op)
                else:  # nothing of that chain is held any more
                    del self.pool[root]
            else:
                self.held.clear()
                self._drop_pool()
                clears = True
        if self.pool and not self.resyncing:
            self.resyncing = True
            self.clean = 0
        if clears:
            self.exact = True
        if self.resyncing:
            if clears:
                self.resyncing = False
                self.clean = 0
            elif stores:
                self.clean = self.clean + 1 if held_back == 0 and not self.pool else 0
                if self.clean >= RECOVERY_BATCHES and not self.pool:
                    self.resyncing = False
                    self.clean = 0
        if not self.resyncing and not self.pool:
            self.recovering = False

    def _hold(self, root: tuple[int, int], op: tuple, blocks: list[tuple[int, int]]) -> None:
        self.pool.setdefault(root, []).append(op)
        for b in blocks:
            self.pool_of[b] = root

    def _adopt(self, root: tuple[int, int]) -> None:
        pending = [root]
        while pending:
            ops = self.pool.pop(pending.pop(), [])
            for op in ops:
                if op[0] == "store":
                    _, chain, first, count = op
                    blocks = [(chain, i) for i in range(first, first + count)]
                    for b in blocks:
                        self.pool_of.pop(b, None)
                    self.held.update(blocks)
                    pending.extend(b for b in blocks if b in self.pool)
                else:
                    self.held.discard((op[1], op[2]))


@dataclass
class Engine:
    """The publisher side: its cache (chain -> blocks held) and its seq counter."""

    chains: dict[int, int] = field(default_factory=dict)
    next_seq: int = 0
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def events_for(self, rng: random.Random) -> tuple[list[Event], list[tuple]]:
        events: list[Event] = []
        ops: list[tuple] = []
        for _ in range(rng.randint(1, 3)):
            roll = rng.random()
            held = [c for c, n in self.chains.items() if n]
            if roll < 0.05:
                events.append(AllBlocksCleared())
                ops.append(("clear",))
                self.chains = dict.fromkeys(self.chains, 0)
            elif roll < 0.3 and held:
                chain = rng.choice(held)
                n = self.chains[chain]
                events.append(removed(tokens(chain, n), n - 1, 1))
                ops.append(("remove", chain, n - 1))
                self.chains[chain] = n - 1
            else:
                extendable = [c for c in held if self.chains[c] < MAX_BLOCKS]
                chain = rng.choice(extendable) if extendable and roll < 0.7 else next(self.ids)
                first = self.chains.get(chain, 0)
                count = rng.randint(1, MAX_BLOCKS - first) if first < MAX_BLOCKS else 0
                if not count:
                    continue
                full = tokens(chain, first + count)
                events.append(stored(full[first * BLOCK :], parent_tokens=full[: first * BLOCK]))
                ops.append(("store", chain, first, count))
                self.chains[chain] = first + count
        return events, ops


# ------------------------------------------------------------------ the live machine


class _LiveStream(RuleBasedStateMachine):
    """Frames through a real socket, subscriber, ingestor and index (subclasses pick the variant)."""

    REPLAY = False
    CORE = "native"
    RAW = True

    def __init__(self) -> None:
        super().__init__()
        self.stream = RawStream(replay=self.REPLAY)
        self.sub = EventSubscriber(
            "w0", self.stream.endpoint, replay_endpoint=self.stream.replay_endpoint, replay_timeout_s=5.0,
        )
        self.index = KvIndex(core=self.CORE)
        self.ingestor = IndexIngestor(self.index, raw=self.RAW, recovery_batches=RECOVERY_BATCHES)
        self.ingestor.add_worker("w0")
        self.model = RouterModel()
        self.engine = Engine()
        self.sent_live = 0
        self.delivered: list[tuple[int, bytes]] = []  # this epoch, arrived: what a duplicate may copy
        self.dropped: list[tuple[int, bytes, list[tuple]]] = []  # lost on the wire, not yet followed
        self.filler_seqs: set[int] = set()  # seqs a stray empty batch used (this epoch)
        self.ts = itertools.count(1)
        self.chains_seen: set[int] = set()
        self.restart_due = False
        self.stream.wait_subscribed()

    def teardown(self) -> None:
        self.sub.close()
        self.stream.close()

    # --- plumbing

    def _send(self, frames: list[bytes]) -> None:
        self.stream.send_frames(frames)
        self.sent_live += 1

    def _sync(self) -> None:
        def caught_up() -> bool:
            for item in self.sub.poll(0.01):
                self.ingestor.on_item(item)
            s = self.sub.statistics()
            return s.received >= self.sent_live and not s.replaying and s.held == 0

        wait_until(caught_up, 20, interval_s=0.0, what="the subscriber to catch up")

    def _next_batch(self, rng: random.Random) -> tuple[int, bytes, list[tuple]]:
        events, ops = self.engine.events_for(rng)
        if not events:
            events, ops = [AllBlocksCleared()], [("clear",)]
            self.engine.chains = dict.fromkeys(self.engine.chains, 0)
        self.chains_seen.update(op[1] for op in ops if op[0] != "clear")
        seq = self.engine.next_seq
        self.engine.next_seq += 1
        payload = encode_batch(batch(*events, ts=float(next(self.ts))), wire_format=rng.choice(["map", "array"]))
        self.stream.hold(seq, payload)  # the engine's ring holds what it published
        return seq, payload, ops

    def _arrived(self, record: tuple[int, bytes, list[tuple]]) -> None:
        """The model's view of one valid batch arriving live, after the losses before it:
        a replay endpoint brings those back, else they cost a resync."""
        if self.REPLAY:
            for lost in self.dropped:
                self.model.apply(lost[2])
                self.delivered.append(lost[:2])
        elif self.dropped:
            self.model.resync()
        self.dropped.clear()
        self.model.apply(record[2])
        self.delivered.append(record[:2])

    # --- rules

    @initialize(seed=st.integers(0, 2**32 - 1))
    def first_batch(self, seed: int) -> None:
        self.rng = random.Random(seed)
        record = self._next_batch(self.rng)
        self._send([b"", seq_bytes(record[0]), record[1]])
        self._arrived(record)
        self._sync()

    @rule()
    def good(self) -> None:
        record = self._next_batch(self.rng)
        if self.restart_due:
            self.restart_due = False
            self.model.restart()
        self._send([b"", seq_bytes(record[0]), record[1]])
        self._arrived(record)
        self._sync()

    @precondition(lambda self: not self.restart_due and (self.REPLAY or self.engine.next_seq not in self.filler_seqs))
    @rule()
    def lose(self) -> None:
        """A batch the engine published (it is in the ring) that never arrives live."""
        self.dropped.append(self._next_batch(self.rng))

    @precondition(lambda self: self.REPLAY and not self.restart_due)
    @rule()
    def reorder(self) -> None:
        """The next two batches arrive in the wrong order (a replay endpoint heals it)."""
        first = self._next_batch(self.rng)
        second = self._next_batch(self.rng)
        self._send([b"", seq_bytes(second[0]), second[1]])
        self._send([b"", seq_bytes(first[0]), first[1]])
        self.dropped.append(first)  # arrives through the replay the second one triggers
        self._arrived(second)
        self._sync()

    @precondition(lambda self: self.delivered)
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        seq, payload = data.draw(st.sampled_from(self.delivered))
        self._send([b"", seq_bytes(seq), payload])
        self._sync()

    @precondition(lambda self: not self.restart_due and not self.dropped)
    @rule()
    def restart(self) -> None:
        """A new engine process: empty cache, empty ring, seq from 0 (its first batch is the next good one)."""
        self.engine = Engine(ids=self.engine.ids)
        self.stream.restart_ring()
        self.delivered.clear()
        self.filler_seqs.clear()
        self.restart_due = True

    @rule(data=st.data(), name=st.sampled_from([*_BAD_NAMES, "frames"]))
    def bad(self, data: st.DataObject, name: str) -> None:
        due = self.engine.next_seq
        choices = [due, max(0, due - 1), 0, due + 1]
        if name in _FILLERS:
            # A stray empty batch exactly where a real one is lost, with no replay endpoint to
            # tell, hides that loss (events/sequencing.py says so): keep fillers off lost seqs.
            lost = {r[0] for r in self.dropped}
            choices = [c for c in choices if c not in lost and c <= due]
        seq = data.draw(st.sampled_from(choices))
        if name in _FILLERS:
            self.filler_seqs.add(seq)
        if name == "frames":
            for frames in bad_frames(b"", seq):
                self._send(frames)
        else:
            self._send([b"", seq_bytes(seq), BAD_PAYLOADS[name]])
        self._sync()

    # --- the property

    @invariant()
    def index_equals_model(self) -> None:
        if self.dropped:
            return  # a loss not yet revealed: the router cannot know yet
        for chain in self.chains_seen:
            want = 0
            while (chain, want) in self.model.held and want < MAX_BLOCKS:
                want += 1
            got = self.index.match(tokens(chain, MAX_BLOCKS)).get("w0", 0)
            assert got == want, (chain, got, want, sorted(self.model.held))
        status = self.ingestor.status("w0")
        assert (status.restarts, status.resyncs) == (self.model.restarts, self.model.resyncs)
        assert (status.state.value == "resyncing") == self.model.resyncing


SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _variant(replay: bool, core: str, raw: bool) -> type[RuleBasedStateMachine]:
    return type(f"Live_{replay}_{core}_{raw}", (_LiveStream,), {"REPLAY": replay, "CORE": core, "RAW": raw})


_VARIANTS = [
    pytest.param(False, "native", True, id="events_only-native-raw"),
    pytest.param(True, "native", True, id="replay-native-raw"),
    pytest.param(False, "native", False, id="events_only-native-typed"),
    pytest.param(True, "reference", False, id="replay-reference-typed"),
]


@pytest.mark.skipif(not NATIVE_AVAILABLE, reason="the native core is required where the suite runs (test_native_built)")
@pytest.mark.parametrize(("replay", "core", "raw"), _VARIANTS)
def test_bad_frames_cannot_fool_the_live_sequencing(replay: bool, core: str, raw: bool) -> None:
    machine = _variant(replay, core, raw)
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()


# ------------------------------------------------------------------ log replay


@dataclass
class _Script:
    records: list[tuple[int, bytes]]
    model: RouterModel
    chains: set[int]


def _log_script(rng: random.Random, steps: int) -> _Script:
    """A recorded stream: valid batches, duplicates, restarts, gaps (records missing), bad payloads."""
    engine = Engine()
    model = RouterModel()
    records: list[tuple[int, bytes]] = []
    chains: set[int] = set()
    published: list[tuple[int, bytes]] = []
    gap = False  # a hole is pending: the next valid record reveals it
    fillers: set[int] = set()  # seqs a stray empty batch used (this epoch)
    ts = itertools.count(1)
    for i in range(steps):
        roll = rng.random()
        if i and roll < 0.1 and published:
            records.append(rng.choice(published))  # an exact duplicate
            continue
        if i and roll < 0.3:
            name = rng.choice(_BAD_NAMES)
            seq = rng.choice([engine.next_seq, max(0, engine.next_seq - 1), 0, engine.next_seq + 1])
            if name in _FILLERS and (gap or seq > engine.next_seq):
                name = "undecodable"  # a filler on a hole hides it, with nothing to replay it from
            if name in _FILLERS:
                fillers.add(seq)
            records.append((seq, BAD_PAYLOADS[name]))
            continue
        restart = bool(i) and roll < 0.35
        if restart:
            engine = Engine(ids=engine.ids)
            published.clear()
            fillers.clear()
            gap = False
        events, ops = engine.events_for(rng)
        if not events:
            continue
        chains.update(op[1] for op in ops if op[0] != "clear")
        seq = engine.next_seq
        engine.next_seq += 1
        payload = encode_batch(batch(*events, ts=float(next(ts))))
        if i and not restart and roll < 0.45 and seq not in fillers:
            gap = True  # recorded nowhere: the log has a hole here
            continue
        if restart:
            model.restart()
        elif gap:
            model.resync()
        gap = False
        model.apply(ops)
        records.append((seq, payload))
        published.append((seq, payload))
    return _Script(records, model, chains)


@pytest.mark.parametrize("seed", range(12))
def test_bad_records_cannot_fool_log_replay(tmp_path: Path, seed: int) -> None:
    from tokenspeed_router.server.app import RouterService
    from tokenspeed_router.server.config import ServerConfig
    from tokenspeed_router.tools.cli_replay import replay_into

    script = _log_script(random.Random(seed), 120)
    path = tmp_path / "events.tslog"
    with EventLogWriter(path) as writer:
        now = time.time()
        for k, (seq, payload) in enumerate(script.records):
            writer.append("w0", seq, payload, recv_time_s=now + k * 1e-3)
    service = RouterService(ServerConfig(http=None))
    try:
        with EventLogReader(path) as reader:
            replay_into(service, reader.records())
        for chain in script.chains:
            want = 0
            while (chain, want) in script.model.held and want < MAX_BLOCKS:
                want += 1
            assert service.index.match(tokens(chain, MAX_BLOCKS)).get("w0", 0) == want, chain
        status = service.ingestor.status("w0")
        assert (status.restarts, status.resyncs) == (script.model.restarts, script.model.resyncs)
        assert status.batches_skipped == sum(
            1 for _, payload in script.records if payload in {BAD_PAYLOADS[n] for n in _FILLERS})
    finally:
        service.stop()
