"""The doctor's answer: one line per engine and check, or JSON (DESIGN §13); the exit code."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenspeed_router.doctor.checks import Check

__all__ = ["DoctorReport", "EngineReport"]


@dataclass(frozen=True, slots=True)
class EngineReport:
    worker: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "ok": self.ok, "checks": [c.to_dict() for c in self.checks]}


@dataclass(frozen=True, slots=True)
class DoctorReport:
    engines: list[EngineReport]

    @property
    def ok(self) -> bool:
        return bool(self.engines) and all(e.ok for e in self.engines)

    @property
    def exit_code(self) -> int:
        """0 when every check of every engine passed, 1 otherwise."""
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "engines": [e.to_dict() for e in self.engines]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        """``WORKER  CHECK  ok|FAIL  detail``, then indented cause and fix lines for failures."""
        width = max((len(e.worker) for e in self.engines), default=6)
        lines: list[str] = []
        for engine in self.engines:
            for c in engine.checks:
                lines.append(f"{engine.worker:<{width}}  {c.name:<10}  {'ok  ' if c.ok else 'FAIL'}  {c.detail}")
                if not c.ok:
                    if c.cause:
                        lines.append(f"{'':<{width}}  {'':<10}        cause: {c.cause}")
                    if c.fix:
                        lines.append(f"{'':<{width}}  {'':<10}        fix:   {c.fix}")
        failed = sum(1 for e in self.engines for c in e.checks if not c.ok)
        total = sum(len(e.checks) for e in self.engines)
        lines.append(f"{'ok' if self.ok else 'FAILED'}: {total - failed} of {total} checks passed "
                     f"on {len(self.engines)} engine(s)")
        return "\n".join(lines)
