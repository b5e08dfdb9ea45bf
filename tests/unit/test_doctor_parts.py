"""The doctor's parts on their own: evidence matching, token comparison, the report, the watcher.

The watcher test is real ZeroMQ: a ``ZmqEventPublisher`` on a loopback port
and the doctor's :class:`Watcher` (the router's ``EventSubscriber`` and
``KvIndex`` inside). The end-to-end checks against misconfigured engines are
in ``tests/integration/test_doctor.py``.
"""

from __future__ import annotations

import json

import pytest
from support import wait_until

from tokenspeed_router.doctor import CHECK_NAMES, Check, DoctorReport, EngineReport
from tokenspeed_router.doctor.canary import PROBE_TOKENS, Canary
from tokenspeed_router.doctor.checks import CAUSES
from tokenspeed_router.doctor.engine_run import _difference, _Probe
from tokenspeed_router.doctor.watcher import Seen, StreamTarget, Watcher
from tokenspeed_router.events import BlockStored, KVEventBatch, ZmqEventPublisher
from tokenspeed_router.hashing import block_hashes


def stored(tokens: list[int], bs: int = 4, parent: int | None = None, ids: list[int] | None = None) -> BlockStored:
    return BlockStored(block_hashes=ids or list(range(100, 100 + len(tokens) // bs)), parent_block_hash=parent,
                       token_ids=tokens, block_size=bs)


def seen(ev: BlockStored, rank: int | None = 0) -> Seen:
    return Seen("w0", 1.0, rank, ev)


def test_a_probe_finds_its_blocks_and_ignores_others() -> None:
    tokens = list(range(1, 21))  # five blocks of 4
    probe = _Probe(tokens)
    assert probe.add(seen(stored(tokens[:8], ids=[10, 11])))
    assert probe.add(seen(stored(tokens[8:16], parent=11, ids=[12, 13])))
    assert not probe.add(seen(stored([99, 98, 97, 96])))  # another prompt's block
    assert not probe.add(seen(stored(tokens[1:5])))  # not on a block boundary
    assert not probe.add(seen(stored(tokens[:3], bs=4, ids=[1])))  # a partial tail
    assert probe.block_ids == {0: 10, 1: 11, 2: 12, 3: 13}
    assert probe.covers(0, 4) and not probe.covers(0, 5)
    assert probe.sizes == {4}


@pytest.mark.parametrize("got,want,prompt_tokens,says", [
    ([1, 2, 3, 4], [1, 2, 3, 4, 5], 5, None),
    ([1, 2, 3, 4], [7, 1, 2, 3, 4, 5], 6, "start with 1 token(s) the engine does not cache ([7])"),
    ([7, 1, 2, 3], [1, 2, 3, 4], 5, "the engine caches 1 leading token(s)"),
    ([1, 2, 9, 4], [1, 2, 3, 4], 4, "token 2 differs"),
    ([1, 2, 3, 4], [1, 2, 3, 4, 5], 9, "the engine counts 9 prompt tokens, the router 5"),
    ([], [1, 2, 3], 3, None),  # no events for the probe: the counts agree
    ([], [1, 2, 3], 4, "the engine counts 4 prompt tokens, the router 3"),
])
def test_token_differences_are_described(got: list[int], want: list[int], prompt_tokens: int,
                                         says: str | None) -> None:
    answer = _difference(got, want, prompt_tokens)
    assert (answer is None) if says is None else (says in (answer or "")), answer


def test_every_cause_has_a_fix_and_checks_carry_them() -> None:
    assert all(c.cause and c.fix for c in CAUSES.values())
    failed = Check.failed("usage", "no details", "no_usage")
    assert failed.to_dict() == {"name": "usage", "ok": False, "detail": "no details",
                                "cause": CAUSES["no_usage"].cause, "fix": CAUSES["no_usage"].fix}
    assert Check.passed("events", "fine").to_dict() == {"name": "events", "ok": True, "detail": "fine"}


def test_the_report_text_json_and_exit_code() -> None:
    good = EngineReport("w0", [Check.passed(n, "fine") for n in CHECK_NAMES])
    bad = EngineReport("w1", [Check.failed(n, "broken", "reuse") if n == "reuse" else Check.passed(n, "fine")
                              for n in CHECK_NAMES])
    assert DoctorReport([good]).exit_code == 0
    assert DoctorReport([]).exit_code == 1  # nothing checked is not a pass
    report = DoctorReport([good, bad])
    assert report.exit_code == 1
    data = json.loads(report.to_json())
    assert data["ok"] is False and [e["ok"] for e in data["engines"]] == [True, False]
    lines = report.to_text().splitlines()
    assert len([line for line in lines if line.startswith(("w0", "w1"))]) == 2 * len(CHECK_NAMES)
    assert any("FAIL  broken" in line for line in lines) and lines[-1].startswith("FAILED: 13 of 14")
    assert any("cause:" in line for line in lines) and any("fix:" in line for line in lines)


def test_canaries_are_unique() -> None:
    a, b = Canary(), Canary()
    assert a.nonce != b.nonce
    words = a.words("ids", PROBE_TOKENS)
    assert len(set(words)) == len(words) and not set(words) & set(b.words("ids", PROBE_TOKENS))
    assert a.text("text", 3).startswith(f"tsr-doctor-{a.nonce}-text-0 ")


def test_the_watcher_follows_a_real_stream_with_the_routers_code() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    watcher = Watcher([StreamTarget(name="w0", worker="w0", dp_rank=0, events=pub.endpoint,
                                    replay=pub.replay_endpoint)])
    try:
        wait_until(lambda: watcher.joined("w0"), 10.0, interval_s=0.01, what="the watcher to join")
        tokens = list(range(1, 33))
        ids = block_hashes(tokens, 16)
        pub.publish(KVEventBatch(ts=1.0, events=[BlockStored(block_hashes=list(ids), parent_block_hash=None,
                                                             token_ids=tokens, block_size=16)]))
        # a continuation whose parent was never published: the router's index refuses it
        pub.publish(KVEventBatch(ts=2.0, events=[BlockStored(block_hashes=[7], parent_block_hash=12345,
                                                             token_ids=list(range(40, 56)), block_size=16)]))
        wait_until(lambda: watcher.unknown_parents("w0"), 10.0, interval_s=0.01, what="both batches")
        got = watcher.stored(["w0"], 0.0)
        assert [s.event.block_hashes for s in got] == [list(ids), [7]]
        assert watcher.match(tokens).scores == {"w0": 2}
        assert watcher.unknown_parents("w0") == [12345]
        assert watcher.batches("w0") == 2
    finally:
        watcher.close()
        pub.close()
