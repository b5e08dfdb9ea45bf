"""serve's collector policy (server/gc_policy.py), checked in fresh processes (it is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys

from tokenspeed_router.server.gc_policy import GcCollector, GcPauses

_CHILD = r"""
import gc, json
from tokenspeed_router.server import gc_policy, RouterService, ServerConfig
service = RouterService(ServerConfig(http=None))
service.metrics.add_collector(gc_policy.GcCollector())  # as HttpServer does
gc_policy.configure(); gc_policy.configure()  # idempotent
frozen = gc_policy.settle()
class Node:  # cycles made after start-up are still collected
    pass
for _ in range(50_000):
    a = Node(); a.me = a
gc.collect()
text = service.metrics_text().decode()
print(json.dumps({"threshold": gc.get_threshold(), "frozen": frozen, "freeze_count": gc.get_freeze_count(),
                  "callbacks": sum(1 for c in gc.callbacks if c == gc_policy.gc_pauses().callback),
                  "counts": gc_policy.gc_pauses().counts,
                  "metric": [line for line in text.splitlines() if line.startswith("tokenspeed_gc_")]}))
"""


def test_settle_freezes_start_up_and_configure_raises_the_young_threshold() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    assert got["threshold"][0] == 20_000
    assert got["frozen"] > 10_000 and got["freeze_count"] >= got["frozen"]  # start-up objects out of every pass
    assert got["callbacks"] == 1
    assert got["counts"][0] >= 1 and got["counts"][2] >= 1  # the young passes and the explicit full one
    assert any(line.startswith('tokenspeed_gc_pause_seconds_count{generation="2"}') for line in got["metric"])
    assert any(line.startswith("tokenspeed_gc_frozen_objects") for line in got["metric"])


def test_pauses_are_bucketed_per_generation() -> None:
    pauses = GcPauses()
    pauses.callback("start", {"generation": 2})
    pauses.callback("stop", {"generation": 2})
    pauses.callback("start", {"generation": 0})
    pauses.callback("stop", {"generation": 0})
    assert pauses.counts == [1, 0, 1]
    assert pauses.pauses[2].samples == 1 and pauses.longest[2] >= 0.0
    families = {f.name: f for f in GcCollector(pauses).collect()}
    samples = {(s.name, s.labels.get("generation"), s.labels.get("le")): s.value
               for s in families["tokenspeed_gc_pause_seconds"].samples}
    assert samples[("tokenspeed_gc_pause_seconds_count", "2", None)] == 1.0
    assert samples[("tokenspeed_gc_pause_seconds_bucket", "2", "+Inf")] == 1.0
    assert samples[("tokenspeed_gc_pause_seconds_count", "1", None)] == 0.0
