"""Helpers shared by the test suite (no sleeps: poll with a deadline)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """The project's shared/ folder (beside the checkout), or $TOKENSPEED_SHARED."""
    env = os.environ.get("TOKENSPEED_SHARED")
    path = Path(env) if env else REPO_ROOT.parent / "shared"
    if not (path / "captures").is_dir():
        raise RuntimeError(
            f"shared/ not found at {path}: golden tests need ../shared/captures "
            "(set TOKENSPEED_SHARED to its location)"
        )
    return path


def captures_dir() -> Path:
    return shared_dir() / "captures"


def traces_dir() -> Path:
    return shared_dir() / "traces"


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


def free_tcp_port() -> int:
    """An OS-chosen free port on loopback (for servers that need a port number up front)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
