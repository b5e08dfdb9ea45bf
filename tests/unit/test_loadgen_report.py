"""loadgen: summaries (percentiles, hit ratio, spread, errors), table, progress lines."""

from __future__ import annotations

import io
import json

import pytest

from tokenspeed_router.loadgen import RequestRecord, format_runs_table, summarize
from tokenspeed_router.loadgen.report import write_plots
from tokenspeed_router.percentiles import percentile
from tokenspeed_router.sim.report import write_results
from tokenspeed_router.sim.runner import ProgressBar


def _rec(i: int, *, ttft: float, worker: str, prompt: int = 1000, cached: int | None = 0,
         error: str | None = None) -> RequestRecord:
    r = RequestRecord(index=i, request_id=f"r{i}", scheduled_s=float(i), input_length=prompt,
                      max_tokens=4)
    r.sent_s = float(i)
    r.ttft_s = ttft
    r.e2e_s = ttft + 0.3
    r.itl_s = [0.1, 0.1, 0.1]
    r.output_chunks = 4
    r.prompt_tokens = prompt
    r.cached_tokens = cached
    r.completion_tokens = 4
    r.worker = worker
    r.error = error
    return r


def test_summary_metrics() -> None:
    recs = [_rec(i, ttft=0.01 * (i + 1), worker="w0" if i < 6 else "w1", cached=500) for i in range(10)]
    recs.append(_rec(10, ttft=9.0, worker="w1", error="HTTP 503: overloaded"))
    recs.append(_rec(11, ttft=0.5, worker="w1", cached=None))  # no usage details reported
    m = summarize(recs, wall_s=2.0)
    assert (m["requests"], m["ok"], m["errors"]) == (12, 11, 1)
    assert m["error_kinds"] == {"HTTP 503": 1}
    assert m["ttft_p50_s"] == pytest.approx(0.06)
    assert m["ttft_p99_s"] == pytest.approx(0.5)  # the failed 9 s request is not a latency
    assert m["e2e_p99_s"] == pytest.approx(0.8)
    assert m["itl_p50_s"] == pytest.approx(0.1)
    # Engine-reported hit ratio over requests that reported usage: 10 x 500 / 10 x 1000.
    assert m["hit_ratio"] == pytest.approx(0.5) and m["usage_reported"] == 10
    assert m["requests_per_worker"] == {"w0": 6, "w1": 5}
    assert m["spread_max_over_mean"] == pytest.approx(6 / 5.5)
    starved = summarize(recs, wall_s=2.0, workers=["w0", "w1", "w2"])
    assert starved["requests_per_worker"] == {"w0": 6, "w1": 5, "w2": 0}
    assert starved["spread_max_over_mean"] == pytest.approx(6 / (11 / 3))
    table = format_runs_table({"kv_aware": m})
    assert "kv_aware" in table and "50.0%" in table


def test_router_added_latency_is_client_minus_engine_ttft() -> None:
    recs = [_rec(i, ttft=0.1 + 0.001 * i, worker="w0") for i in range(100)]
    for r in recs[:99]:
        r.engine_ttft_s = 0.1  # the engine's own share; the last one did not report it
    m = summarize(recs, wall_s=1.0)
    assert m["router_added_reported"] == 99
    assert m["router_added_p50_s"] == pytest.approx(0.049)
    assert m["router_added_p99_s"] == pytest.approx(percentile([0.001 * i for i in range(99)], 99))
    assert m["router_added_max_s"] == pytest.approx(0.098)
    assert recs[99].router_added_s is None and recs[0].as_dict()["router_added_s"] == pytest.approx(0.0)
    assert f"{m['router_added_p99_s']:.3f}" in format_runs_table({"gw": m})


def test_summary_without_usage_or_successes() -> None:
    m = summarize([_rec(0, ttft=1.0, worker="w", error="timeout: ReadTimeout")], wall_s=1.0)
    assert m["ok"] == 0 and m["hit_ratio"] is None and m["ttft_p50_s"] is None
    assert "-" in format_runs_table({"x": m})


def test_results_and_plot_files(tmp_path) -> None:
    recs = [_rec(i, ttft=0.1, worker=f"w{i % 2}") for i in range(4)]
    m = summarize(recs, wall_s=1.0)
    path = write_results({"summary": m, "requests": [r.as_dict() for r in recs]}, tmp_path)
    doc = json.loads(path.read_text())
    assert doc["summary"]["requests_per_worker"] == {"w0": 2, "w1": 2}
    assert doc["requests"][0]["itl_mean_s"] == pytest.approx(0.1)
    (png,) = write_plots({"run": recs}, tmp_path, title="t", workers=["w0", "w1", "w2"], name="x.png")
    assert png == tmp_path / "x.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_writes_lines_when_not_a_terminal() -> None:
    now = [0.0]
    out = io.StringIO()
    bar = ProgressBar(out, clock=lambda: now[0], log_every_s=5.0)
    bar.start("loadgen")
    for i in range(1, 11):
        now[0] = float(i)
        bar(i, 10, f"errors {0}")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # first call, then every 5 s, then the final one
    assert len(lines) == 3 and lines[-1].startswith("loadgen") and "10/10" in lines[-1]
    tty = io.StringIO()
    ProgressBar(tty, tty=True)(1, 2)
    assert tty.getvalue().startswith("\r")


def test_stream_reader_counts_plain_tokens_and_decodes_the_rest() -> None:
    import asyncio

    from tokenspeed_router.loadgen.client import _StreamReader

    loop = asyncio.new_event_loop()
    try:
        rec = RequestRecord(index=0, request_id="r", scheduled_s=0.0, input_length=10, max_tokens=3)
        reader = _StreamReader(rec, loop, loop.time())
        for line in (b'data: {"system_fingerprint":"e1","choices":[{"text":"a"}]}', b"",
                     b'data: {"choices":[{"text":"b"}]}', b'data: {"choices":[{"text":"c","finish_reason":"length"}]}',
                     b'data: {"choices":[],"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":8}},'
                     b'"engine_timing":{"ttft_s":0.5,"modelled_ttft_s":2.0}}', b"data: [DONE]"):
            reader.feed_line(line)
        assert rec.worker == "e1" and rec.output_chunks == 3 and len(rec.itl_s) == 2
        assert (rec.cached_tokens, rec.engine_ttft_s, rec.engine_modelled_ttft_s) == (8, 0.5, 2.0)
        assert reader.done and rec.error is None
        reader.feed_line(b'data: {"choices":[{"text":"x"}],"error":{"message":"boom"}}')
        assert rec.error == "stream error: boom"
    finally:
        loop.close()
