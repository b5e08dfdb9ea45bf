"""One exception hierarchy for the whole package.

Every error raised on purpose by tokenspeed_router derives from
:class:`TokenspeedError`, so callers can catch "anything we raise" without
catching programming errors. Wire-level problems are :class:`WireError`;
index consistency problems carry enough context to ask for a replay.
"""

from __future__ import annotations

__all__ = [
    "CacheError",
    "ConfigError",
    "EventLogError",
    "IndexConsistencyError",
    "InvalidRequestError",
    "NoWorkerAvailableError",
    "OutOfPagesError",
    "PublishError",
    "QueueFullError",
    "RouterApiError",
    "ServiceNotIngestingError",
    "SnapshotError",
    "StateBackendError",
    "TokenspeedError",
    "UnknownParentError",
    "UnknownWorkerError",
    "WireError",
    "WorkerConflictError",
    "api_error",
]


class TokenspeedError(Exception):
    """Base class of every error this package raises deliberately."""


class WireError(TokenspeedError):
    """A frame or payload does not follow the wire format (DESIGN §3)."""


class ConfigError(TokenspeedError):
    """A configuration value is missing, malformed or inconsistent."""


class PublishError(TokenspeedError):
    """A batch could not be accepted by a publisher."""


class QueueFullError(PublishError):
    """The publisher queue stayed full past the configured policy's limit."""


class IndexConsistencyError(TokenspeedError):
    """An event does not fit the index's view of a worker; the batch was not applied."""


class UnknownParentError(IndexConsistencyError):
    """A BlockStored names a parent the index does not hold: an event was lost."""

    def __init__(self, worker: str, parent_hash: object) -> None:
        super().__init__(f"worker {worker!r}: unknown parent block {parent_hash!r}")
        self.worker = worker
        self.parent_hash = parent_hash


class SnapshotError(TokenspeedError):
    """A snapshot is corrupt, truncated or of an unsupported version."""


class StateBackendError(TokenspeedError):
    """The shared state backend (Redis) failed or returned something unexpected."""


class NoWorkerAvailableError(TokenspeedError):
    """The router has no worker that can take this request (none added, or none of the needed role)."""


class CacheError(TokenspeedError):
    """The worker-side prefix cache was misused (lock underflow, double free, reset while locked)."""


class OutOfPagesError(CacheError):
    """Not enough free KV pages (or request slots), even after evicting everything evictable."""


class EventLogError(TokenspeedError):
    """An event log or capture file is not one, or has an unsupported version."""


class InvalidRequestError(TokenspeedError):
    """A query or membership request the router cannot act on as given (HTTP 400)."""


class UnknownWorkerError(TokenspeedError):
    """A request names a worker the router does not know (HTTP 404)."""


class WorkerConflictError(TokenspeedError):
    """A membership change clashes with a worker already configured (HTTP 409)."""


class ServiceNotIngestingError(TokenspeedError):
    """The request needs the ingestion loop, which this service is not running (HTTP 409)."""


class RouterApiError(TokenspeedError):
    """The router's query API refused a request (``status`` is the HTTP-style code).

    The one error the transports (HTTP, ZeroMQ, the gateway) render; the
    domain errors above become one in a single place, :func:`api_error`
    (here, below every part, so the gateway maps them as the server does).
    Clients raise it for an error reply.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


#: domain error -> (HTTP status, prefix of the ``{"error": ...}`` message); first match wins
_STATUS_OF: tuple[tuple[type[TokenspeedError], int, str], ...] = (
    (WireError, 400, "invalid token_ids: "),  # a query's token ids could not be hashed
    (InvalidRequestError, 400, ""),
    (ConfigError, 400, ""),
    (UnknownWorkerError, 404, ""),
    (WorkerConflictError, 409, ""),
    (ServiceNotIngestingError, 409, ""),
    (NoWorkerAvailableError, 503, "no worker available: "),
)


def api_error(err: TokenspeedError) -> RouterApiError:
    """The one mapping from domain errors to API statuses (HTTP, ZeroMQ and the gateway alike).

    A :class:`RouterApiError` passes unchanged; a domain error the table does
    not name is a 500: the service raised something no client can fix.
    """
    if isinstance(err, RouterApiError):
        return err
    for kind, status, prefix in _STATUS_OF:
        if isinstance(err, kind):
            return RouterApiError(status, f"{prefix}{err}")
    return RouterApiError(500, f"internal error: {err}")
