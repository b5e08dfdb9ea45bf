"""The workload shapes (``trace``): seeded, exact, prefix structure as promised, grounded defaults."""

from __future__ import annotations

import io
import itertools
import math
import statistics
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tokenspeed_router import cli
from tokenspeed_router.errors import ConfigError
from tokenspeed_router.sim.cli_trace import DEFAULT_CAPACITY_TOKENS_PER_S
from tokenspeed_router.sim.shapes import (
    SHAPES,
    GeneratedTrace,
    WorkloadConfig,
    generate_at_load,
    generate_trace,
    generate_workload,
    make_shape,
    shape_parameters,
)
from tokenspeed_router.sim.shapes._core import IdMint, Prompt, ZipfSampler
from tokenspeed_router.sim.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    ideal_load,
    load_mooncake,
    trace_summary,
    write_mooncake,
)

REPO = Path(__file__).resolve().parents[2]
BLOCK = MOONCAKE_BLOCK_TOKENS


def _gen(name: str, requests: int = 400, seed: int = 0, **params: object) -> GeneratedTrace:
    return generate_trace(make_shape(name, {k: str(v) for k, v in params.items()}), seed=seed, requests=requests)


def _by_session(trace: GeneratedTrace) -> dict[int, list[TraceRequest]]:
    out: dict[int, list[TraceRequest]] = defaultdict(list)
    for r, s in zip(trace.requests, trace.sessions, strict=True):
        out[s].append(r)
    return out


def _full(r: TraceRequest) -> tuple[int, ...]:
    """The ids of the request's full blocks (a follow-up keeps exactly these)."""
    return r.hash_ids[: r.input_length // r.block_tokens]


def _text(trace: GeneratedTrace) -> str:
    buf = io.StringIO()
    write_mooncake(trace.requests, buf)
    return buf.getvalue()


@pytest.mark.parametrize("name", list(SHAPES))
def test_same_seed_same_bytes_other_seed_other_trace(name: str) -> None:
    a, b = _gen(name, 300, seed=7), _gen(name, 300, seed=7)
    assert _text(a) == _text(b)
    assert a.sessions == b.sessions
    assert _text(_gen(name, 300, seed=8)) != _text(a)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("n", [1, 7, 250])
def test_exactly_the_requests_asked_for(name: str, n: int) -> None:
    trace = _gen(name, n)
    assert len(trace.requests) == n == len(trace.sessions)
    assert trace.requests[0].arrival_s == 0.0
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)


@pytest.mark.parametrize("name", list(SHAPES))
def test_written_file_loads_back_equal(name: str, tmp_path: Path) -> None:
    trace = _gen(name, 200)
    path = tmp_path / f"{name}.jsonl"
    assert write_mooncake(trace.requests, path) == 200
    loaded = load_mooncake(path)

    def key(r: TraceRequest) -> tuple[float, int, int, tuple[int, ...]]:
        return r.arrival_s, r.input_length, r.output_length, r.hash_ids

    assert [key(r) for r in loaded] == [key(r) for r in trace.requests]


@pytest.mark.parametrize("name", list(SHAPES))
def test_ids_are_prefix_hashes_of_512_token_blocks(name: str) -> None:
    """An id at position i always has the same ids before it, and one id covers 512 tokens."""
    prefix_of: dict[int, tuple[int, ...]] = {}
    for r in _gen(name, 400).requests:
        assert r.block_tokens == BLOCK
        assert len(r.hash_ids) == math.ceil(r.input_length / BLOCK)
        for i, h in enumerate(r.hash_ids):
            assert prefix_of.setdefault(h, r.hash_ids[:i]) == r.hash_ids[:i]


