"""The bearer-token check every authenticated front shares.

The router's HTTP API, its ZeroMQ API and the OpenAI gateway accept the same
token (``--auth-token``) and refuse the same way, so the comparison lives
once, below all three.
"""

from __future__ import annotations

import hmac

from tokenspeed_router.errors import RouterApiError

__all__ = ["check_bearer"]


def check_bearer(presented: str | None, expected: bytes | None, *, header: bool) -> None:
    """Constant-time token check; raise 401 unless auth is off or the token matches.

    ``header=True`` requires the ``Bearer `` scheme (HTTP); the ZeroMQ ``auth``
    field accepts the bare token too.
    """
    if expected is None:
        return
    if not presented:
        raise RouterApiError(401, "missing credentials: send 'Authorization: Bearer <token>'")
    scheme, _, token = presented.partition(" ")
    if scheme.lower() == "bearer" and token:
        candidate = token.strip()
    elif header:
        raise RouterApiError(401, "unsupported authorization scheme: expected 'Bearer <token>'")
    else:
        candidate = presented
    if not hmac.compare_digest(candidate.encode("utf-8", "surrogateescape"), expected):
        raise RouterApiError(401, "invalid bearer token")
