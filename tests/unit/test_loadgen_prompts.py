"""loadgen: trace requests -> request bodies (prompt expansion, formats, limits)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.loadgen import PromptBuilder, PromptConfig, completions_url, scale_prompts
from tokenspeed_router.sim.traces import TraceWindow, parse_mooncake


def _line(ts: int, n: int, ids: list[int], out: int = 10) -> str:
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids})


def _prompt(body: bytes) -> list[int]:
    doc = json.loads(body)
    prompt = doc["prompt"]
    return [int(w) for w in prompt.split()] if isinstance(prompt, str) else prompt


def test_shared_hash_ids_are_shared_token_prefixes() -> None:
    reqs = parse_mooncake([_line(0, 1024, [0, 1]), _line(1, 1300, [0, 1, 2]), _line(2, 700, [0, 3])])
    builder = PromptBuilder(PromptConfig(model="m"))
    a, b, c = (_prompt(builder.encode(r)) for r in reqs)
    assert (len(a), len(b), len(c)) == (1024, 1300, 700)
    assert b[:1024] == a  # hash ids 0, 1 shared: a real 1024-token prefix
    assert c[:512] == a[:512]  # hash id 0 shared
    assert c[512:700] != a[512:700]  # 3 vs 1: different tokens
    # A fresh builder (another process, another run) expands the same ids identically.
    assert _prompt(PromptBuilder(PromptConfig(model="m")).encode(reqs[1])) == b


def test_last_block_is_a_truncated_full_block() -> None:
    full, partial = parse_mooncake([_line(0, 1024, [5, 6]), _line(1, 600, [5, 6])])
    builder = PromptBuilder(PromptConfig(model="m"))
    long_ids = _prompt(builder.encode(full))
    short_ids = _prompt(builder.encode(partial))
    assert len(short_ids) == 600
    assert short_ids == long_ids[:600]


def test_tokens_per_hash_id_other_than_512() -> None:
    reqs = parse_mooncake([_line(0, 40, [1, 2, 3]), _line(1, 32, [1, 2])], block_tokens=16)
    builder = PromptBuilder(PromptConfig(model="m"))
    a, b = (builder.token_ids(r) for r in reqs)
    assert a.shape == (40,) and np.array_equal(a[:32], b)
    with pytest.raises(ConfigError, match="block_tokens=16"):
        parse_mooncake([_line(0, 40, [1, 2])], block_tokens=16)


def test_text_format_writes_the_same_ids_as_digit_words() -> None:
    (req,) = parse_mooncake([_line(0, 900, [4, 9], out=7)])
    tokens = PromptBuilder(PromptConfig(model="m")).encode(req)
    text = PromptBuilder(PromptConfig(model="m", prompt_format="text")).encode(req)
    doc = json.loads(text)
    assert isinstance(doc["prompt"], str)
    assert all(w.isdigit() for w in doc["prompt"].split())
    assert _prompt(text) == _prompt(tokens)


def test_body_fields_and_output_cap() -> None:
    reqs = parse_mooncake([_line(0, 100, [1], out=500), _line(0, 100, [1], out=0)])
    doc = json.loads(PromptBuilder(PromptConfig(model="llama")).encode(reqs[0]))
    assert doc["model"] == "llama" and doc["stream"] is True
    assert doc["stream_options"] == {"include_usage": True}
    assert doc["max_tokens"] == 500 and doc["ignore_eos"] is True
    capped = PromptBuilder(PromptConfig(model="m", max_output_tokens=64, ignore_eos=False))
    doc = json.loads(capped.encode(reqs[0]))
    assert doc["max_tokens"] == 64 and "ignore_eos" not in doc
    assert capped.max_tokens(reqs[1]) == 1  # a zero-length answer still asks for one token


def test_token_key_separates_runs() -> None:
    (req,) = parse_mooncake([_line(0, 512, [1])])
    a = PromptBuilder(PromptConfig(model="m", token_key=1)).token_ids(req)
    b = PromptBuilder(PromptConfig(model="m", token_key=2)).token_ids(req)
    assert not np.array_equal(a, b)


def test_time_scale_divides_timestamps() -> None:
    lines = [_line(t * 1000, 512, [t]) for t in range(6)]
    reqs = parse_mooncake(lines, TraceWindow(rate_scale=4.0, max_requests=4))
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 0.5, 0.75]


def test_bad_config_is_refused() -> None:
    with pytest.raises(ConfigError):
        PromptConfig(model="")
    with pytest.raises(ConfigError):
        PromptConfig(model="m", max_output_tokens=0)
    with pytest.raises(ValueError):
        PromptConfig(model="m", prompt_format="bytes")


def test_completions_url_accepts_base_and_full_paths() -> None:
    for target in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/completions"):
        assert completions_url(target) == "http://h:1/v1/completions"


def test_scale_prompts_keeps_sharing_with_smaller_blocks() -> None:
    reqs = parse_mooncake([_line(0, 1024, [0, 1]), _line(1, 1100, [0, 1, 2]), _line(2, 513, [0, 3])])
    small = scale_prompts(reqs, 0.125)
    assert [r.block_tokens for r in small] == [64, 64, 64]
    assert [r.input_length for r in small] == [128, 128 + 10, 64 + 1]  # 76/8 -> 10, 1/8 -> 1
    builder = PromptBuilder(PromptConfig(model="m"))
    a, b, c = (builder.token_ids(r) for r in small)
    assert np.array_equal(b[:128], a) and np.array_equal(c[:64], a[:64])
    assert scale_prompts(reqs, 1.0) == reqs
    with pytest.raises(ConfigError, match="whole number"):
        scale_prompts(reqs, 0.3)
    with pytest.raises(ConfigError):
        scale_prompts(reqs, 0.0)


def test_loadgen_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import tokenspeed_router.loadgen, tokenspeed_router.loadgen.cli_loadgen\n"
        "import tokenspeed_router.loadgen.cli_demo, tokenspeed_router.loadgen.fleet\n"
        "assert 'torch' not in sys.modules, 'torch imported by loadgen'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
