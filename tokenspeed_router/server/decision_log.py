"""``serve --decision-log FILE``: explained routing decisions as JSON lines, written off the hot path.

Each explained decision (asked for, or sampled by ``--explain-sample``; see
``server/explain.py``) becomes one line::

    {"v": 1, "time": 1733100000.123456, "request_id": "gw-…-17", "cause": "asked"|"sampled",
     "policy": "kv_aware", "weights": {...}, "temperature": 0.0,
     "num_tokens": 1024, "lora_id": null, "salt": null, "token_ids": [...],
     "decision": {POST /route's fields},
     "explain": {"worker", "candidates": [...], ...}}   # RouteExplanation.to_dict(), as POST /route answers it

``time`` is wall-clock seconds, the clock the event log's receive times use,
so ``replay EVENTLOG --decisions FILE`` can rebuild the index as of each
decision (``tools/decision_replay.py``). ``token_ids`` are there for that
replay: the file holds prompts' token ids, as an event log does; protect it
like one. ``weights`` are the cost weights in force (every field of
``CostWeights``, whatever the cost model's version), so a reader can
re-decide under the same or other weights.

Off the hot path: the request thread appends the (immutable) decision to a
bounded queue and wakes the writer thread; JSON encoding and the file write
happen there. When the queue is full (the disk is slower than the sampled
decisions) the line is dropped and counted,
``tokenspeed_decision_log_dropped_total{reason="queue_full"}``; a failed
write counts as ``reason="write_error"``. Routing never waits on the file.

Each line is one unbuffered ``write`` to a file opened for appending: a
line is in the file as soon as it is written (a reader following the file
never sees a line cut by a buffer boundary, except the one being written),
and several processes appending to one file (``serve --processes N`` with
one ``--decision-log``) never interleave inside a line.

Size: the file rotates when the next line would take it past
``--decision-log-max-bytes`` (default 256 MiB): ``FILE`` becomes ``FILE.1``
(replacing an older one) and a new ``FILE`` starts, so the log never takes
more than twice the bound on disk.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.ratelimit import RateLimitedLog

__all__ = [
    "DECISION_LOG_VERSION",
    "DEFAULT_QUEUE_LINES",
    "DecisionLogCollector",
    "DecisionLogReader",
    "DecisionLogWriter",
    "LoggedDecision",
    "decision_line",
]

logger = logging.getLogger(__name__)

DECISION_LOG_VERSION = 1
#: decisions waiting for the writer thread; beyond this they are dropped and counted
DEFAULT_QUEUE_LINES = 10_000


def _plain_tokens(token_ids: Any) -> Any:
    """Token ids as something JSON can hold (the ZMQ API passes an ``array('Q')``, callers numpy)."""
    if isinstance(token_ids, list):
        return token_ids
    tolist = getattr(token_ids, "tolist", None)
    return tolist() if tolist is not None else list(token_ids)


def decision_line(
    decision: Any, *, time_s: float, cause: str, token_ids: Any, lora_id: Any = None, salt: Any = None
) -> dict[str, Any]:
    """The JSON object of one decision-log line (see the module docstring)."""
    explanation = decision.explanation
    if explanation is None:
        raise ValueError("only explained decisions are logged")
    return {
        "v": DECISION_LOG_VERSION,
        "time": time_s,
        "request_id": decision.request_id,
        "cause": cause,
        "policy": explanation.policy,
        "weights": msgspec.to_builtins(explanation.weights),
        "temperature": explanation.temperature,
        "num_tokens": explanation.num_tokens,
        "lora_id": lora_id,
        "salt": salt,
        "token_ids": _plain_tokens(token_ids),
        "decision": decision.to_dict(),
        "explain": explanation.to_dict(),
    }


@dataclass
class _Counters:
    lines: int = 0
    bytes: int = 0
    rotations: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: {"queue_full": 0, "write_error": 0, "closed": 0})


class DecisionLogWriter:
    """Appends explained decisions to ``path`` from a thread of its own (see the module docstring).

    :meth:`submit` is called under the service lock (so the drop counter is
    exact); it never blocks and never raises. :meth:`close` writes what is
    queued and closes the file.
    """

    def __init__(self, path: str, *, max_bytes: int, max_queue: int = DEFAULT_QUEUE_LINES) -> None:
        self.path = path
        self._max_bytes = max_bytes
        self._max_queue = max_queue
        try:
            self._fh = open(path, "ab", buffering=0)  # noqa: SIM115 - owned by the writer thread until close()
        except OSError as err:
            raise ConfigError(f"cannot write the decision log {path!r}: {err}") from err
        self._size = self._fh.tell()
        self._pending: deque[tuple[Any, ...]] = deque()
        self._wake = threading.Event()
        self._closed = False
        self.counters = _Counters()
        self._limiter = RateLimitedLog(logger, interval_s=30.0)
        self._thread = threading.Thread(target=self._run, name="tokenspeed-decision-log", daemon=True)
        self._thread.start()

    # --- any thread (the service lock held) ---------------------------------------------

    def submit(self, decision: Any, *, time_s: float, cause: str, token_ids: Any, lora_id: Any, salt: Any) -> bool:
        """Queue one explained decision; False (and counted) when it is dropped."""
        if self._closed:
            self.counters.dropped["closed"] += 1
            return False
        if len(self._pending) >= self._max_queue:
            self.counters.dropped["queue_full"] += 1
            return False
        self._pending.append((decision, time_s, cause, token_ids, lora_id, salt))
        self._wake.set()
        return True

    def queued(self) -> int:
        return len(self._pending)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, stop the thread, close the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("decision log writer did not finish within %.1f s; %d line(s) lost",
                         timeout_s, len(self._pending))
            return
        try:
            self._fh.close()
        except OSError as err:
            logger.error("closing the decision log %s failed: %s", self.path, err)

    # --- the writer thread ---------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.json.Encoder()
        pending = self._pending
        while True:
            self._wake.wait()
            self._wake.clear()
            while pending:
                decision, time_s, cause, token_ids, lora_id, salt = pending.popleft()
                try:
                    line = encoder.encode(decision_line(
                        decision, time_s=time_s, cause=cause, token_ids=token_ids, lora_id=lora_id, salt=salt))
                except Exception as err:  # a decision this version cannot encode: count it, keep going
                    self._write_failed(f"encoding a decision failed: {err!r}")
                    continue
                self._write(line + b"\n")
            if self._closed and not pending:
                return

    def _write(self, data: bytes) -> bool:
        try:
            if self._size and self._size + len(data) > self._max_bytes:
                self._rotate()
            view = memoryview(data)
            while view:  # one write in practice; a short write (disk nearly full) is finished, not lost
                n = self._fh.write(view)
                if not n:
                    raise OSError("the file took no bytes")
                view = view[n:]
        except OSError as err:
            self._write_failed(f"write failed: {err}")
            return False
        self._size += len(data)
        self.counters.lines += 1
        self.counters.bytes += len(data)
        return True

    def _rotate(self) -> None:
        self._fh.close()
        os.replace(self.path, self.path + ".1")
        self._fh = open(self.path, "ab", buffering=0)  # noqa: SIM115
        self._size = 0
        self.counters.rotations += 1
        logger.info("decision log %s rotated to %s.1", self.path, self.path)

    def _write_failed(self, message: str) -> None:
        self.counters.dropped["write_error"] += 1
        self._limiter.log(logging.WARNING, "write", "decision log %s: %s (line dropped)", self.path, message)
        if self._fh.closed:  # a rotation failed half way: reopen and carry on
            try:
                self._fh = open(self.path, "ab", buffering=0)  # noqa: SIM115
                self._size = self._fh.tell()
            except OSError:
                pass


class DecisionLogCollector(Collector):
    """``tokenspeed_decision_log_*``: lines and bytes written, lines dropped by reason, queue depth."""

    def __init__(self, writer: DecisionLogWriter) -> None:
        self._writer = writer

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        c = self._writer.counters
        yield CounterMetricFamily("tokenspeed_decision_log_lines", "decisions written to the decision log",
                                  value=float(c.lines))
        yield CounterMetricFamily("tokenspeed_decision_log_bytes", "bytes written to the decision log",
                                  value=float(c.bytes))
        yield CounterMetricFamily("tokenspeed_decision_log_rotations", "times the decision log rotated to FILE.1",
                                  value=float(c.rotations))
        dropped = CounterMetricFamily(
            "tokenspeed_decision_log_dropped",
            "explained decisions not written: queue_full (the writer fell behind), write_error, closed",
            labels=["reason"],
        )
        for reason, n in sorted(c.dropped.items()):
            dropped.add_metric([reason], float(n))
        yield dropped
        yield GaugeMetricFamily("tokenspeed_decision_log_queue", "decisions waiting for the writer thread",
                                value=float(self._writer.queued()))


# --- reading it back ------------------------------------------------------------------------


@dataclass(frozen=True)
class LoggedDecision:
    """One line of a decision log, as ``replay``/``simulate --decisions`` use it.

    ``candidates`` are the ``explain.candidates`` dicts as written (every
    term the writing version had; readers use what they know and ignore the
    rest).
    """

    time_s: float
    request_id: str
    cause: str
    policy: str
    weights: dict[str, Any]
    temperature: float
    num_tokens: int
    token_ids: list[int] | None
    lora_id: int | str | None
    salt: str | None
    worker: str
    decode_worker: str
    prefill_worker: str | None
    candidates: list[dict[str, Any]]
    line: int

    def chosen(self) -> dict[str, Any] | None:
        """The candidate row of the worker that prefilled (the answer's ``worker``)."""
        rows = [c for c in self.candidates if c.get("worker") == self.worker]
        chosen = [c for c in rows if c.get("chosen")] or rows
        return chosen[0] if chosen else None


class _Line(msgspec.Struct):
    v: int
    time: float
    request_id: str
    explain: dict[str, Any]
    cause: str = "asked"
    policy: str = "kv_aware"
    weights: dict[str, Any] = {}
    temperature: float = 0.0
    num_tokens: int = 0
    token_ids: list[int] | None = None
    lora_id: int | str | None = None
    salt: str | None = None


class DecisionLogReader:
    """The decisions of a log file, in file order; malformed lines are skipped and counted.

    ``malformed`` counts lines that are not a version-1 decision (a torn last
    line of a log still being written included); the first few are logged
    with their line numbers.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.malformed = 0
        if not os.path.isfile(path):
            raise ConfigError(f"--decisions {path}: no such file")

    def __iter__(self) -> Iterator[LoggedDecision]:
        decoder = msgspec.json.Decoder(_Line)
        with open(self.path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    d = decoder.decode(raw)
                    if d.v != DECISION_LOG_VERSION:
                        raise ValueError(f"version {d.v} (this reader knows {DECISION_LOG_VERSION})")
                    ex = d.explain
                    candidates = ex.get("candidates")
                    worker = ex.get("worker")
                    if not isinstance(candidates, list) or not isinstance(worker, str):
                        raise ValueError("explain has no worker or candidates")
                except (msgspec.DecodeError, ValueError, RecursionError) as err:
                    self._bad(lineno, err)
                    continue
                prefill = ex.get("prefill_worker")
                yield LoggedDecision(
                    time_s=d.time, request_id=d.request_id, cause=d.cause, policy=d.policy,
                    weights=dict(d.weights), temperature=d.temperature,
                    num_tokens=d.num_tokens or len(d.token_ids or ()), token_ids=d.token_ids,
                    lora_id=d.lora_id, salt=d.salt, worker=worker,
                    decode_worker=str(ex.get("decode_worker") or worker),
                    prefill_worker=prefill if isinstance(prefill, str) else None,
                    candidates=[c for c in candidates if isinstance(c, dict) and isinstance(c.get("worker"), str)],
                    line=lineno,
                )

    def _bad(self, lineno: int, err: BaseException) -> None:
        self.malformed += 1
        if self.malformed <= 5:
            logger.warning("%s line %d: not a decision-log line, skipped (%s)", self.path, lineno, err)
