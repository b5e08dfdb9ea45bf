"""README's Figures table is what the committed results files say (benchmarks/render_figures.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

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
