"""``tokenspeed-router engine-sim`` as a real subprocess, for tests (not a test module).

The engine binds OS-chosen ports (``--port 0``, ``tcp://127.0.0.1:0``) and
prints them as JSON on its first stdout line, which :meth:`EngineSim.start`
reads with a deadline; nothing guesses ports. Every wait polls with a deadline.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from support import REPO_ROOT
from tokenspeed_router.loadgen.fleet import stop_process


@dataclass
class EngineSim:
    workdir: Path
    args: list[str] = field(default_factory=list)
    replay: bool = True
    proc: subprocess.Popen[bytes] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return str(self.info["url"])

    @property
    def name(self) -> str:
        return str(self.info["name"])

    @property
    def events(self) -> str:
        return str(self.info["events"][0])

    @property
    def replay_endpoint(self) -> str:
        return str(self.info["replay"][0])

    def start(self, timeout_s: float = 60.0) -> EngineSim:
        cmd = [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "INFO", "engine-sim",
               "--port", "0", "--events", "tcp://127.0.0.1:0", *self.args]
        if self.replay:
            cmd += ["--replay", "tcp://127.0.0.1:0"]
        # a unique name even when several engines start at once (threads)
        self.stderr_path = self.workdir / f"engine-sim-{os.getpid()}-{id(self):x}.stderr"
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=self._stderr,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.proc.stdout is not None
        line = b""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"engine-sim did not start: {self.stderr()}")
                if sel.select(min(left, 0.5)):
                    chunk = os.read(self.proc.stdout.fileno(), 4096)
                    if not chunk:
                        raise AssertionError(f"engine-sim closed stdout: {self.stderr()}")
                    line += chunk
        self.info = json.loads(line.split(b"\n")[0])
        self.http = httpx.Client(base_url=self.url, timeout=30.0)
        return self

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def post(self, path: str, body: Any, status: int = 200, **kwargs: Any) -> Any:
        resp = self.http.post(path, json=body, **kwargs)
        assert resp.status_code == status, (resp.status_code, resp.text)
        return resp.json()

    def complete(self, prompt: Any, max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
        return dict(self.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **extra}))

    def metrics(self) -> dict[str, float]:
        """Sample values by metric name (labels dropped; one rank unless told otherwise)."""
        out: dict[str, float] = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
        return out

    def stream(self, path: str, body: Any) -> Iterator[dict[str, Any] | str]:
        """SSE chunks as they arrive: dicts, then the string ``[DONE]``."""
        with self.http.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200, resp.read()
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert resp.headers["x-engine-id"] == self.name
            for line in resp.iter_lines():
                if not line:
                    continue
                assert line.startswith("data: "), line
                data = line[len("data: "):]
                yield data if data == "[DONE]" else json.loads(data)

    def stop(self, timeout_s: float = 20.0) -> int:
        assert self.proc is not None
        code = stop_process(self.proc, timeout_s)
        if hasattr(self, "http"):
            self.http.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
        return code

    def __enter__(self) -> EngineSim:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.stop()


def words(start: int, count: int) -> str:
    """Text whose tokens are exactly ``range(start, start + count)`` (numeric words)."""
    return " ".join(str(i) for i in range(start, start + count))