def test_agentic_sessions_grow_on_a_few_system_prompts_with_fast_turn_backs() -> None:
    shape = make_shape("agentic")
    trace = generate_trace(shape, seed=0, requests=1500)
    sessions = _by_session(trace)
    assert trace.num_sessions < 1500 / 2  # sessions of several calls
    system_blocks = 6000 // BLOCK  # every system prompt has at least these full blocks
    heads = {r.hash_ids[:system_blocks] for r in trace.requests}
    assert len(heads) <= 4  # the few system prompts ...
    assert max(Counter(r.hash_ids[:system_blocks] for r in trace.requests).values()) > 1500 / 4  # ... one hot
    gaps = []
    for calls in sessions.values():
        for prev, nxt in itertools.pairwise(calls):
            assert nxt.hash_ids[: len(_full(prev))] == _full(prev)  # extends the previous call
            assert nxt.input_length > prev.input_length + prev.output_length
            gap = nxt.arrival_s - prev.arrival_s
            assert gap >= prev.output_length * 0.02 - 1e-3  # after the answer is done
            gaps.append(gap)
    assert statistics.median(gaps) < 10.0  # tool turn-backs, not think times
    # Sessions interleave: some call of another session arrives between two calls of one.
    order = {r.request_id: i for i, r in enumerate(trace.requests)}
    assert any(order[c[1].request_id] - order[c[0].request_id] > 1 for c in sessions.values() if len(c) > 1)


def test_chat_turns_extend_with_think_times_and_share_one_block() -> None:
    trace = _gen("chat", 1500)
    assert len({r.hash_ids[0] for r in trace.requests}) == 1  # the shared system prompt
    gaps = []
    for turns in _by_session(trace).values():
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.hash_ids[: len(_full(prev))] == _full(prev)
            assert nxt.input_length > prev.input_length + prev.output_length
            gaps.append(nxt.arrival_s - prev.arrival_s)
    assert len(gaps) > 100 and statistics.median(gaps) > 30.0  # people think


def test_cold_never_repeats_an_id() -> None:
    ids = [h for r in _gen("cold", 800).requests for h in r.hash_ids]
    assert len(ids) == len(set(ids))
    assert trace_summary(_gen("cold", 800).requests)["ideal_hit_ratio"] == 0.0


def test_docqa_every_request_is_one_of_a_few_documents_plus_its_own_question() -> None:
    shape = make_shape("docqa")
    trace = generate_trace(shape, seed=0, requests=600)
    doc_blocks = (200 + 24000) // BLOCK  # instructions + the shortest document, full blocks
    docs = Counter(r.hash_ids[:doc_blocks] for r in trace.requests)
    assert len(docs) == 24
    assert all(r.input_length >= 24200 for r in trace.requests)
    assert len({r.hash_ids[-1] for r in trace.requests}) == 600  # every question is unique
    assert trace_summary(trace.requests)["ideal_hit_ratio"] > 0.9


def test_rag_zipf_matches_ragcache_skew_and_its_ranking_drifts() -> None:
    # RAGCache: 3 % of the documents receive 60 % of the requests.
    assert ZipfSampler(2000, 1.03).top_share(0.03) == pytest.approx(0.60, abs=0.01)
    still = _gen("rag", 3000, drift_fraction=0)
    counts = Counter(r.hash_ids[1] for r in still.requests)  # block 1: inside the document
    top = sum(n for _, n in counts.most_common(60))
    assert 0.5 < top / 3000 < 0.7

    def hot(reqs: list[TraceRequest]) -> set[int]:
        return {h for h, _ in Counter(r.hash_ids[1] for r in reqs).most_common(10)}

    drifting = _gen("rag", 3000, drift_fraction=0.5, drift_interval_s=30)
    assert len(hot(still.requests[:600]) & hot(still.requests[-600:])) >= 6
    assert len(hot(drifting.requests[:600]) & hot(drifting.requests[-600:])) <= 3


