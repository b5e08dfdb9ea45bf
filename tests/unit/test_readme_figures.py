"""README's Figures table is what the committed results files say (benchmarks/render_figures.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_figures", ROOT / "benchmarks" / "render_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["render_figures"] = module
    spec.loader.exec_module(module)
    return module


def test_readme_figures_are_generated_from_the_results_files() -> None:
    render = _renderer()
    assert render.main(["--check"]) == 0, "README.md's Figures table is stale: run benchmarks/render_figures.py"


def test_every_figure_reads_a_committed_results_file() -> None:
    render = _renderer()
    for figure in render.FIGURES:
        path = ROOT / "docs" / "results" / figure.file
        assert path.is_file(), f"{figure.file}: no such results file"
        json.loads(path.read_text())


def test_the_check_fails_on_a_table_edited_by_hand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    render = _renderer()
    readme = tmp_path / "README.md"
    table = render.render()
    readme.write_text("intro\n" + table.replace(" / ", " / 9", 1) + "\nend\n")
    monkeypatch.setattr(render, "README", readme)
    assert render.main(["--check"]) == 1
    assert render.main([]) == 0 and render.main(["--check"]) == 0
    assert readme.read_text() == "intro\n" + table + "\nend\n"


def _matrix() -> ModuleType:
    spec = importlib.util.spec_from_file_location("routing_matrix", ROOT / "benchmarks" / "routing_matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["routing_matrix"] = module
    spec.loader.exec_module(module)
    return module


def _witnessed_results(rm: ModuleType) -> dict[str, Any]:
    """A test-set results file in the issue-31 format, from hand-made rows through the matrix's own verdicts."""
    def row(p50: float, p99: float, hit: float) -> dict[str, Any]:
        return {"ttft_p50_s": p50, "ttft_p99_s": p99, "hit_ratio": hit, "ideal_load": 0.35}

    def cell(witness_p99: float, vllm_p99: float, ours_p50: float = 1.0) -> dict[str, dict[str, Any]]:
        return {"kv_aware": row(ours_p50, 2.0, 0.8), "approx": row(1.0, 2.5, 0.8),
                "sglang_cache_aware": row(1.2, 3.0, 0.8), "vllm_kv_aware": row(1.0, vllm_p99, 0.8),
                "round_robin": row(1.0, witness_p99, 0.5)}

    cells = {("chat", 1, 1.0, "pressure"): cell(8.0, 1.6), ("chat", 1, 4.0, "pressure"): cell(2.0, 1.6),
             ("docqa", 1, 1.0, "pressure"): cell(6.0, 4.0, ours_p50=1.3),
             ("mooncake-synthetic", 0, 1.0, "pressure"): cell(9.0, 4.0)}
    verdicts = [{"shape": k[0], "seed": k[1], "speed": k[2], "scenario": k[3], **rm.cell_verdict(rows)}
                for k, rows in sorted(cells.items())]
    return {"set": "test", "ideal_load": rm.IDEAL_LOAD, "witness": rm.WITNESS, "vllm": rm.VLLM,
            "cells": [{"shape": k[0], "seed": k[1], "speed": k[2], "scenario": k[3], "policy": p, **r}
                      for k, rows in cells.items() for p, r in rows.items()],
            "verdicts": verdicts, "summary": rm.tallies(verdicts)}


def test_a_witnessed_matrix_renders_the_tallies_with_vllm_and_the_cells_where_queues_formed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    render = _renderer()
    committed = render.render()
    results = tmp_path / "results"
    results.mkdir()
    for path in (ROOT / "docs" / "results").glob("*.json"):
        (results / path.name).write_text(path.read_text())
    (results / "routing-matrix-test.json").write_text(json.dumps(_witnessed_results(_matrix())))
    monkeypatch.setattr(render, "RESULTS", results)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:3] for line in render.render().splitlines()
            if "routing-matrix-test.json" in line}
    assert not any(k.endswith("the best of `approx` and the validated peer emulation") for k in rows), \
        "the rows of a matrix without the witness are gone"
    queued = next(v for k, v in rows.items() if "cells where queues formed" in k)
    assert queued[0] == "3 / 4" and "load 0.35" in queued[1]
    p99 = next(v for k, v in rows.items() if "TTFT p99 ≤ the best of `approx`, the validated peer" in k)
    assert p99 == ["2 / 3", "3 / 3 against `approx` and the validated peer alone"]
    p50 = next(v for k, v in rows.items() if "TTFT p50 ≤ 1.05x" in k)
    assert p50 == ["2 / 3", "2 / 3 against `approx` and the validated peer alone"]
    docqa = next(v for k, v in rows.items() if "`docqa` cells" in k)
    assert docqa[0] == "0 / 1"
    # The rows of the other results files are the committed ones.
    others = [line for line in committed.splitlines() if "routing-matrix" not in line]
    assert all(line in render.render() for line in others)
