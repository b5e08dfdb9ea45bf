"""Decision logs read back: ``replay EVENTLOG --decisions FILE`` and ``simulate --decisions FILE``.

A live service routes on a fake wall clock while the same event batches are
written to an event log with the same receive times, so the replay must
rebuild exactly the index each decision saw and, with the logged policy,
decide every one the same way; another policy must show up as disagreement.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.server import batch, stored, tokens

from tokenspeed_router.cli import main
from tokenspeed_router.events.codec import encode_batch
from tokenspeed_router.events.log import EventLogWriter
from tokenspeed_router.router.router import RouterConfig
from tokenspeed_router.server import RouterService, ServerConfig
from tokenspeed_router.server.explain import ExplainConfig

T0 = 1_700_000_000.0


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """(event log, decision log, decisions): conversations stored after some of their turns were routed."""
    tmp = tmp_path_factory.mktemp("decisions")
    events, dlog = tmp / "events.tslog", tmp / "d.jsonl"
    clock = [T0]
    # the log records the cost model's terms (engine queue clocks and speeds included),
    # and the replay re-decides with them
    service = RouterService(ServerConfig(http=None, explain=ExplainConfig(decision_log=str(dlog)),
                                         router=RouterConfig()),
                            wall_clock=lambda: clock[0])
    service.start()
    writer = EventLogWriter(events, meta={"source": "test"})
    seqs: dict[str, int] = {}

    def feed(worker: str, *evs: Any) -> None:
        seq = seqs[worker] = seqs.get(worker, -1) + 1
        b = batch(*evs, ts=clock[0])
        payload = encode_batch(b)
        writer.append(worker, seq, payload, recv_time_s=clock[0])
        service.apply_record(worker, seq, b, clock[0], payload=payload)

    n = 0
    for w in ("w0", "w1", "w2"):
        feed(w, stored(tokens(90, 1)))  # every worker known to the index from the start
    for turn in range(12):
        clock[0] += 1.0
        conv = turn % 4
        prompt = tokens(conv, 2 + turn)
        service.route(prompt, request_id=f"r{turn}", lora_id=None)
        n += 1
        clock[0] += 0.5
        # the engine stores the prompt where the live router sent it, after the decision
        site = service.route(prompt, request_id=f"again{turn}").worker
        n += 1
        feed(site, stored(prompt))
        if turn % 3 == 2:
            service.release(f"r{turn - 1}")
    service.stop()
    writer.close()
    return events, dlog, n


def _summary(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_replay_with_the_logged_policy_decides_every_decision_the_same_way(
    logs: tuple[Path, Path, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events, dlog, n = logs
    rows_out = tmp_path / "rows.jsonl"
    assert main(["replay", str(events), "--decisions", str(dlog), "--decisions-out", str(rows_out),
                 "--no-progress"]) == 0
    s = _summary(capsys)
    assert s["decisions"] == n and s["malformed_lines"] == 0 and s["policy"] == s["logged_policy"] == "kv_aware"
    assert s["agree"] == n and s["agree_fraction"] == 1.0
    # the index rebuilt as of each decision's time credits what the live router credited
    assert s["index_checked"] > 0 and s["index_agrees"] == s["index_checked"]
    assert s["uncached_tokens"]["policy"] == s["uncached_tokens"]["logged"]
    rows = [json.loads(x) for x in rows_out.read_text().splitlines()]
    assert len(rows) == n and all(r["agree"] for r in rows)
    assert sum(r["logged_matched_tokens"] for r in rows) > 0  # later turns hit their conversation's prefix


def test_replay_under_another_policy_shows_what_it_would_have_cost(
    logs: tuple[Path, Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    events, dlog, n = logs
    assert main(["replay", str(events), "--decisions", str(dlog), "--policy", "round_robin", "--no-progress"]) == 0
    s = _summary(capsys)
    assert s["policy"] == "round_robin" and s["logged_policy"] == "kv_aware" and s["decisions"] == n
    assert s["agree"] < n
    assert s["uncached_tokens"]["policy"] > s["uncached_tokens"]["logged"]  # it ignores the prefixes
    assert s["index_checked"] > 0 and s["index_agrees"] == s["index_checked"]  # the audit reads the index anyway


def test_replay_before_the_events_arrived_is_not_the_same_as_after(
    logs: tuple[Path, Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    """--until cuts the decisions too: the index of each decision is the one of its time."""
    events, dlog, _ = logs
    assert main(["replay", str(events), "--decisions", str(dlog), "--until", "3", "--no-progress"]) == 0
    s = _summary(capsys)
    assert s["decisions"] == 4 and s["agree"] == 4  # r0, again0 (t0+1, +1.5), r1, again1 (+2.5, +3)


def test_simulate_decisions_compares_policies_on_the_logged_state(
    logs: tuple[Path, Path, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, dlog, n = logs
    assert main(["simulate", "--decisions", str(dlog), "--policies", "kv_aware,least_loaded,round_robin"]) == 0
    doc = _summary(capsys)
    assert doc["logged_policy"] == "kv_aware" and set(doc["policies"]) == {"kv_aware", "least_loaded", "round_robin"}
    same = doc["policies"]["kv_aware"]
    assert same["decisions"] == n and same["agree"] == n  # the logged credits and loads decide it again
    assert same["matched_tokens"]["policy"] == same["matched_tokens"]["logged"]
    blind = doc["policies"]["least_loaded"]
    assert blind["matched_tokens"]["policy"] == 0 and blind["uncached_tokens"]["policy"] > same["uncached_tokens"]["policy"]


def test_bad_decision_arguments_exit_2(logs: tuple[Path, Path, int], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    events, dlog, _ = logs
    assert main(["replay", str(events), "--decisions", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["replay", str(events), "--decisions", str(dlog), "--policy", "best"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert main(["replay", str(events), "--decisions-out", str(tmp_path / "x.jsonl")]) == 2
    assert main(["simulate", "--decisions", str(dlog), "--policies", "oracle"]) == 2
    assert main(["simulate", "--workers", "2"]) == 2
    assert "--trace" in capsys.readouterr().err


def test_a_redecision_prices_with_the_share_the_logged_decision_saw(logs: tuple[Path, Path, int]) -> None:
    """The in-flight term's share of session follow-ups is the router's learnt state, not a knob:
    the log records it per decision and the re-decision holds it there (issue 31)."""
    from tokenspeed_router.server.decision_log import DecisionLogReader
    from tokenspeed_router.tools.decision_replay import Redecider, redecide_config

    _, dlog, n = logs
    decisions = list(DecisionLogReader(str(dlog)))
    shares = [d.weights["followup_share"] for d in decisions]
    assert len(shares) == n and shares[0] == 0.0 and max(shares) > 0.0  # later turns carry their history
    decider = Redecider(redecide_config(decisions[0], None, {}, logged_view=True))
    for d in decisions:
        decider.decide(d)
        assert decider.router.followup_share == d.weights["followup_share"]