def test_multitenant_tenants_own_prompts_and_bursts() -> None:
    trace = _gen("multitenant", 3000)
    firsts = Counter(r.hash_ids[0] for r in trace.requests)
    assert len(firsts) == 8
    shares = sorted(firsts.values(), reverse=True)
    assert shares[0] > 2 * shares[-1]  # Zipf-skewed rates

    def dispersion(reqs: list[TraceRequest]) -> float:
        """Variance over mean of the arrivals per 5 s: 1 for Poisson, more for bursts."""
        bins = Counter(int(r.arrival_s // 5) for r in reqs)
        counts = [bins.get(i, 0) for i in range(int(reqs[-1].arrival_s // 5) + 1)]
        return statistics.pvariance(counts) / statistics.fmean(counts)

    poisson = _gen("multitenant", 3000, burst_off_s_mean=0)
    assert dispersion(poisson.requests) < 1.5
    assert dispersion(trace.requests) > 3.0


def test_defaults_land_on_their_sources() -> None:
    """The grounded figures the docstrings quote (docs/workloads.md has the table)."""
    agentic = trace_summary(_gen("agentic", 3000).requests)
    assert agentic["input_mean"] == pytest.approx(8596, rel=0.10)  # Mooncake tool&agent mean input
    assert agentic["output_mean"] == pytest.approx(182, rel=0.10)  # ... and mean output
    assert agentic["req_per_s"] == pytest.approx(23608 / 3600, rel=0.15)  # ... in about an hour
    # The whole Mooncake conversation trace: 12,031 requests in 3,537 s, ideal hit 37.4 %,
    # 8,056 sessions (benchmarks/trace_sessions.py).
    chat = _gen("chat", 12031)
    stats = trace_summary(chat.requests)
    assert stats["ideal_hit_ratio"] == pytest.approx(0.374, abs=0.03)
    assert 12031 / chat.num_sessions == pytest.approx(1.49, abs=0.2)
    assert stats["req_per_s"] == pytest.approx(3.40, rel=0.1)
    cold = trace_summary(_gen("cold", 3000).requests)
    assert cold["input_mean"] == pytest.approx(12035, rel=0.15)  # Mooncake conversation mean input
    assert cold["req_per_s"] == pytest.approx(3.40, rel=0.1)


def test_mixed_is_the_generate_workload_generator_at_512_tokens() -> None:
    trace = _gen("mixed", 300, seed=5)
    legacy = generate_workload(WorkloadConfig(num_requests=300, seed=5, block_tokens=BLOCK))
    assert [(r.input_length, r.hash_ids) for r in trace.requests] == [(r.input_length, r.hash_ids) for r in legacy]


def test_prompt_growth_keeps_full_blocks_and_reminted_the_partial_one() -> None:
    mint = IdMint()
    a = Prompt().extended(1100, BLOCK, mint)  # 2 full blocks + 76 tokens
    b = a.extended(10, BLOCK, mint)
    assert a.ids == (1, 2, 3) and b.ids[:2] == (1, 2) and b.ids[2] != 3 and b.length == 1110
    assert a.extended(0, BLOCK, mint) is a


def test_bad_shape_parameters_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="unknown shape 'nope'; choose from agentic"):
        make_shape("nope")
    with pytest.raises(ConfigError, match="no parameter 'bogus'"):
        make_shape("agentic", {"bogus": "1"})
    with pytest.raises(ConfigError, match="system_prompts expects a finite int"):
        make_shape("agentic", {"system_prompts": "two"})
    with pytest.raises(ConfigError, match="tool_latency_s_mean expects a finite float, got 'inf'"):
        make_shape("agentic", {"tool_latency_s_mean": "inf"})
    with pytest.raises(ConfigError, match="system_prompts must be >= 1"):
        make_shape("agentic", {"system_prompts": "0"})
    with pytest.raises(ConfigError, match="no parameter 'seed'"):
        make_shape("mixed", {"seed": "3"})  # --seed sets it
    with pytest.raises(ConfigError, match="requests must be >= 1"):
        generate_trace(make_shape("cold"), seed=0, requests=0)
    assert make_shape("docqa", rate_per_s=2.5).rate_per_s == 2.5  # type: ignore[attr-defined]


def test_every_shape_and_parameter_is_documented() -> None:
    """docs/workloads.md carries each shape's parameter table exactly as the code has it."""
    page = (REPO / "docs" / "workloads.md").read_text(encoding="utf-8")
    for name, cls in SHAPES.items():
        assert name == cls.NAME and cls.SUMMARY and cls.SOURCES and cls.RATE
        assert name == "mixed" or "Grounding" in (cls.__doc__ or "")
        assert f"| `{name}` |" in page  # a row of the shapes table
        rows = [f"| `{f.name}` | {f.default!r} | {f.metadata['doc']} |" for f in shape_parameters(cls)]
        assert all(f.metadata.get("doc") for f in shape_parameters(cls))
        table = f"#### `{name}`\n\n| parameter | default | meaning |\n|---|---|---|\n" + "\n".join(rows) + "\n"
        assert table in page, f"docs/workloads.md: the parameter table of {name} differs from the code"


def test_trace_list_names_every_shape_and_its_sources(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trace", "--list"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    for name, cls in SHAPES.items():
        assert f"\n{name}: " in "\n" + out
        assert all(" ".join(source.split()) in flat for source in cls.SOURCES)
    assert cli.main(["trace", "--list", "--shape", "rag"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rag: ") and "popularity_s = 1.03" in out and "agentic" not in out


def test_trace_command_writes_the_file_and_rejects_bad_input(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    args = ["trace", "--shape", "agentic", "--seed", "3", "--requests", "50", "--rate", "2",
            "--param", "system_prompts=2"]
    assert cli.main([*args, "--out", str(a)]) == 0
    assert cli.main([*args, "--out", str(b)]) == 0
    assert a.read_bytes() == b.read_bytes()
    assert len(load_mooncake(a)) == 50
    assert "trace agentic seed 3: 50 requests" in capsys.readouterr().err
    assert cli.main([*args, "--out", "-"]) == 0
    assert capsys.readouterr().out == a.read_text()
    assert cli.main(["trace", "--shape", "agentic", "--requests", "5"]) == 2
    assert "trace needs --shape NAME --requests N --out FILE" in capsys.readouterr().err
    assert cli.main(["trace", "--shape", "agentic", "--requests", "5", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert cli.main(["trace", "--shape", "x", "--requests", "5", "--out", str(a)]) == 2
    assert cli.main(["trace", "--shape", "cold", "--requests", "5", "--out", str(a), "--param", "nokey"]) == 2
    assert "--param expects KEY=VALUE" in capsys.readouterr().err
    assert cli.main(["trace", "--shape", "cold", "--requests", "5", "--out", str(a), "--rate", "inf"]) == 2
    assert "--rate must be a finite number > 0, got inf" in capsys.readouterr().err


def test_trace_summary_reports_lengths_and_block_reuse() -> None:
    reqs = [TraceRequest("a", 0.0, 1024, 10, (1, 2)), TraceRequest("b", 1.0, 1100, 30, (1, 2, 3))]
    s = trace_summary(reqs)
    assert s["input_mean"] == 1062 and s["input_p50"] == 1024 and s["input_p99"] == 1100
    assert s["output_mean"] == 20
    assert s["ideal_block_hit_ratio"] == pytest.approx(2 / 5)
    assert s["ideal_hit_ratio"] == pytest.approx(1024 / 2124)


def test_ideal_load_is_the_uncached_tokens_per_second_over_capacity() -> None:
    # 2124 tokens, 1024 of them already seen: 1100 to prefill over a 2 s span
    reqs = [TraceRequest("a", 0.0, 1024, 10, (1, 2)), TraceRequest("b", 2.0, 1100, 30, (1, 2, 3))]
    s = trace_summary(reqs)
    assert s["ideal_prefill_tokens_per_s"] == pytest.approx((2124 - 1024) / 2.0)
    assert s["ideal_prefill_tokens_per_s"] == pytest.approx(s["input_tokens"] * (1 - s["ideal_hit_ratio"]) / 2.0)
    assert ideal_load(reqs, 1100.0) == pytest.approx(0.5)
    assert ideal_load(reqs[:1], 1100.0) == 0.0  # no span
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ConfigError, match="capacity_tokens_per_s must be a finite number > 0"):
            ideal_load(reqs, bad)


@pytest.mark.parametrize(("name", "seed", "load"), [
    ("agentic", 0, 0.35), ("agentic", 1, 0.7), ("chat", 0, 0.35), ("chat", 2, 0.1), ("docqa", 0, 0.35),
    ("docqa", 3, 0.5), ("rag", 1, 0.35), ("cold", 0, 0.35), ("mixed", 0, 0.35),
])
def test_generate_at_load_reaches_the_load_by_the_rate_alone(name: str, seed: int, load: float) -> None:
    shape = make_shape(name)
    trace, found = generate_at_load(shape, seed=seed, requests=1000, load=load, capacity_tokens_per_s=80_000.0)
    assert ideal_load(trace.requests, 80_000.0) == pytest.approx(load, rel=0.02)
    assert len(trace.requests) == 1000
    # only the rate moved, and the trace is that shape's trace at that rate
    assert {f.name: getattr(found, f.name) for f in shape_parameters(shape) if f.name != shape.RATE} == \
        {f.name: getattr(shape, f.name) for f in shape_parameters(shape) if f.name != shape.RATE}
    assert _text(generate_trace(found, seed=seed, requests=1000)) == _text(trace)
    # a capacity twice as large needs about twice the demand: the rate grows
    bigger, _ = generate_at_load(shape, seed=seed, requests=1000, load=load, capacity_tokens_per_s=160_000.0)
    assert ideal_load(bigger.requests, 160_000.0) == pytest.approx(load, rel=0.02)


def test_generate_at_load_rejects_bad_values_and_says_when_it_cannot_get_there() -> None:
    shape = make_shape("agentic")
    for bad in (0.0, -0.1, math.inf, math.nan):
        with pytest.raises(ConfigError, match="load must be a finite number > 0"):
            generate_at_load(shape, seed=0, requests=100, load=bad, capacity_tokens_per_s=80_000.0)
        with pytest.raises(ConfigError, match="capacity_tokens_per_s must be a finite number > 0"):
            generate_at_load(shape, seed=0, requests=100, load=0.35, capacity_tokens_per_s=bad)
    with pytest.raises(ConfigError, match="at least 2 requests"):
        generate_at_load(shape, seed=0, requests=1, load=0.35, capacity_tokens_per_s=80_000.0)
    # within nothing, in two steps: the error names the closest load and every step
    with pytest.raises(ConfigError, match=r"no rate_per_s puts load 0.35 on 80000 tokens/s within 1e-07 % in 2 "
                                          r"steps \(closest 0.35.*0.01/s -> 0.002, .*try another seed"):
        generate_at_load(make_shape("cold", {"rate_per_s": "0.01"}), seed=0, requests=200, load=0.35,
                         capacity_tokens_per_s=80_000.0, max_steps=2, tolerance=1e-9)


def test_trace_command_at_a_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "docqa.jsonl"
    base = ["trace", "--shape", "docqa", "--seed", "2", "--requests", "300", "--out", str(out)]
    assert cli.main([*base, "--load", "0.35"]) == 0
    assert ideal_load(load_mooncake(out), DEFAULT_CAPACITY_TOKENS_PER_S) == pytest.approx(0.35, rel=0.02)
    err = capsys.readouterr().err
    assert "ideal load 0.35" in err and "of 80000 tokens/s" in err and "at rate_per_s " in err
    assert DEFAULT_CAPACITY_TOKENS_PER_S == 8 * 10_000
    assert cli.main([*base, "--load", "0.5", "--capacity-tokens-per-s", "20000"]) == 0
    assert ideal_load(load_mooncake(out), 20_000.0) == pytest.approx(0.5, rel=0.02)
    assert "ideal load 0.5" in capsys.readouterr().err
    assert cli.main([*base, "--load", "0.35", "--rate", "2"]) == 2
    assert "--load sets the arrival rate (rate_per_s) itself; give --rate or --load, not both" in \
        capsys.readouterr().err
    assert cli.main([*base, "--load", "0.35", "--param", "rate_per_s=2"]) == 2
    assert "give --param rate_per_s= or --load, not both" in capsys.readouterr().err
    for bad in ("0", "-1", "inf", "nan"):
        assert cli.main([*base, "--load", bad]) == 2
        assert "--load must be a finite number > 0" in capsys.readouterr().err
        assert cli.main([*base, "--load", "0.35", "--capacity-tokens-per-s", bad]) == 2
        assert "--capacity-tokens-per-s must be a finite number > 0" in capsys.readouterr().err
