"""``tokenspeed-router doctor`` against real engine-sims, each misconfigured one way (DESIGN §13).

One fleet for the module: a healthy engine and one engine per misconfiguration
knob, all started at once, and one doctor run over all of them (the engines
are checked concurrently). Each misconfigured engine must fail the check that
names its cause, and the healthy one must pass everything. A second run goes
through a real ``serve`` (``--router URL``: the router's /workers, its
``POST /doctor/expect`` tokenizer and its /match). Everything is real:
subprocesses, ZeroMQ, HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support import REPO_ROOT
from support.engine_sim import EngineSim
from support.server import ServeProcess

from tokenspeed_router.doctor.checks import CAUSES
from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.events.curve import generate_key_files

pytestmark = pytest.mark.serial  # eight engine-sims start at once for the module

#: engine -> its misconfiguration flags. Faults that show in different checks share an
#: engine, so the fleet starts six processes, not ten (each check is still named alone).
ENGINES: dict[str, list[str]] = {
    "healthy": [],
    "seed-usage": ["--fault-hash-seed", "7", "--fault-no-usage-details"],
    "bs-chat": ["--fault-publish-block-size", "32", "--fault-chat-template"],
    "tok-rank": ["--fault-tokenizer-skew", "--fault-dp-rank", "3"],
    "no-events": ["--fault-no-events"],
    "lag-lora": ["--fault-event-delay", "2.5", "--fault-lora-id", "7"],
    # not misconfigurations, events lost on the way: named so they are not blamed on one
    "drop": ["--fault-drop-events", "0.5"],
    "restart": ["--fault-restart-after-requests", "2"],
}
#: misconfiguration -> (engine, the check that must fail, words its cause must contain)
FAULTS: dict[str, tuple[str, str, str]] = {
    "hash seed": ("seed-usage", "hashes", "different seeds"),
    "no usage reporting": ("seed-usage", "usage", "cached_tokens"),
    "block size": ("bs-chat", "block_size", "block size"),
    "chat template": ("bs-chat", "tokens", "chat template"),
    "tokenizer": ("tok-rank", "tokens", "tokenizer"),
    "dp rank": ("tok-rank", "spec", "data-parallel rank"),
    "no events": ("no-events", "events", "publishes no KV events"),
    "event lag": ("lag-lora", "events", "later than the bound"),
    "lora": ("lag-lora", "spec", "LoRA"),
}
#: engine -> every check that fails there (the others pass: the report points at the faults)
FAILING: dict[str, set[str]] = {
    "healthy": set(),
    "seed-usage": {"hashes", "usage", "reuse"},
    "bs-chat": {"block_size", "tokens", "reuse"},
    "tok-rank": {"tokens", "spec"},
    "no-events": {"events", "block_size", "hashes", "reuse", "spec"},
    "lag-lora": {"events", "spec", "reuse", "hashes"},
}
#: engine -> the cause its failing checks name (which checks fail depends on which batches are lost)
LOSSES: dict[str, str] = {
    "drop": "events are lost before they are numbered",
    "restart": "the engine restarted while the doctor ran",
}
COMMON = ["--instant", "--capacity-tokens", "16384"]
DOCTOR_FLAGS = ["--timeout", "5", "--max-event-lag", "1.0"]


def spec(name: str, engine: EngineSim) -> str:
    return f"name={name},url={engine.url},events={engine.events},replay={engine.replay_endpoint}"


def doctor(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenspeed_router.cli", "doctor", *args], cwd=REPO_ROOT,
                          env={**os.environ}, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    workdir = tmp_path_factory.mktemp("doctor")
    engines = {name: EngineSim(workdir, [*COMMON, *flags]) for name, flags in ENGINES.items()}
    try:
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda e: e.start(timeout_s=120), engines.values()))
        yield engines
    finally:
        with ThreadPoolExecutor(len(engines)) as pool:  # each stop waits for its process: at once
            list(pool.map(lambda e: e.stop() if e.proc is not None else None, engines.values()))


@pytest.fixture(scope="module")
def direct_report(fleet: dict[str, EngineSim]) -> dict[str, Any]:
    args = [a for name, e in fleet.items() for a in ("--worker", spec(name, e))]
    proc = doctor(*args, *DOCTOR_FLAGS, "--json")
    assert proc.returncode == 1, proc.stderr  # some engine fails
    report = json.loads(proc.stdout)
    return {"report": report, "engines": {e["worker"]: e for e in report["engines"]}}


def checks(engine: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in engine["checks"]}


def test_the_report_has_the_contract_shape(direct_report: dict[str, Any]) -> None:
    report = direct_report["report"]
    assert report["ok"] is False
    for engine in report["engines"]:
        assert set(engine) == {"worker", "ok", "checks"}
        assert [c["name"] for c in engine["checks"]] == [
            "events", "block_size", "tokens", "hashes", "usage", "reuse", "spec"]
        for c in engine["checks"]:
            assert {"name", "ok", "detail"} <= set(c) <= {"name", "ok", "detail", "cause", "fix"}
            assert c["ok"] or (c["cause"] and c["fix"]), c


def test_a_healthy_engine_passes_every_check(direct_report: dict[str, Any]) -> None:
    healthy = direct_report["engines"]["healthy"]
    assert healthy["ok"], json.dumps(healthy, indent=1)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_misconfiguration_is_named(direct_report: dict[str, Any], fault: str) -> None:
    name, check, words = FAULTS[fault]
    engine = direct_report["engines"][name]
    got = checks(engine)[check]
    assert not got["ok"], json.dumps(engine, indent=1)
    assert words.lower() in got["cause"].lower(), got


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_lost_events_are_named_not_blamed_on_configuration(direct_report: dict[str, Any], name: str) -> None:
    """Events lost by the engine (silently, or in a restart) are named as such wherever they show."""
    failed = [c for c in checks(direct_report["engines"][name]).values() if not c["ok"]]
    assert failed, json.dumps(direct_report["engines"][name], indent=1)
    assert any(LOSSES[name] in c["cause"] for c in failed), json.dumps(failed, indent=1)
    no_events = CAUSES["no_events"].cause
    assert all(c["cause"] != no_events for c in failed), json.dumps(failed, indent=1)


@pytest.mark.parametrize("name", sorted(FAILING))
def test_checks_unrelated_to_the_faults_pass(direct_report: dict[str, Any], name: str) -> None:
    """A fault does not smear over the report: only the checks it touches fail."""
    failing = {n for n, c in checks(direct_report["engines"][name]).items() if not c["ok"]}
    assert failing == FAILING[name], json.dumps(direct_report["engines"][name], indent=1)


def test_exit_zero_and_one_line_per_check_on_a_healthy_fleet(fleet: dict[str, EngineSim]) -> None:
    proc = doctor("--worker", spec("healthy", fleet["healthy"]), *DOCTOR_FLAGS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 8 and lines[-1].startswith("ok: 7 of 7 checks passed"), proc.stdout
    assert all(line.split()[0] == "healthy" and line.split()[2] == "ok" for line in lines[:-1])


def test_bad_usage_exits_two() -> None:
    assert doctor().returncode == 2
    assert doctor("--worker", "name=x").returncode == 2  # no events endpoint
    no_url = doctor("--worker", "name=x,events=tcp://127.0.0.1:1")  # no url=: bad usage, not a failed check
    assert no_url.returncode == 2 and "no url=" in no_url.stderr and no_url.stdout == "", no_url
    proc = doctor("--router", "http://127.0.0.1:9", "--worker", "name=x,events=tcp://127.0.0.1:1")
    assert proc.returncode == 2 and "not both" in proc.stderr


def test_through_a_running_router(fleet: dict[str, EngineSim], tmp_path: Path) -> None:
    """--router URL: specs from /workers, tokens from the router's tokenizer, predictions from its index."""
    names = ("healthy", "tok-rank", "bs-chat")
    args = [a for n in names for a in ("--worker", spec(n, fleet[n]))]
    with ServeProcess(args, tmp_path).start(timeout_s=60) as router:
        proc = doctor("--router", router.url, *DOCTOR_FLAGS, "--json")
        expect = router.post("/doctor/expect", {"worker": "tok-rank", "prompt": "a b c"})
    assert proc.returncode == 1, proc.stderr
    engines = {e["worker"]: e for e in json.loads(proc.stdout)["engines"]}
    assert set(engines) == set(names)
    assert engines["healthy"]["ok"], json.dumps(engines["healthy"], indent=1)
    assert "tokenizer" in checks(engines["tok-rank"])["tokens"]["cause"]
    assert not checks(engines["bs-chat"])["block_size"]["ok"]
    # the router's own answer: the skewed engine's /tokenize adds a leading token
    assert len(expect["token_ids"]) == 4 and set(expect) == {"token_ids", "scores", "block_size"}


