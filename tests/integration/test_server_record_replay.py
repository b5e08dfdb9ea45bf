"""Record while serving, replay the log, get the same /match answers; plus the other CLI commands.

The serving router here also exercises: a DP worker of our own publishers
(``dp_ranks=2`` on port + rank), prefill/decode roles, the ZMQ API, auth from
a token file, hostile input over both APIs, and a clean SIGTERM (the log is
flushed: replaying it reproduces the live answers exactly).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq
from support import REPO_ROOT, wait_until
from support.server import CapturePublisher, ServeProcess, batch, nonzero, removed, stored, tokens

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.errors import RouterApiError
from tokenspeed_router.events.log import EventLogReader
from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.server import ZmqRouterClient


def _cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenspeed_router.cli", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s, check=False,
    )


def _workload(pubs: list[ZmqEventPublisher], rng: random.Random, steps: int) -> list[list[int]]:
    """Random stores, extensions and removals; returns prompts worth asking about."""
    chains: list[tuple[int, list[int], int]] = []  # (publisher index, tokens, blocks held)
    prompts: list[list[int]] = []
    for step in range(steps):
        i = rng.randrange(len(pubs))
        mine = [c for c in chains if c[0] == i and c[2] > 0]
        roll = rng.random()
        if roll < 0.5 or not mine:
            t = tokens(1000 + step, rng.randint(1, 6))
            pubs[i].publish(batch(stored(t)))
            chains.append((i, t, len(t) // 16))
            prompts.append([*t, 1, 2, 3])
        elif roll < 0.75:
            _, t, held = rng.choice(mine)
            more = tokens(5000 + step, rng.randint(1, 3))
            pubs[i].publish(batch(stored(more, parent_tokens=t[: held * 16])))
            prompts.append(t[: held * 16] + more)
        else:
            k = mine.index(rng.choice(mine))
            _, t, held = mine[k]
            pubs[i].publish(batch(removed(t, held - 1, 1)))  # evict the leaf block
            chains[chains.index(mine[k])] = (i, t, held - 1)
            prompts.append(t)
    for p in pubs:
        p.wait_sent(5)
    return prompts


def test_record_serve_replay_equivalence(tmp_path: Path) -> None:
    base, rbase = free_tcp_port(consecutive=2), 0
    rbase = free_tcp_port(consecutive=2, avoid=(base,))
    pool = [ZmqEventPublisher(f"tcp://127.0.0.1:{base}", replay_endpoint=f"tcp://127.0.0.1:{rbase}", dp_rank=r)
            for r in range(2)]
    prefill = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    token_file = tmp_path / "token"
    token_file.write_text("hunter2\n")
    log = tmp_path / "events.tslog"
    zmq_ep = f"tcp://127.0.0.1:{free_tcp_port()}"
    args = [
        "--worker", f"name=pool,events=tcp://127.0.0.1:{base},replay=tcp://127.0.0.1:{rbase},dp_ranks=2,role=decode",
        "--worker", f"name=pf,events={prefill.endpoint},replay={prefill.replay_endpoint},role=prefill",
        "--record", str(log), "--zmq-api", zmq_ep, "--auth-token-file", str(token_file),
        "--max-body-bytes", "100000", "--router-option", "local_prefill_threshold_tokens=0",
    ]
    pubs = [*pool, prefill]
    names = ["pool/dp0", "pool/dp1", "pf"]
    try:
        with ServeProcess(args, tmp_path).start(token="hunter2") as router:
            wait_until(lambda: all(router.workers()[n]["connected"] for n in names), 10, what="connected")
            prompts = _workload(pubs, random.Random(7), 80)
            last = {n: p.statistics().published - 1 for n, p in zip(names, pubs, strict=True)}
            wait_until(lambda: all(router.workers()[n]["last_seq"] == last[n] for n in names), 15,
                       what="router caught up")
            workers = router.workers()
            assert workers["pool/dp1"]["role"] == "decode" and workers["pf"]["role"] == "prefill"
            assert all(workers[n]["state"] == "live" for n in names)
            live = [router.post("/match", {"token_ids": p}) for p in prompts]
            assert any(a["scores"] for a in live)

            # --- the same answers over ZMQ; routing pairs a prefill and a decode worker ----
            with ZmqRouterClient(zmq_ep, auth_token="hunter2") as zc:
                assert zc.match(prompts[0]) == live[0]
                decision = zc.route(prompts[0], request_id="q0")
                assert decision["decode_worker"] in ("pool/dp0", "pool/dp1")
                assert decision["prefill_worker"] in (None, "pf")
                zc.release("q0")
            # --- hostile input: errors, process alive, index intact ------------------------
            anon = httpx.Client(base_url=router.url, timeout=5)
            assert anon.post("/match", json={"token_ids": [1]}).status_code == 401
            assert anon.get("/health").status_code == 200
            anon.close()
            for body in (b"\x00\xff", b'{"token_ids": [1,', b'{"token_ids": {"a": 1}}', b"9" * 200_000):
                resp = router.http.post("/match", content=body, headers={"content-type": "application/json"})
                assert 400 <= resp.status_code < 500 and "error" in resp.json()
            ctx = zmq.Context()
            raw = ctx.socket(zmq.DEALER)
            raw.linger = 0
            raw.connect(zmq_ep)
            for frames in ([b"\x93\x01\x02"], [b""], [b"x", b"y", b"z"], [msgspec.msgpack.encode({"op": 5})]):
                raw.send_multipart(frames)
                assert raw.poll(5000), frames
                reply = msgspec.msgpack.decode(raw.recv_multipart()[-1])
                assert reply["status"] >= 400
            raw.send(b"\x00" * 200_000)  # over max_body_bytes: libzmq drops this peer
            raw.close()
            ctx.term()
            with ZmqRouterClient(zmq_ep, auth_token="nope") as bad:
                try:
                    bad.workers()
                    raise AssertionError("expected 401")
                except RouterApiError as err:
                    assert err.status == 401
            assert router.alive()
            assert [router.post("/match", {"token_ids": p}) for p in prompts] == live

            # --- inspect a live router by URL ------------------------------------------------
            out = _cli("inspect", router.url, "--auth-token", "hunter2", "--json")
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["workers"]["pf"]["blocks"] == workers["pf"]["blocks"]
            # the URL may name an endpoint; no httpx INFO lines in the table output
            out = _cli("inspect", router.url + "/workers", "--auth-token", "hunter2")
            assert out.returncode == 0, out.stderr
            assert "pool/dp1" in out.stdout and "HTTP Request" not in out.stderr, out.stderr
            assert router.stop() == 0  # SIGTERM: clean exit, log flushed
    finally:
        for p in pubs:
            p.close()

    # --- replay the log: exactly the live answers ----------------------------------------------
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    out = _cli("replay", str(log), "--queries", str(queries))
    assert out.returncode == 0, out.stderr
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert answers == live
    assert "replay [" in out.stderr  # progress bar
    # --- inspect the log ----------------------------------------------------------------------
    out = _cli("inspect", str(log), "--json")
    assert out.returncode == 0, out.stderr
    summary: dict[str, Any] = json.loads(out.stdout)
    assert set(summary["workers"]) == set(names)
    for n in names:
        assert summary["workers"][n]["blocks"] == workers[n]["blocks"]
        assert summary["workers"][n]["gaps"] == 0
    text = _cli("inspect", str(log))
    assert text.returncode == 0 and "pool/dp1" in text.stdout
    # --- --until 0: only the first instant of the log -------------------------------------------
    out = _cli("replay", str(log), "--until", "0", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["records"] < summary["records"]


def test_record_command_and_capture_replay(captures: Path, tmp_path: Path) -> None:
    """`record` a re-published capture, then `replay --queries` answers as the manifest says."""
    pub = CapturePublisher(captures / "sglang-0.5.23")
    log = tmp_path / "cap.tslog"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenspeed_router.cli", "record",
         "--worker", f"name=dp0,events={pub.events['dp0']},replay={pub.replays['dp0']},topic=kv",
         "--worker", f"name=dp1,events={pub.events['dp1']},replay={pub.replays['dp1']},topic=kv",
         "--out", str(log), "--duration", "3"],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        pub.serve_replays()
        pub.wait_subscribed()
        pub.publish_all()
        _, err = proc.communicate(timeout=60)
    finally:
        pub.close()
    assert proc.returncode == 0, err
    assert "recorded" in err
    queries = tmp_path / "q.jsonl"
    manifest = pub.manifest
    queries.write_text("".join(json.dumps({"token_ids": q["tokens"]}) + "\n" for q in manifest["queries"]))
    for source in (log, captures / "sglang-0.5.23"):
        out = _cli("replay", str(source), "--queries", str(queries), "--no-progress")
        assert out.returncode == 0, out.stderr
        for line, q in zip(out.stdout.splitlines(), manifest["queries"], strict=True):
            expected = {w: n for w, n in q["matched_blocks"].items() if n > 0}
            assert nonzero(json.loads(line)["scores"]) == expected, (source, q["description"])
    out = _cli("inspect", str(log), "--json")
    assert json.loads(out.stdout)["workers"]["dp1"]["gaps"] == 0  # the replayed batches were recorded
    assert json.loads(out.stdout)["truncated"] is False
    with EventLogReader(log) as reader:
        assert reader.meta["source"] == "tokenspeed-router record"


def test_live_log_is_current_while_serving(tmp_path: Path) -> None:
    """Each batch is in the log as soon as the router has it: no waiting for the next event."""
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    log = tmp_path / "live.tslog"
    args = ["--worker", f"name=w0,events={pub.endpoint},replay={pub.replay_endpoint}", "--record", str(log)]
    try:
        with ServeProcess(args, tmp_path).start() as router:
            wait_until(lambda: router.workers()["w0"]["connected"], 10, what="connected")
            prompts = _workload([pub], random.Random(3), 12)
            last = pub.statistics().published - 1
            wait_until(lambda: router.workers()["w0"]["last_seq"] == last, 15, what="router caught up")
            # The router is still running and no further event comes: the log must
            # already hold every batch, so a replay agrees with the live answers.
            with EventLogReader(log) as reader:
                seqs = [r.seq for r in reader]
            assert seqs == list(range(last + 1))
            live = [nonzero(router.post("/match", {"token_ids": p})["scores"]) for p in prompts]
            queries = tmp_path / "q.jsonl"
            queries.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
            replay = _cli("replay", str(log), "--queries", str(queries), "--no-progress")
            assert replay.returncode == 0, replay.stderr
            replayed = [nonzero(json.loads(line)["scores"]) for line in replay.stdout.splitlines()]
            assert replayed == live
    finally:
        pub.close()


def test_replay_checks_queries_file_first(tmp_path: Path, captures: Path) -> None:
    proc = _cli("replay", str(captures / "sglang-0.5.23"), "--queries", str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"tokenspeed-router replay: error: --queries {tmp_path / 'missing.jsonl'}: no such file"
    assert proc.stdout == ""
