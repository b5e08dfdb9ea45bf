"""CPU time of a live process, read from ``/proc/<pid>/stat``: catches a replica that spins.

Not a test module. The window is waited out by polling with a deadline
(``wait_until``), never a bare sleep.
"""

from __future__ import annotations

import os
import time

from support import wait_until

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` (all its threads) has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    # comm (field 2) may hold spaces and parentheses: split after its closing one
    fields = text[text.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / _TICKS


def cpu_share(pid: int, window_s: float) -> float:
    """Cores ``pid`` used on average over the next ``window_s`` of wall time (1.0 = one full core)."""
    start_wall = time.monotonic()
    start_cpu = cpu_seconds(pid)
    wait_until(lambda: time.monotonic() - start_wall >= window_s, window_s + 5, interval_s=0.05,
               what="the CPU measurement window")
    return (cpu_seconds(pid) - start_cpu) / (time.monotonic() - start_wall)
