"""Helpers shared by the test suite (no sleeps: poll with a deadline).

This package holds everything tests share: here the basics (``wait_until``,
the repository and data paths, environment helpers); in submodules the
harnesses of one part each (``support.server``: a ``serve`` subprocess and
batch builders; ``support.gateway``, ``support.engine_sim``, ``support.relay``,
``support.router``, ``support.state_harness``, ``support.cache_reference``;
``support.server_publisher``, a publisher process driven from stdin). Tests
import it as ``support`` because pytest puts ``tests/`` (the folder of the
root ``conftest.py``) on ``sys.path``; nothing else edits the path.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]


DATA_DIR = REPO_ROOT / "tests" / "data"


def data_dir() -> Path:
    """The test data folder: ``tests/data`` in the checkout, or ``$TOKENSPEED_SHARED``.

    The override lets the same tests run against another copy with the same
    layout (``captures/``, ``traces/mooncake/``), e.g. the whole Mooncake traces.
    """
    env = os.environ.get("TOKENSPEED_SHARED")
    path = Path(env) if env else DATA_DIR
    if not (path / "captures").is_dir():
        raise RuntimeError(
            f"test data not found at {path}: expected {path / 'captures'} "
            "(unset TOKENSPEED_SHARED to use the copy in tests/data)"
        )
    return path


def captures_dir() -> Path:
    return data_dir() / "captures"


def traces_dir() -> Path:
    return data_dir() / "traces"


_BLOCKER = """
import sys

_BLOCKED = {blocked!r}


class _Blocked:
    \"\"\"Make importing a blocked package fail as it does when it is not installed.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Blocked())
"""


def without_packages_env(folder: Path, *packages: str) -> dict[str, str]:
    """Environment for a subprocess whose interpreter cannot import ``packages``.

    A ``sitecustomize`` first on ``PYTHONPATH`` installs an import hook that
    refuses them exactly as a missing package would (the real interpreter and
    venv otherwise), so "not installed" paths run for real without a second venv.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_BLOCKER.format(blocked=sorted(packages)))
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


def wait_until(
    predicate: Callable[[], T], timeout_s: float = 10.0, interval_s: float = 0.002, what: str = ""
) -> T:
    """Poll ``predicate`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        pause.wait(interval_s)
