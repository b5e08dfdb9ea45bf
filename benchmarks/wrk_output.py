"""What the HTTP benchmarks read back: wrk's report and a router's Prometheus histograms.

Shared by ``bench_gateway.py``, ``bench_server.py`` and ``bench_http_stack.py``
(each runs as a script, so this directory is on ``sys.path``).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["histogram_buckets", "parse_wrk"]


def parse_wrk(out: str) -> dict[str, Any]:
    """Requests, req/s, p50/p99 (ms), non-2xx count and socket errors from ``wrk --latency``'s report."""

    def ms(label: str) -> float:
        m = re.search(rf"{label}\s+([\d.]+)(us|ms|s)\b", out)
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)] if m else float("nan")

    total = re.search(r"(\d+) requests in", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: .*", out)
    return {"requests": int(total.group(1)) if total else 0, "req_per_s": float(rps.group(1)) if rps else 0.0,
            "p50_ms": ms("50%"), "p99_ms": ms("99%"), "errors": int(non2xx.group(1)) if non2xx else 0,
            "socket_errors": sock.group(0) if sock else ""}


def histogram_buckets(metrics_text: str, name: str) -> dict[float, float]:
    """Cumulative counts by upper bound of the unlabelled Prometheus histogram ``name``."""
    out: dict[float, float] = {}
    for m in re.finditer(rf'^{re.escape(name)}_bucket\{{le="([^"]+)"\}} ([\d.e+-]+)$', metrics_text, re.M):
        out[float("inf") if m.group(1) == "+Inf" else float(m.group(1))] = float(m.group(2))
    return out
