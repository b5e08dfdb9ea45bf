"""Routing throughput with explanation off, against the code before "why this worker" (issue 19 item 2).

Run (under the bench lock on a shared machine)::

    flock /tmp/tsr-bench.lock .venv/bin/python benchmarks/bench_explain.py             # ~2 min
    flock /tmp/tsr-bench.lock .venv/bin/python benchmarks/bench_explain.py --quick     # smoke
    .venv/bin/python benchmarks/bench_explain.py --baseline-ref edd8097 --baseline-patch --json out.json

The baseline is another commit's whole package (``--baseline-ref``, default
``main``; for this feature's cost, edd8097 (main, wave 3) with the feature
taken out by ``--baseline-patch``: benchmarks/baselines/explain-off-edd8097.patch), exported with ``git archive`` into a temporary directory as
``tokenspeed_router_baseline`` (its imports rewritten to that name, this
build's compiled core copied beside it) and imported into this process. So
both versions' code paths run in one process, over one index, query by
query in turn, in a new random order for every query: machine noise hits
both alike, and no row always runs right after the same other row.

Workload: ``bench_router.py``'s (fixed seed, block size 16, 8 workers
holding 1k-16k-token conversations that start with one of four 512-token
system prompts); queries are 1k-token next turns, 256 requests kept in flight
per row. Rows, each the median µs per call over the queries, ``--repeats``
times:

* ``service`` / ``service_baseline`` — ``RouterService.route``, explanation off
  (no sampler, no decision log), this version and the baseline's;
  ``service_again`` is a second ``service`` row: the A/A control, whose ratio
  to ``service`` is the noise floor of this measurement;
* ``service_log_idle`` — with ``--decision-log FILE --explain-sample 0``: the
  log open, nothing sampled (what an operator who only asks now and then runs);
* ``service_sample_1pct`` — ``--explain-sample 0.01``: every 100th decision
  explained and written by the writer thread (its share included);
* ``service_explain`` — every decision asked for (``explain=True``), for scale;
* ``http`` / ``http_baseline`` — ``POST /route`` through each version's ASGI
  app (Starlette routing, body read, decode, validation, the service, JSON
  out), driven in process without sockets, explanation off;
* ``gateway_check`` / ``gateway_check_baseline`` — the gateway's per-request
  header pass (auth + ``x-tokenspeed-explain``) on eight typical headers,
  100 calls per sample.

Ratios are throughput ratios per repeat (baseline µs / this µs: 1.00 = the
same, below 1 = slower), then median and min-max.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from bench_router import SEED, build_index, queries

import tokenspeed_router
from tokenspeed_router import _native
from tokenspeed_router.bench.cli_bench import IN_FLIGHT

WORKERS = 8
TOKENS = 1024
BASELINE = "tokenspeed_router_baseline"
COPY = "tokenspeed_router_copy"
REPO = Path(__file__).resolve().parent.parent
_IMPORT = re.compile(r"\b(from|import) tokenspeed_router\b")


#: ``--baseline-ref edd8097 --baseline-patch``: main (wave 3) with the feature taken out (what
#: f68858a f5b5df7 ab9df25 722b706 7451c81 374a6fe added to the package, reverted; its
#: replay/simulate re-deciding, off the routing path, kept); the figures in docs/benchmarks.md
EXPLAIN_OFF_PATCH = REPO / "benchmarks" / "baselines" / "explain-off-edd8097.patch"


def _import_as(root: Path, name: str) -> Any:
    """Import ``root/tokenspeed_router`` as package ``name`` (imports rewritten, this build's core copied)."""
    pkg = root / name
    (root / "tokenspeed_router").rename(pkg)
    for py in pkg.rglob("*.py"):
        py.write_text(_IMPORT.sub(r"\1 " + name, py.read_text()))
    native = Path(_native.__file__)
    shutil.copy2(native, pkg / native.name)  # a copy: its own module object, loaded from its own path
    sys.path.insert(0, str(root))
    return importlib.import_module(name)


def load_baseline_package(ref: str, patch: Path | None = None) -> tuple[Any, Path]:
    """Commit ``ref``'s ``tokenspeed_router`` imported as :data:`BASELINE` (see the module docstring).

    ``patch`` (a ``git diff`` of the package) is applied to it first, so a
    baseline such as "``ref`` without one feature" is rebuilt from history and
    a file in the repository, with no tag or branch to keep alive.
    """
    root = Path(tempfile.mkdtemp(prefix="tsr-baseline-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "tokenspeed_router"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    if patch is not None:
        subprocess.run(["git", "apply", str(patch.resolve())], cwd=root, check=True)
    same_core = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", ref, "HEAD", "--", "csrc", "setup.py"],
                               check=False).returncode == 0
    if not same_core:
        print(f"note: csrc/ differs between {ref} and HEAD; the baseline runs on this build's native core",
              file=sys.stderr)
    return _import_as(root, BASELINE), root


def load_copy_package() -> tuple[Any, Path]:
    """This checkout's package imported a second time, as :data:`COPY`: the like-for-like control.

    A package imported as a second copy runs measurably slower than the one
    imported first (about 10 % here for ``RouterService.route``), so the
    baseline is compared with this copy, not with the original.
    """
    root = Path(tempfile.mkdtemp(prefix="tsr-copy-"))
    shutil.copytree(REPO / "tokenspeed_router", root / "tokenspeed_router",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return _import_as(root, COPY), root


class _Row:
    """One way of routing, with its own in-flight window (``IN_FLIGHT`` kept)."""

    def __init__(self, call: Callable[[list[int], str], Any], release: Callable[[str], Any], tag: str,
                 per_call: int = 1) -> None:
        self.call, self.release, self.tag, self.per_call = call, release, tag, per_call
        self.window: deque[str] = deque()
        self.seconds: list[float] = []

    def step(self, i: int, q: list[int]) -> None:
        rid = f"{self.tag}{i}"
        t0 = time.perf_counter()
        self.call(q, rid)
        self.seconds.append((time.perf_counter() - t0) / self.per_call)
        self.window.append(rid)
        if len(self.window) > IN_FLIGHT:
            self.release(self.window.popleft())


def _service(pkg: Any, index: Any, **explain: Any) -> Any:
    server = importlib.import_module(pkg.__name__ + ".server")
    config = server.ServerConfig(http=None)
    if explain:
        from tokenspeed_router.server.explain import ExplainConfig

        config = server.ServerConfig(http=None, explain=ExplainConfig(**explain))
    service = server.RouterService(config)
    # not started: no ingestion thread (nothing to subscribe to) taking the GIL from the timed calls
    if explain:
        service.open_decision_log()
    with service.locked():
        service.replace_index(index)  # the same loaded index behind every service
    return service


class _Asgi:
    """``POST /route`` into an ASGI app, no sockets and no event loop.

    Nothing on that path waits for I/O (the body is there at once), so the
    coroutine is driven by hand: an event loop's poll per call would be
    timed too, and would hand the GIL to other threads mid-measurement.
    """

    def __init__(self, pkg: Any, service: Any) -> None:
        http = importlib.import_module(pkg.__name__ + ".server.http")
        self.app = http.create_app(service)
        self.status = 0

    def call(self, body: bytes) -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]

        scope = {"type": "http", "method": "POST", "path": "/route", "raw_path": b"/route", "root_path": "",
                 "query_string": b"", "scheme": "http", "server": ("127.0.0.1", 8000), "http_version": "1.1",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
        coro = self.app(scope, receive, send)
        try:
            while True:
                coro.send(None)
        except StopIteration:
            pass
        if self.status != 200:
            raise RuntimeError(f"POST /route answered {self.status}")


_HEADERS = [(b"host", b"127.0.0.1:9000"), (b"user-agent", b"OpenAI/Python 1.54.0"), (b"accept", b"application/json"),
            (b"accept-encoding", b"gzip, deflate"), (b"connection", b"keep-alive"),
            (b"content-type", b"application/json"), (b"content-length", b"5210"),
            (b"authorization", b"Bearer sk-not-checked")]


def _check_row(pkg: Any, tag: str) -> _Row:
    gateway_app = importlib.import_module(pkg.__name__ + ".gateway.app")
    fake = type("G", (), {"_expected": None})()
    check = gateway_app.Gateway._check
    scope = {"headers": _HEADERS}

    def call(q: list[int], rid: str) -> None:
        for _ in range(100):
            check(fake, scope)

    return _Row(call, lambda rid: None, tag, per_call=100)


def _rows(pkgs: dict[str, Any], index: Any, rep: int, tmp: Path) -> tuple[dict[str, _Row], list[Any]]:
    base, this, copy = pkgs["baseline"], pkgs["this"], pkgs["copy"]
    services: list[Any] = []

    def service_row(name: str, pkg: Any, tag: str, explain: bool = False, **cfg: Any) -> None:
        svc = _service(pkg, index, **cfg)
        services.append(svc)
        if explain:
            rows[name] = _Row(lambda q, rid: svc.route(q, request_id=rid, explain=True), svc.release, tag)
        else:
            rows[name] = _Row(lambda q, rid: svc.route(q, request_id=rid), svc.release, tag)

    rows: dict[str, _Row] = {}
    service_row("service_baseline", base, f"b{rep}-")
    service_row("service", this, f"t{rep}-")
    service_row("service_again", this, f"a{rep}-")  # A/A control: the same code as "service"
    service_row("service_copy", copy, f"c{rep}-")  # this code, imported second like the baseline
    service_row("service_log_idle", this, f"l{rep}-", decision_log=str(tmp / f"idle{rep}.jsonl"), explain_sample=0.0)
    service_row("service_sample_1pct", this, f"s{rep}-", decision_log=str(tmp / f"s{rep}.jsonl"), explain_sample=0.01)
    service_row("service_explain", this, f"e{rep}-", explain=True)
    encoder = msgspec.json.Encoder()
    for name, pkg, tag in (("http_baseline", base, f"hb{rep}-"), ("http", this, f"ht{rep}-"),
                           ("http_copy", copy, f"hc{rep}-")):
        svc = _service(pkg, index)
        services.append(svc)
        rows[name] = _HttpRow(_Asgi(pkg, svc), svc.release, tag, encoder)
    rows["gateway_check_baseline"] = _check_row(base, "cb")
    rows["gateway_check"] = _check_row(this, "ct")
    rows["gateway_check_copy"] = _check_row(copy, "cc")
    return rows, services


class _HttpRow(_Row):
    """``POST /route`` rows: the request body is encoded before the clock starts."""

    def __init__(self, asgi: _Asgi, release: Callable[[str], Any], tag: str, encoder: msgspec.json.Encoder) -> None:
        super().__init__(lambda q, rid: None, release, tag)
        self._asgi = asgi
        self._encoder = encoder

    def step(self, i: int, q: list[int]) -> None:
        rid = f"{self.tag}{i}"
        body = self._encoder.encode({"token_ids": q, "request_id": rid})
        t0 = time.perf_counter()
        self._asgi.call(body)
        self.seconds.append(time.perf_counter() - t0)
        self.window.append(rid)
        if len(self.window) > IN_FLIGHT:
            self.release(self.window.popleft())


PAIRS = (
    # the feature's cost, like for like: both sides imported as second copies
    ("service_copy_vs_baseline", "service_copy", "service_baseline"),
    ("http_copy_vs_baseline", "http_copy", "http_baseline"),
    ("gateway_check_copy_vs_baseline", "gateway_check_copy", "gateway_check_baseline"),
    # controls: the same code twice, and the same code imported first vs second
    ("service_vs_service_again", "service", "service_again"),
    ("service_vs_service_copy", "service", "service_copy"),
    ("service_vs_baseline", "service", "service_baseline"),
    ("service_log_idle_vs_baseline", "service_log_idle", "service_baseline"),
    ("service_sample_1pct_vs_baseline", "service_sample_1pct", "service_baseline"),
    ("service_explain_vs_baseline", "service_explain", "service_baseline"),
    ("http_vs_baseline", "http", "http_baseline"),
    ("gateway_check_vs_baseline", "gateway_check", "gateway_check_baseline"),
)


def run(num_queries: int, repeats: int, ref: str, patch: Path | None = None) -> dict[str, Any]:
    baseline, root = load_baseline_package(ref, patch)
    copy, copy_root = load_copy_package()
    pkgs = {"baseline": baseline, "this": tokenspeed_router, "copy": copy}
    rng = random.Random(SEED + WORKERS)
    index, conversations = build_index(WORKERS, 40 if num_queries > 500 else 8, rng)
    qs = queries(conversations, TOKENS, num_queries, random.Random(SEED + TOKENS))
    tmp = Path(tempfile.mkdtemp(prefix="tsr-bench-explain-"))
    gc.collect()
    gc.freeze()
    samples: dict[str, list[float]] = {}
    try:
        for rep in range(repeats):
            rows, services = _rows(pkgs, index, rep, tmp)
            order = list(rows.values())
            for i, q in enumerate(qs[:50]):  # warm-up
                for row in order:
                    row.step(-1 - i, q)
            for row in order:
                row.seconds.clear()
            shuffle = random.Random(SEED + rep)
            for i, q in enumerate(qs):
                shuffle.shuffle(order)  # a new order per query: no row always follows the same one
                for row in order:
                    row.step(i, q)
            for name, row in rows.items():
                samples.setdefault(name, []).append(statistics.median(row.seconds) * 1e6)
            for service in services:
                service.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(copy_root, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    out: dict[str, Any] = {"baseline_ref": ref, "baseline_patch": None if patch is None else str(patch), "workers": WORKERS, "tokens": TOKENS, "queries": num_queries,
                           "repeats": repeats, "stored_blocks": index.num_blocks(), "rows": {}, "ratios": {}}
    for name, values in samples.items():
        out["rows"][name] = {"median_us": round(statistics.median(values), 2), "min_us": round(min(values), 2),
                             "max_us": round(max(values), 2), "repeats_us": [round(v, 2) for v in values]}
    for name, this_row, base_row in PAIRS:
        per = [b / t for t, b in zip(samples[this_row], samples[base_row], strict=True)]  # throughput ratio
        out["ratios"][name] = {"median": round(statistics.median(per), 3), "min": round(min(per), 3),
                               "max": round(max(per), 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 queries, 1 repeat (smoke)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--baseline-ref", default="main", help="git commit or branch to compare with (default main)")
    parser.add_argument("--baseline-patch", nargs="?", type=Path, const=EXPLAIN_OFF_PATCH, default=None,
                        metavar="FILE", help="apply this package diff to the baseline first; with no FILE, "
                        f"{EXPLAIN_OFF_PATCH.relative_to(REPO)} (use with --baseline-ref edd8097)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    result = run(300 if args.quick else args.queries, 1 if args.quick else args.repeats, args.baseline_ref,
                 args.baseline_patch)
    for name, row in result["rows"].items():
        print(f"{name:24s} median {row['median_us']:8.2f} us  (min {row['min_us']:.2f}, max {row['max_us']:.2f})")
    print(f"throughput ratios vs {args.baseline_ref} ({result['repeats']} repeats, {WORKERS} workers, "
          f"{TOKENS}-token prompts; 1.00 = same, < 1 = slower):")
    for name, ratio in result["ratios"].items():
        print(f"  {name:34s} {ratio['median']:.3f}  (min {ratio['min']:.3f}, max {ratio['max']:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