# ------------------------------------------------------------------ misconfigured specs
#
# Healthy engines, wrong worker specs: the spec names another engine's events, a topic
# the engine does not use, a replay endpoint where nothing (or another engine) answers,
# more or fewer DP ranks than the engine has. Workers of one doctor run never share an
# engine, so no canary is seen by two workers at once.


@pytest.fixture(scope="module")
def dp_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An engine with two DP ranks on fixed consecutive ports (rank r on port + r), as vLLM binds them."""
    events = free_tcp_port(consecutive=2)
    replay = free_tcp_port(consecutive=2, avoid=(events,))
    engine = EngineSim(tmp_path_factory.mktemp("doctor-dp"), [
        *COMMON, "--dp-ranks", "2", "--events", f"tcp://127.0.0.1:{events}",
        "--replay", f"tcp://127.0.0.1:{replay}"], replay=False)
    engine.start(timeout_s=120)
    yield {"engine": engine, "events": f"tcp://127.0.0.1:{events}", "replay": f"tcp://127.0.0.1:{replay}"}
    engine.stop()


def spec_report(*specs: str, flags: tuple[str, ...] = ()) -> dict[str, dict[str, dict[str, Any]]]:
    """worker -> check name -> check, from one doctor run over ``specs``."""
    args = [a for s in specs for a in ("--worker", s)]
    proc = doctor(*args, *DOCTOR_FLAGS, *flags, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    return {e["worker"]: checks(e) for e in json.loads(proc.stdout)["engines"]}


def failing(report: dict[str, dict[str, Any]]) -> set[str]:
    return {name for name, c in report.items() if not c["ok"]}


def test_misconfigured_specs_are_named(fleet: dict[str, EngineSim], dp_engine: dict[str, Any]) -> None:
    healthy, skewed, bs, seed = fleet["healthy"], fleet["tok-rank"], fleet["bs-chat"], fleet["seed-usage"]
    dp = dp_engine["engine"]
    first = spec_report(
        f"name=crossed-a,url={healthy.url},events={skewed.events},replay={skewed.replay_endpoint}",
        f"name=crossed-b,url={skewed.url},events={healthy.events},replay={healthy.replay_endpoint}",
        f"name=dead-replay,url={bs.url},events={bs.events},replay=tcp://127.0.0.1:{free_tcp_port()}",
        f"name=dp-ok,url={dp.url},events={dp_engine['events']},replay={dp_engine['replay']},dp_ranks=2",
    )
    for worker in ("crossed-a", "crossed-b"):
        events = first[worker]["events"]
        assert not events["ok"] and "different engines" in events["cause"], events
        assert "crossed" in events["fix"]
        # checks that could not run say why: the crossed endpoints, not "no events"
        assert "different engines" in first[worker]["hashes"]["cause"]
        # and reuse, whose prediction came from the other engine's stream, names them too
        reuse = first[worker]["reuse"]
        assert not reuse["ok"] and "different engines" in reuse["cause"], reuse
    dead = first["dead-replay"]["events"]
    assert not dead["ok"] and "nothing answers on the worker spec's replay endpoint" in dead["cause"], dead
    assert failing(first["dp-ok"]) == set(), json.dumps(first["dp-ok"], indent=1)
    assert "replay from seq" in first["dp-ok"]["events"]["detail"]

    second = spec_report(
        f"name=topic,url={healthy.url},events={healthy.events},topic=not-the-engines",
        f"name=swapped-replay,url={seed.url},events={seed.events},replay={skewed.replay_endpoint}",
        f"name=dp-short,url={dp.url},events={dp_engine['events']},replay={dp_engine['replay']}",
    )
    topic = second["topic"]["events"]
    assert not topic["ok"] and "topic" in topic["cause"] and "''" in topic["detail"], topic
    swapped = second["swapped-replay"]["events"]
    assert not swapped["ok"] and "another engine" in swapped["cause"], swapped
    short = second["dp-short"]
    assert failing(short) == {"spec"} and "more data-parallel ranks" in short["spec"]["detail"], short
    assert "dp_ranks=" in short["spec"]["cause"]

    lag = fleet["lag-lora"]
    third = spec_report(
        f"name=dp-extra,url={healthy.url},events={healthy.events},replay={healthy.replay_endpoint},dp_ranks=2",
        # another engine's (idle) stream, which the join replay shows is alive
        f"name=foreign,url={lag.url},events={bs.events},replay={bs.replay_endpoint}",
        # nothing publishes where the spec looks
        f"name=dead-events,url={skewed.url},events=tcp://127.0.0.1:{free_tcp_port()}",
    )
    dead_events = third["dead-events"]
    for name in ("events", "reuse"):
        assert not dead_events[name]["ok"] and "nothing accepts a connection" in dead_events[name]["cause"], \
            dead_events[name]
    extra = third["dp-extra"]
    assert failing(extra) == {"spec"}, json.dumps(extra, indent=1)
    assert "rank 1: nothing publishes" in extra["spec"]["detail"]
    foreign = third["foreign"]["events"]
    assert not foreign["ok"] and "another engine's publisher" in foreign["cause"], foreign


def test_doctor_follows_a_curve_relay(fleet: dict[str, EngineSim], tmp_path: Path) -> None:
    """With curve_server_key=/curve_key= in the spec, the doctor subscribes (and replays) over CURVE."""
    relay_public, relay_secret = generate_key_files(tmp_path / "relay", "relay")
    router_public, router_secret = generate_key_files(tmp_path / "router", "router")
    engine = fleet["healthy"]
    publish, replay = free_tcp_port(), free_tcp_port()
    with open(tmp_path / "relay.stderr", "wb") as stderr:
        relay = subprocess.Popen(
            [sys.executable, "-m", "tokenspeed_router.cli", "relay", "--engine", engine.events,
             "--engine-replay", engine.replay_endpoint, "--publish", f"tcp://127.0.0.1:{publish}",
             "--replay", f"tcp://127.0.0.1:{replay}", "--curve-secret-key", str(relay_secret),
             "--curve-allow", str(router_public)],
            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            base = f"name=relayed,url={engine.url},events=tcp://127.0.0.1:{publish},replay=tcp://127.0.0.1:{replay}"
            report = spec_report(f"{base},curve_server_key={relay_public},curve_key={router_secret}")["relayed"]
        finally:
            relay.terminate()
            relay.wait(30)
    assert failing(report) == set(), json.dumps(report, indent=1) + (tmp_path / "relay.stderr").read_text()[-2000:]


def test_block_size_other_than_expected_is_named(fleet: dict[str, EngineSim]) -> None:
    """``--block-size N``: an engine whose blocks are another size fails block_size, and only that."""
    report = spec_report(spec("healthy", fleet["healthy"]), flags=("--block-size", "32"))["healthy"]
    assert failing(report) == {"block_size"}, json.dumps(report, indent=1)
    assert "declare block_size 16, expected 32" in report["block_size"]["detail"]
    assert "--block-size" in report["block_size"]["cause"]


def test_crossed_specs_through_a_router_name_reuse(fleet: dict[str, EngineSim], tmp_path: Path) -> None:
    """--router URL whose workers have crossed url=/events=: the router's index holds the other
    engine's blocks, so its prediction is not this engine's; reuse names the crossing."""
    a, b = fleet["healthy"], fleet["tok-rank"]
    args = ["--worker", f"name=crossed-a,url={a.url},events={b.events},replay={b.replay_endpoint}",
            "--worker", f"name=crossed-b,url={b.url},events={a.events},replay={a.replay_endpoint}"]
    with ServeProcess(args, tmp_path).start(timeout_s=60) as router:
        proc = doctor("--router", router.url, *DOCTOR_FLAGS, "--json")
    assert proc.returncode == 1, proc.stderr
    for engine in json.loads(proc.stdout)["engines"]:
        found = checks(engine)
        for name in ("events", "reuse"):
            assert not found[name]["ok"] and "different engines" in found[name]["cause"], found[name]
