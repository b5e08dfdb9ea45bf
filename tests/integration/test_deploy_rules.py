"""The shipped Grafana dashboard and Prometheus alert rules name only what ``serve`` really exports.

One real run: redis-server (the session fixture), an engine-sim, and ``serve
--state redis://...`` in front of it, with a few requests through the
gateway; its ``/metrics`` is scraped and parsed with prometheus-client's own
parser. Every PromQL expression in ``deploy/`` is parsed with
``promql-parser`` (Prometheus' grammar; a syntax error fails here, the way
``promtool check rules`` would), and every selector must name an exported
series with labels that series really has (plus the ``job``/``instance``
target labels Prometheus adds, and Prometheus' own ``up``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support import REPO_ROOT, wait_until
from support.engine_sim import EngineSim
from support.server import ServeProcess

pytestmark = pytest.mark.redis

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "tokenspeed-router.json"
ALERTS = REPO_ROOT / "deploy" / "prometheus" / "alerts.yml"
#: labels Prometheus attaches to every scraped series
TARGET_LABELS = {"job", "instance"}
#: series Prometheus makes itself
PROMETHEUS_OWN = {"up": set()}
#: Grafana's variables, replaced by what they stand for before parsing
GRAFANA_VARS = {"$__rate_interval": "5m", "$worker": ".*"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Iterator[dict[str, set[str]]]:
    """Sample name -> the label names it carries, from a real ``serve --state`` run.

    Two engines; ``w1`` caches a prompt, then dies, and that prompt is sent
    through the gateway: the router picks ``w1`` (it holds the prefix), the
    connection is refused, ``w1`` is marked down and the request retried on
    ``w0``, so the down-worker series exist too.
    """
    workdir = tmp_path_factory.mktemp("deploy")
    flags = ["--instant", "--capacity-tokens", "8192"]
    prompt = " ".join(str(n) for n in range(64))
    with EngineSim(workdir, flags).start(timeout_s=90) as w0, EngineSim(workdir, flags).start(timeout_s=90) as w1:
        specs = [a for name, e in (("w0", w0), ("w1", w1)) for a in (
            "--worker", f"name={name},url={e.url},events={e.events},replay={e.replay_endpoint}")]
        with ServeProcess([*specs, "--state", f"{redis_server.url}?ingest=stream"], workdir).start(timeout_s=60) as router:
            w1.complete(prompt, max_tokens=1)
            wait_until(lambda: router.post("/match", {"token_ids": list(range(64))})["scores"].get("w1", 0) >= 4,
                       20.0, interval_s=0.05, what="the router to see w1's blocks")
            w1.stop()
            for text in (prompt, prompt + " more", "1 2 3 4"):
                resp = httpx.post(f"{router.url}/v1/completions", timeout=30.0,
                                  json={"prompt": text, "max_tokens": 2})
                assert resp.status_code == 200, resp.text

            def full_metrics() -> str | None:
                text = httpx.get(f"{router.url}/metrics", timeout=10.0).text
                ready = ('tokenspeed_state_role{role="leader"} 1.0' in text
                         and 'tokenspeed_gateway_worker_down{worker="w1"} 1.0' in text)
                return text if ready else None

            text = wait_until(full_metrics, 30.0, interval_s=0.1, what="the replica to lead, w1 to be down")
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    yield out


def dashboard_exprs() -> list[tuple[str, str]]:
    data = json.loads(DASHBOARD.read_text())
    out = []
    for panel in data["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    return out


def alert_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(ALERTS.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def selectors(expr: Any) -> list[Any]:
    found: list[Any] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(expr, visit)
    return found


def problems(expr_text: str, exported: dict[str, set[str]]) -> list[str]:
    """What is wrong with one expression (empty: every name and label is real)."""
    for var, value in GRAFANA_VARS.items():
        expr_text = expr_text.replace(var, value)
    expr = promql_parser.parse(expr_text)  # raises on a syntax error
    known = {**exported, **PROMETHEUS_OWN}
    out: list[str] = []
    for sel in selectors(expr):
        if sel.name not in known:
            out.append(f"{sel.name}: not exported by serve")
            continue
        labels = {m.name for m in sel.matchers.matchers} - {"__name__"}
        unknown = labels - known[sel.name] - TARGET_LABELS
        if unknown:
            out.append(f"{sel.name}: no label(s) {sorted(unknown)} (it has {sorted(known[sel.name])})")

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            inner = set().union(*(known.get(s.name, set()) for s in selectors(node.expr))) | TARGET_LABELS
            missing = set(node.modifier.labels) - inner
            if missing:
                out.append(f"aggregation by {sorted(missing)}: no such label below it")

    promql_parser.walk(expr, visit)
    return out


def test_the_run_exported_what_the_rules_need(exported: dict[str, set[str]]) -> None:
    # the fixture is meaningful only if it reached every subsystem the rules cover
    for name in ("tokenspeed_gateway_predicted_cached_tokens_total", "tokenspeed_worker_state",
                 "tokenspeed_state_connected", "tokenspeed_worker_in_flight_requests",
                 "tokenspeed_ingest_visible_delay_seconds_bucket"):
        assert name in exported, sorted(exported)


@pytest.mark.parametrize("where,expr", dashboard_exprs(), ids=[w for w, _ in dashboard_exprs()])
def test_every_dashboard_query_names_real_series(exported: dict[str, set[str]], where: str, expr: str) -> None:
    assert problems(expr, exported) == [], where


@pytest.mark.parametrize("rule", alert_rules(), ids=[r["alert"] for r in alert_rules()])
def test_every_alert_names_real_series(exported: dict[str, set[str]], rule: dict[str, Any]) -> None:
    assert problems(rule["expr"], exported) == [], rule["alert"]


def test_the_rule_file_is_well_formed() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)) and len(rules) >= 10
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule
        if "for" in rule:
            promql_parser.parse_duration(rule["for"])
        # templates only use the labels the expression keeps
        for var in re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"])):
            assert var in rule["expr"] or var in TARGET_LABELS, (rule["alert"], var)


def test_the_dashboard_is_well_formed(exported: dict[str, set[str]]) -> None:
    data = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids)) and data["uid"] == "tokenspeed-router"
    for panel in data["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
    for var in data["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["definition"])
            assert m and m.group(2) in exported[m.group(1)], var
    # what the issue asks operators to see is on it
    text = json.dumps(data)
    for needle in ("predicted_cached_tokens", "reported_cached_tokens", "worker_misaligned", 'state=\\"stale\\"',
                   "resyncing", "visible_delay", "replay_requests", "resyncs", "route_latency",
                   "in_flight_requests", "state_connected"):
        assert needle in text, needle


def test_the_files_are_where_the_docs_say() -> None:
    ops = (REPO_ROOT / "docs" / "operations.md").read_text()
    assert "deploy/grafana/tokenspeed-router.json" in ops and "deploy/prometheus/alerts.yml" in ops
    assert Path(REPO_ROOT / "docs" / "img" / "dashboard.png").is_file()
