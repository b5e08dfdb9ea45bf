"""The shared event stream: entry format, the fenced append, and dedupe positions.

One Redis stream per router cluster holds every subscriber item the leader
received, in the order it received them. Each entry has five fields:

* ``n`` - a gap-free counter assigned inside the append script (a missing
  ``n`` on the reading side means entries were trimmed by MAXLEN before we
  read them);
* ``g`` - the stream *generation*, a random id chosen when the stream was
  (re)seeded: a new generation means Redis lost the stream (restart without
  persistence) and readers must resync from the seed snapshot;
* ``f`` - the leader's fencing token;
* ``m`` - :class:`EntryMeta` (msgpack): kind, worker, epoch, seq, receive time;
* ``p`` - the batch payload exactly as the worker published it.

Appends go through one Lua script that checks the generation, then the
fencing token, atomically with the XADD (generation first: after Redis lost
its data both are gone, and that is a reason to re-seed, not to step down), so a stale leader (or one that does not
know the stream was reset) cannot append. Readers dedupe by
``(worker, epoch, seq)``: an entry is applied only when its position is
strictly after the worker's last applied one, so a retried append or an
entry re-appended during a re-seed is never applied twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from tokenspeed_router.errors import StateBackendError
from tokenspeed_router.state.config import StateKeys

if TYPE_CHECKING:
    import redis

__all__ = [
    "EntryMeta",
    "FencedError",
    "GenerationError",
    "Position",
    "StreamAppender",
    "StreamEntry",
    "decode_entry",
    "entry_position",
    "id_after",
    "parse_id",
]

Kind = Literal["batch", "restart", "resync"]

#: ``(epoch, seq)`` of a worker; compared lexicographically.
Position = tuple[int, int]


class EntryMeta(msgspec.Struct, array_like=True, frozen=True):
    """What an entry says about the item besides its payload.

    For ``restart``: ``a`` = last seq of the old incarnation, ``b`` = first seq
    of the new one. For ``resync``: ``a`` = expected seq, ``b`` = the seq that
    arrived instead; ``reason`` says why.
    """

    kind: str
    worker: str
    epoch: int
    seq: int
    recv_time_s: float
    topic: bytes = b""
    a: int = 0
    b: int = 0
    reason: str = ""
    replayed: bool = False
    #: Leader's wall clock when it accepted the item (for follower lag).
    leader_time_s: float = 0.0


_META_ENCODER = msgspec.msgpack.Encoder()
_META_DECODER = msgspec.msgpack.Decoder(EntryMeta)


def encode_meta(meta: EntryMeta) -> bytes:
    return _META_ENCODER.encode(meta)


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One decoded stream entry."""

    stream_id: bytes
    n: int
    generation: str
    fence: int
    meta: EntryMeta
    payload: bytes


def decode_entry(stream_id: bytes, fields: dict[bytes, bytes]) -> StreamEntry:
    """Decode the raw XREAD/XRANGE field map; raise StateBackendError on a foreign entry."""
    try:
        return StreamEntry(
            stream_id=stream_id,
            n=int(fields[b"n"]),
            generation=fields[b"g"].decode(),
            fence=int(fields[b"f"]),
            meta=_META_DECODER.decode(fields[b"m"]),
            payload=fields[b"p"],
        )
    except (KeyError, ValueError, msgspec.DecodeError) as err:
        raise StateBackendError(f"malformed stream entry {stream_id!r}: {err}") from err


def entry_position(meta: EntryMeta) -> Position:
    """The dedupe position of an entry.

    A batch sits at its own ``(epoch, seq)``. A restart or resync sits just
    before the first seq that follows it (``b - 1``): it accounts for
    everything up to there, and the next batch is strictly after it.
    """
    if meta.kind == "batch":
        return (meta.epoch, meta.seq)
    return (meta.epoch, meta.b - 1)


def parse_id(stream_id: bytes | str) -> tuple[int, int]:
    text = stream_id.decode() if isinstance(stream_id, bytes) else stream_id
    ms, _, seq = text.partition("-")
    return (int(ms), int(seq or 0))


def id_after(stream_id: bytes | str) -> str:
    """The smallest id strictly after ``stream_id`` (for an exclusive XRANGE start)."""
    ms, seq = parse_id(stream_id)
    return f"{ms}-{seq + 1}"


class FencedError(StateBackendError):
    """Our fencing token is no longer current: another replica took the lease.

    ``current`` is the token Redis holds now (None when the fence key is gone:
    Redis lost its data, which is not a takeover by itself).
    """

    @property
    def current(self) -> int | None:
        text = str(self).rpartition("current=")[2].strip()
        return int(text) if text.isdigit() else None


class GenerationError(StateBackendError):
    """The stream generation changed or vanished (Redis lost it): re-seed or resync."""


_APPEND = """
local g = redis.call('GET', KEYS[4])
if g ~= ARGV[2] then return redis.error_reply('GENERATION current=' .. tostring(g)) end
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return redis.error_reply('FENCED current=' .. tostring(cur)) end
local count = (#ARGV - 3) / 2
local n = redis.call('INCRBY', KEYS[3], count) - count
local ids = {}
for i = 4, #ARGV, 2 do
  n = n + 1
  ids[#ids + 1] = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*',
    'n', n, 'g', ARGV[2], 'f', ARGV[1], 'm', ARGV[i], 'p', ARGV[i + 1])
end
return ids
"""


class StreamAppender:
    """Fenced, batched appends to the stream (one round trip per call)."""

    def __init__(self, client: redis.Redis, keys: StateKeys, maxlen: int) -> None:
        self._keys = keys
        self._maxlen = maxlen
        self._script = client.register_script(_APPEND)

    def append(
        self, fence: int, generation: str, entries: list[tuple[bytes, bytes]]
    ) -> list[bytes]:
        """Append ``(meta, payload)`` pairs; return their stream ids.

        Raises :class:`FencedError` when ``fence`` is stale and
        :class:`GenerationError` when the stream is not (or no longer) of
        ``generation``; transport errors propagate as redis-py raises them.
        """
        redis = _redis()
        args: list[Any] = [fence, generation, self._maxlen]
        for meta, payload in entries:
            args.append(meta)
            args.append(payload)
        k = self._keys
        try:
            ids = self._script(keys=[k.fence, k.stream, k.counter, k.generation], args=args)
        except redis.ResponseError as err:
            text = str(err)
            if "FENCED" in text:
                raise FencedError(text) from err
            if "GENERATION" in text:
                raise GenerationError(text) from err
            raise StateBackendError(f"stream append failed: {text}") from err
        return [bytes(i) for i in ids]


def _redis() -> Any:
    from tokenspeed_router.state._client import redis_module

    return redis_module()
