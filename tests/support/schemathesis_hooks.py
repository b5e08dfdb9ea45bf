"""schemathesis hooks for the API fuzz run (``SCHEMATHESIS_HOOKS=support.schemathesis_hooks``).

JSON Schema counts ``190.0`` as an integer; the router does not (a token id,
a ``lora_id`` or a request id sent as a float is a 400 naming the field, on
purpose: see docs/gateway.md, "LoRA adapters"). Generated bodies holding an
integral float are dropped, so the positive checks do not call that refusal
a bug; the unit tests pin the refusal itself.
"""

from __future__ import annotations

from typing import Any

import schemathesis


def _integral_float(value: Any) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, dict):
        return any(_integral_float(v) for v in value.values())
    if isinstance(value, list):
        return any(_integral_float(v) for v in value)
    return False


@schemathesis.hook
def filter_body(context: Any, body: Any) -> bool:
    return not _integral_float(body)
