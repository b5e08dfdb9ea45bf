"""A gateway in front of real engine-sim subprocesses, for the gateway tests (not a test module).

Every process is real (engine-sims publishing KV events on loopback, one
``tokenspeed-router serve`` subscribed to them and proxying to their HTTP
ports); every wait polls with a deadline.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from support import wait_until
from support.engine_sim import EngineSim
from support.server import ServeProcess


@dataclass
class Gateway:
    """N engine-sims (``engine_args[i]`` each) behind one ``serve``; workers named w0, w1, ..."""

    workdir: Path
    engine_args: Sequence[Sequence[str]]
    roles: Sequence[str] | None = None
    serve_args: Sequence[str] = ()
    #: appended to every ``--worker`` spec (e.g. ``dp_ranks=2``)
    spec_extra: str = ""
    engines: list[EngineSim] = field(default_factory=list)

    def __enter__(self) -> Gateway:
        self._stack = ExitStack()
        try:
            for args in self.engine_args:
                explicit_replay = "--replay" in args  # engine-sim binds port + rank itself
                self.engines.append(self._start(EngineSim(self.workdir, list(args), replay=not explicit_replay)))
            argv: list[str] = []
            for i, engine in enumerate(self.engines):
                spec = f"name=w{i},url={engine.url},events={engine.events},replay={engine.replay_endpoint}"
                if self.roles is not None:
                    spec += f",role={self.roles[i]}"
                if self.spec_extra:
                    spec += f",{self.spec_extra}"
                argv += ["--worker", spec]
            self.serve = self._stack.enter_context(
                ServeProcess([*argv, *self.serve_args], self.workdir).start(timeout_s=60))
            self.client = self._stack.enter_context(httpx.Client(base_url=self.serve.url, timeout=30.0))
            wait_until(lambda: all(w["connected"] for w in self.workers().values()), 30, interval_s=0.05,
                       what="the router to connect to every engine's events")
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _start(self, engine: EngineSim) -> EngineSim:
        try:
            engine.start()
        except BaseException:
            if engine.proc is not None:
                engine.stop()  # closes its pipes and log file
            raise
        return self._stack.enter_context(engine)

    def restart_engine(self, i: int) -> EngineSim:
        """Stop engine ``i`` and start it again with the same arguments (give it fixed ports)."""
        old = self.engines[i]
        old.stop()
        self.engines[i] = self._start(EngineSim(self.workdir, list(old.args), replay=old.replay))
        return self.engines[i]

    def engine_of(self, worker: str) -> EngineSim:
        """The engine behind ``w3`` (or a DP rank of it, ``w3/dp1``)."""
        return self.engines[int(worker.split("/")[0][1:])]

    def worker_of(self, fingerprint: str) -> str:
        return next(f"w{i}" for i, e in enumerate(self.engines) if e.name == fingerprint)

    def workers(self) -> dict[str, Any]:
        return dict(self.serve.get("/workers"))

    def post(self, path: str, body: Any) -> httpx.Response:
        return self.client.post(path, json=body)

    def complete(self, prompt: Any, **extra: Any) -> tuple[str, dict[str, Any]]:
        """(worker header, answer) of a non-stream completion that must succeed."""
        resp = self.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, **extra})
        assert resp.status_code == 200, (resp.status_code, resp.text, self.serve.stderr())
        return resp.headers["x-tokenspeed-worker"], resp.json()

    def held_blocks(self, token_ids: list[int]) -> dict[str, int]:
        return {w: n for w, n in self.serve.post("/match", {"token_ids": token_ids})["scores"].items() if n}

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the router's samples named ``name`` whose labels include ``labels``."""
        total = 0.0
        for line in self.client.get("/metrics").text.splitlines():
            if not line.startswith(name):
                continue
            head, value = line.rsplit(" ", 1)
            metric, _, rest = head.partition("{")
            if metric != name:
                continue
            have = dict(p.split("=", 1) for p in rest.rstrip("}").split(",") if "=" in p)
            if all(have.get(k) == f'"{v}"' for k, v in labels.items()):
                total += float(value)
        return total


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    """Decoded ``data:`` payloads of an SSE line stream (``[DONE]`` as the string)."""
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)


@contextmanager
def open_with_fixed_ports(make: Callable[[], Gateway], attempts: int = 3) -> Iterator[Gateway]:
    """``with make() as gw``, again with new ports when one was taken between choosing and binding it.

    Tests that must give engines explicit ports (DP ranks on port + rank, an
    engine restarted on its old ports) choose free ports first; on a busy
    machine another process can take one before the engine binds it.
    """
    for attempt in range(attempts):
        gateway = make()
        try:
            gateway.__enter__()
        except AssertionError as err:
            if "Address already in use" not in str(err) or attempt == attempts - 1:
                raise
            continue
        try:
            yield gateway
        finally:
            gateway.__exit__(None, None, None)
        return
