"""Child processes for end-to-end runs: engine-sims, ``serve`` gateways, any router.

Used by ``demo``, ``benchmarks/compare_routers.py``, ``benchmarks/peer_parity.py``
and the integration tests, so that all of them start, wait for and stop
processes the same way:

* every process logs to its own file in ``log_dir`` (read it when a run
  looks wrong; the tail is quoted in the error when a process dies early);
* readiness is polled with a deadline, never slept for: an engine-sim prints
  its resolved endpoints as the first stdout line (it binds port 0), a router
  is ready when ``GET /v1/models`` answers with a model;
* :meth:`Fleet.close` terminates everything it started (SIGTERM, then SIGKILL
  after a grace period), in reverse order, whatever happened.

No torch here: engine-sims are separate processes.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.errors import TokenspeedError
from tokenspeed_router.router.router import RouterConfig

__all__ = [
    "EngineHandle",
    "exit_on_sigterm",
    "EngineSimOptions",
    "Fleet",
    "ManagedProcess",
    "PEER_BINARIES",
    "PeerRouter",
    "clock_scaled_router_flags",
    "default_peers_venv",
    "peer_binary",
    "stop_process",
]

logger = logging.getLogger(__name__)


class ManagedProcess:
    """One child process with its output in ``log_path``."""

    def __init__(self, name: str, cmd: Sequence[str], log_path: Path, *,
                 env: dict[str, str] | None = None, capture_first_line: bool = False) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = log_path.open("wb")
        self.first_line: str | None = None
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE if capture_first_line else self._log,
            stderr=self._log, stdin=subprocess.DEVNULL,
            env=env if env is not None else dict(os.environ),
        )

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _died(self) -> TokenspeedError:
        return TokenspeedError(f"{self.name} exited with code {self.proc.returncode} "
                               f"(log {self.log_path}):\n{self.log_tail()}")

    def read_first_line(self, timeout_s: float) -> str:
        """The first stdout line (then the rest of stdout is copied to the log)."""
        assert self.proc.stdout is not None, "started without capture_first_line"
        deadline = time.monotonic() + timeout_s
        buf = b""
        fd = self.proc.stdout.fileno()
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TokenspeedError(f"{self.name}: no startup line within {timeout_s:g} s "
                                      f"(log {self.log_path}):\n{self.log_tail()}")
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.proc.wait(timeout=5)
                    raise self._died()
                buf += chunk
        line, rest = buf.split(b"\n", 1)
        self._log.write(line + b"\n" + rest)
        self._log.flush()
        threading.Thread(target=self._drain, name=f"{self.name}-stdout", daemon=True).start()
        self.first_line = line.decode("utf-8", "replace")
        return self.first_line

    def _drain(self) -> None:
        stdout = self.proc.stdout
        if stdout is None:
            return
        fd = stdout.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # closed by stop()
                return
            if not chunk:
                return
            try:
                self._log.write(chunk)
                self._log.flush()
            except ValueError:  # log closed by stop()
                return

    def wait_http(self, url: str, timeout_s: float) -> Any:
        """Poll ``url`` until it answers 200 with JSON; returns that JSON."""
        deadline = time.monotonic() + timeout_s
        pause = threading.Event()
        last: object = None
        while True:
            if self.proc.poll() is not None:
                raise self._died()
            try:
                with urllib.request.urlopen(url, timeout=2.0) as resp:
                    if resp.status == 200:
                        return json.loads(resp.read() or b"null")
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError) as err:
                last = err
            if time.monotonic() > deadline:
                raise TokenspeedError(f"{self.name}: {url} not ready within {timeout_s:g} s ({last}); "
                                      f"log {self.log_path}:\n{self.log_tail()}")
            pause.wait(0.1)

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM) without waiting."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def stop(self, grace_s: float = 10.0) -> None:
        stop_process(self.proc, grace_s)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 20.0) -> int:
    """SIGTERM, wait up to ``grace_s`` for a clean exit, else SIGKILL; the exit code.

    The one way this project stops a child it started (engines, routers, relays):
    the demo's fleet, the benchmarks' and the tests' process helpers call it.
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


