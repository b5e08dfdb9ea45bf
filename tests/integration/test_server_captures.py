"""Real engine captures re-published on real sockets -> `serve` subprocess -> HTTP answers = manifests.

All four captures feed ONE router process (eight streams): vLLM as one worker
with ``dp_ranks=2`` on consecutive ports (``vllm/dp0``, ``vllm/dp1``), the
others as two workers each. Rank 1 of every capture has a deliberate gap that
only its replay ROUTER (answering from the capture's replay records, in the
engine's own reply framing) can fill.
"""

from __future__ import annotations

from pathlib import Path

from support import wait_until
from support.server import CapturePublisher, ServeProcess

from tokenspeed_router.endpoints import free_tcp_port

ENGINES = ("tokenspeed-0.1.1", "vllm-0.33.0", "vllm-0.33.0-bytes-hashes", "sglang-0.5.23")


def test_captures_through_the_router_process(captures: Path, tmp_path: Path) -> None:
    publishers: dict[str, CapturePublisher] = {}
    names: dict[str, dict[str, str]] = {}
    args: list[str] = []
    try:
        for engine in ENGINES:
            short = engine.replace(".", "").replace("-", "")[:12]
            if engine == "vllm-0.33.0":
                base = free_tcp_port(consecutive=2)
                replay_base = free_tcp_port(consecutive=2, avoid=(base,))
                pub = CapturePublisher(captures / engine, base_port=base, replay_base_port=replay_base)
                args += ["--worker", f"name={short},events=tcp://127.0.0.1:{base},"
                         f"replay=tcp://127.0.0.1:{replay_base},dp_ranks=2,topic=kv"]
                names[engine] = {"dp0": f"{short}/dp0", "dp1": f"{short}/dp1"}
            else:
                pub = CapturePublisher(captures / engine)
                for rank in ("dp0", "dp1"):
                    args += ["--worker", f"name={short}-{rank},events={pub.events[rank]},"
                             f"replay={pub.replays[rank]},topic=kv"]
                names[engine] = {"dp0": f"{short}-dp0", "dp1": f"{short}-dp1"}
            publishers[engine] = pub
        with ServeProcess(args, tmp_path).start() as router:
            for pub in publishers.values():
                pub.serve_replays()
                pub.wait_subscribed()
                pub.publish_all()
            every = [n for m in names.values() for n in m.values()]

            def caught_up() -> bool:
                w = router.workers()
                return all(w[n]["last_seq"] == max(
                    publishers[e].ranks[r].messages) for e, m in names.items() for r, n in m.items())

            wait_until(caught_up, 20, what="every stream to reach its last seq")
            workers = router.workers()
            for n in every:
                assert workers[n]["state"] == "live", (n, workers[n])
            for engine, pub in publishers.items():
                mine = set(names[engine].values())
                assert workers[names[engine]["dp1"]]["replayed_batches"] >= 2, engine
                # the gap [2, 4) was asked for (from 2, or from 0 if the first batches were missed)
                assert any(r == "dp1" and start <= 2 for r, start in pub.replay_requests), pub.replay_requests
                for query, expected in pub.expected_matches(names[engine]):
                    answer = router.post("/match", {"token_ids": query})
                    got = {w: n for w, n in answer["scores"].items() if w in mine}  # zeros included
                    assert got == expected, (engine, query[:4], got, expected)
                    for w in got:
                        assert sum(answer["tiers"][w].values()) == got[w]
                        assert answer["block_size"][w] == 16
            assert router.stop() == 0
    finally:
        for pub in publishers.values():
            pub.close()
