"""schemathesis over every operation of the published OpenAPI document, against a real ``serve``.

Bounded (a fixed seed, a few dozen examples per operation, seconds in all).
The router serves one worker whose events come from a real publisher (three
stored prompts) and whose ``url=`` is a real engine-sim that publishes no
events, so that the gateway's requests reach an engine without touching the
index. Every check schemathesis has runs (no 5xx, answers conform to the
document, auth enforced, 405s with their Allow header), except that a
schema-valid body may be refused by the gateway's engine (it validates more
than the document can say) or by ``PUT /workers`` (endpoints are checked,
not just typed) or ``/doctor/expect`` (a text prompt needs a worker with a
url). Afterwards the index is as before: the same ``/match`` answers, the
same blocks per worker; only ``/route``'s in-flight bookkeeping may differ.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import REPO_ROOT, wait_until
from support.engine_sim import EngineSim
from support.server import ServeProcess, batch, stored, tokens

from tokenspeed_router.events.publisher import ZmqEventPublisher

pytestmark = pytest.mark.serial  # a bounded but CPU-heavy run against one live serve

pytest.importorskip("schemathesis")  # dev extra; Python >= 3.11

TOKEN = "fuzz-token"
PROMPTS = [tokens(seed, 4) for seed in range(3)]
CONFIG = """
[[operations]]
include-tag = ["gateway", "doctor"]
checks.positive_data_acceptance.enabled = false

[[operations]]
include-path = "/workers/{name}"
checks.positive_data_acceptance.enabled = false
"""


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    workdir = tmp_path_factory.mktemp("fuzz")
    engine = EngineSim(workdir, args=["--fault-no-events"]).start()
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=100)
    serve = ServeProcess(["--auth-token", TOKEN, "--worker",
                          f"name=w0,url={engine.url},events={pub.endpoint},replay={pub.replay_endpoint}"],
                         workdir)
    try:
        serve.start(token=TOKEN)
        for prompt in PROMPTS:
            pub.publish(batch(stored(prompt), ts=time.time()))
        wait_until(lambda: serve.workers()["w0"]["blocks"] == 4 * len(PROMPTS), 20,
                   what="the publisher's blocks in the index")
        yield serve
    finally:
        serve.stop()
        engine.stop()
        pub.close()


def _index(serve: ServeProcess) -> dict[str, Any]:
    """What the index says: the match of every stored prompt and each worker's blocks (not in-flight)."""
    return {
        "match": [serve.post("/match", {"token_ids": p}) for p in PROMPTS],
        "blocks": {name: (w["blocks"], w["blocks_by_tier"], w["events_applied"], w["state"])
                   for name, w in serve.workers().items()},
    }


def _schemathesis(serve: ServeProcess, tmp: Path, *operations: str) -> None:
    tmp.mkdir()
    config = tmp / "schemathesis.toml"
    config.write_text(CONFIG)
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "support.schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
         f"{serve.url}/openapi.json", "-H", f"Authorization: Bearer {TOKEN}", "--seed", "20261203",
         "--max-examples", "25", "--phases", "examples,coverage,fuzzing", "-w", "1", "--no-color",
         "--request-timeout", "30", "--report-dir", str(tmp / "report"), *operations],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=110, check=False)
    assert out.returncode == 0, out.stdout[-20000:] + out.stderr[-5000:]
    assert "Tested: 0" not in out.stdout, out.stdout[-3000:]


def test_every_operation_without_5xx_and_the_index_unchanged(router: ServeProcess, tmp_path: Path) -> None:
    before = _index(router)
    assert before["blocks"]["w0"][0] == 12
    _schemathesis(router, tmp_path / "queries", "--exclude-path", "/workers/{name}")
    # run-time membership last (and by itself): a worker it added would be routable
    _schemathesis(router, tmp_path / "membership", "--include-path", "/workers/{name}")
    after = _index(router)
    assert after["match"] == before["match"]
    assert after["blocks"]["w0"] == before["blocks"]["w0"]
    assert set(after["blocks"]) == set(before["blocks"])  # no generated PUT added a worker
    assert router.alive()