@dataclass(frozen=True, kw_only=True)
class EngineSimOptions:
    """Flags of one ``engine-sim`` (DESIGN §11); ``extra`` is appended as is."""

    block_size: int = 16
    capacity_tokens: int = 262_144
    prefill_tokens_per_s: float = 20_000.0
    decode_s_per_token: float = 0.02
    time_scale: float = 1.0
    max_num_seqs: int = 64
    model: str = "tokenspeed-sim"
    restart_after_requests: int | None = None
    #: the shared timing model's profile (``--timing``) and its prefill overhead (None: the profile's)
    timing: str = "chunked"
    prefill_overhead_ms: float | None = None
    extra: tuple[str, ...] = ()

    def args(self) -> list[str]:
        out = ["--timing", self.timing,
               "--block-size", str(self.block_size), "--capacity-tokens", str(self.capacity_tokens),
               "--prefill-tokens-per-s", f"{self.prefill_tokens_per_s:g}",
               "--decode-s-per-token", f"{self.decode_s_per_token:g}",
               "--time-scale", f"{self.time_scale:g}", "--max-num-seqs", str(self.max_num_seqs),
               "--model", self.model]
        if self.restart_after_requests is not None:
            out += ["--fault-restart-after-requests", str(self.restart_after_requests)]
        if self.prefill_overhead_ms is not None:
            out += ["--prefill-overhead-ms", f"{self.prefill_overhead_ms:g}"]
        return out + list(self.extra)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` in the main thread.

    Python's default SIGTERM ends the process at once, without ``finally``
    blocks, which would orphan every child a :class:`Fleet` started; as an
    exception, the ``with Fleet(...)`` blocks stop them. For commands (demo,
    benchmarks), not for libraries.
    """
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def clock_scaled_router_flags(time_scale: float, *,
                              prefill_tokens_per_s: float = RouterConfig.prefill_tokens_per_s,
                              prefill_overhead_s: float = RouterConfig.prefill_overhead_s) -> list[str]:
    """``serve`` flags that scale the router's time constants like the engines' clock.

    Engines run ``time_scale`` times faster than modelled; the router's memory
    of what it routed (``predict_on_route_ttl_s``, 15 s, and the approximate
    policy's ``approx_ttl_s``, 120 s: the shipped defaults) is in wall
    seconds, so it is divided by the same factor. Otherwise a 15 s memory
    would span 2 modelled minutes and outlive cache turnover, which is not
    what the defaults do at real speed. Cost model v2's prior prefill rate
    and overhead, and its prediction grace, scale alike (a rate per wall
    second is K times the modelled one). The prior is the shipped default
    (``RouterConfig``: 10k tokens/s, 20 ms) unless the caller passes the
    engines' modelled speed, as an operator who knows it would configure.
    """
    k = float(time_scale)
    if k <= 0:
        return []
    # cost model v2's priors and grace are in the router's clock too
    return ["--router-option", f"predict_on_route_ttl_s={RouterConfig.predict_on_route_ttl_s / k:g}",
            "--router-option", f"approx_ttl_s={RouterConfig.approx_ttl_s / k:g}",
            "--router-option", f"prediction_grace_s={RouterConfig.prediction_grace_s / k:g}",
            "--router-option", f"prefill_overhead_s={prefill_overhead_s / k:g}",
            "--router-option", f"prefill_tokens_per_s={prefill_tokens_per_s * k:g}"]


#: the real peer routers this project compares with: name -> (binary, the pinned PyPI release)
PEER_BINARIES: dict[str, tuple[str, str]] = {
    "vllm-router": ("vllm-router", "vllm-router==0.1.17"),
    "sglang-router": ("smg", "sglang-router==0.3.2"),
}


def default_peers_venv() -> Path:
    """``.venv-peers`` of the checkout (``make peers``), where the peer routers live."""
    return Path(__file__).resolve().parents[2] / ".venv-peers"


def peer_binary(peer: str, peers_venv: Path | None = None) -> str | None:
    """The peer router's executable: in ``peers_venv``/bin (default :func:`default_peers_venv`), else on PATH.

    Never the project's own venv: the peers are not its dependencies and are
    kept out of it (``make peers`` installs them in a venv of their own).
    """
    binary = PEER_BINARIES[peer][0]
    venv = default_peers_venv() if peers_venv is None else peers_venv
    local = venv / "bin" / binary
    return str(local) if local.exists() else shutil.which(binary)


@dataclass(frozen=True, kw_only=True)
class PeerRouter:
    """How to start one real peer router in front of engine-sims, with its defaults.

    ``index_off``: the control run that proves the peer's index is what its
    hit ratio comes from. vllm-router: its KV event sources point at ports
    nothing listens on (dead event ports), so its index never hears an
    event. sglang-router has no event port (its tree is its own routing
    history): ``--cache-threshold 1``, which no match rate is above, so it
    routes by load only.
    """

    peer: str
    binary: str
    model: str = "tokenspeed-sim"
    block_size: int = 16
    index_off: bool = False

    @property
    def prompt_format(self) -> str:
        """sglang-router's cache_aware matches the prompt *text* (loadgen's ``text`` format)."""
        return "text" if self.peer == "sglang-router" else "tokens"

    def command(self, port: int, engines: Sequence[EngineHandle]) -> list[str]:
        urls = [e.url for e in engines]
        # the peers' metrics exporters have fixed default ports: two replicas (or another
        # user of the machine) would collide, so each gets a free one
        metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_tcp_port())]
        if self.peer == "vllm-router":
            cmd = [self.binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                   "--policy", "kv_aware", "--kv-event-block-size", str(self.block_size),
                   "--kv-event-model", self.model, "--log-level", "warning", *metrics]
            for e in engines:
                events = f"tcp://127.0.0.1:{free_tcp_port()}" if self.index_off else e.events
                cmd += ["--kv-event-source", f"{e.url}={events}"]
                if e.replay and not self.index_off:
                    cmd += ["--kv-event-replay-source", f"{e.url}={e.replay}"]
            return cmd
        if self.peer == "sglang-router":
            cmd = [self.binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                   "--policy", "cache_aware", "--log-level", "warn", *metrics]
            return cmd + (["--cache-threshold", "1"] if self.index_off else [])
        raise ValueError(f"unknown peer router {self.peer!r} (known: {', '.join(PEER_BINARIES)})")


@dataclass(frozen=True)
class EngineHandle:
    """A running engine-sim: its name, OpenAI URL and event endpoints (rank 0)."""

    name: str
    url: str
    events: str
    replay: str | None

    def worker_spec(self, *, with_url: bool = True) -> str:
        """``serve --worker`` value for this engine (DESIGN §6/§10)."""
        spec = f"name={self.name},events={self.events}"
        if self.replay:
            spec += f",replay={self.replay}"
        if with_url:
            spec += f",url={self.url}"
        return spec


@dataclass
class Fleet:
    """Starts and owns child processes; use as a context manager."""

    log_dir: Path
    python: str = sys.executable
    startup_timeout_s: float = 120.0
    processes: list[ManagedProcess] = field(default_factory=list)

    def _cli(self, *args: str) -> list[str]:
        return [self.python, "-m", "tokenspeed_router.cli", "--log-level", "WARNING", *args]

    def start(self, name: str, cmd: Sequence[str], *, capture_first_line: bool = False,
              env: dict[str, str] | None = None) -> ManagedProcess:
        proc = ManagedProcess(name, cmd, self.log_dir / f"{name}.log", env=env,
                              capture_first_line=capture_first_line)
        self.processes.append(proc)
        return proc

    def start_engines(self, names: Sequence[str], options: Sequence[EngineSimOptions]) -> list[EngineHandle]:
        """Start one engine-sim per name (in parallel) and wait for their endpoints."""
        return self.wait_engines(self.launch_engines(names, options))

    def launch_engines(self, names: Sequence[str],
                       options: Sequence[EngineSimOptions]) -> list[ManagedProcess]:
        """Start engine-sims without waiting (see :meth:`wait_engines`): several
        fleets can then import torch at the same time."""
        return [
            self.start(name, self._cli("engine-sim", "--port", "0", "--name", name,
                                       "--events", "tcp://127.0.0.1:0",
                                       "--replay", "tcp://127.0.0.1:0", *opts.args()),
                       capture_first_line=True)
            for name, opts in zip(names, options, strict=True)
        ]

    def wait_engines(self, procs: Sequence[ManagedProcess]) -> list[EngineHandle]:
        """Each engine's resolved endpoints, from its first stdout line."""
        handles = []
        for proc in procs:
            info = json.loads(proc.read_first_line(self.startup_timeout_s))
            events = info["events"][0] if isinstance(info["events"], list) else info["events"]
            replay = info.get("replay")
            replay = replay[0] if isinstance(replay, list) else replay
            handles.append(EngineHandle(name=proc.name, url=info["url"], events=events, replay=replay))
        return handles

    def start_gateway(self, name: str, engines: Sequence[EngineHandle], *, policy: str,
                      extra: Sequence[str] = ()) -> str:
        """A ``serve`` gateway in front of ``engines``; returns its base URL once it serves."""
        port = free_tcp_port()
        cmd = self._cli("serve", "--http", f"127.0.0.1:{port}", "--policy", policy)
        for e in engines:
            cmd += ["--worker", e.worker_spec()]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENSPEED_ROUTER_")}
        proc = self.start(name, [*cmd, *extra], env=env)
        url = f"http://127.0.0.1:{port}"
        self.wait_models(proc, url)
        return url

    def start_peer(self, name: str, peer: PeerRouter, engines: Sequence[EngineHandle]) -> str:
        """A real peer router (:class:`PeerRouter`) in front of ``engines``; its base URL once it serves."""
        port = free_tcp_port()
        proc = self.start(name, peer.command(port, engines))
        url = f"http://127.0.0.1:{port}"
        self.wait_models(proc, url)
        return url

    def wait_models(self, proc: ManagedProcess, url: str) -> None:
        """Ready = ``GET /v1/models`` answers with at least one model."""
        deadline = time.monotonic() + self.startup_timeout_s
        pause = threading.Event()
        while True:
            doc = proc.wait_http(url + "/v1/models", max(1.0, deadline - time.monotonic()))
            if isinstance(doc, dict) and doc.get("data"):
                return
            if time.monotonic() > deadline:
                raise TokenspeedError(f"{proc.name}: {url}/v1/models lists no model")
            pause.wait(0.1)

    def stop(self, proc: ManagedProcess) -> None:
        proc.stop()
        if proc in self.processes:
            self.processes.remove(proc)

    def close(self) -> None:
        # SIGTERM to all first, so that their graceful shutdowns overlap.
        for proc in reversed(self.processes):
            proc.terminate()
        while self.processes:
            proc = self.processes.pop()
            try:
                proc.stop()
            except (OSError, subprocess.SubprocessError) as err:
                logger.warning("stopping %s failed: %s", proc.name, err)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
