"""Versioned index snapshots in Redis: what a new replica loads to come up warm.

A snapshot is one msgpack :class:`SnapshotEnvelope` (the KvIndex's own
snapshot bytes, the per-worker dedupe positions and states, and the stream
point it covers: generation, counter ``n`` and entry id) stored under one key,
beside a small metadata hash (version, size, block count, age) that status
pages and ``inspect`` can read without fetching the blob.

Writes are Lua scripts so a snapshot never goes backwards: a replica that
lagged cannot replace a newer snapshot with an older one, and a snapshot of
a stream generation that no longer exists is refused. Seeding a new generation
(first start, or after Redis lost the stream) writes the generation, empties
the stream and stores the seed snapshot in one atomic step, so a reader that
sees a generation always finds its snapshot.

Size limit: one Redis string (512 MB by default ``proto-max-bulk-len``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from tokenspeed_router.errors import SnapshotError
from tokenspeed_router.state.config import StateKeys
from tokenspeed_router.state.stream import FencedError, Position

if TYPE_CHECKING:
    import redis

__all__ = ["SNAPSHOT_FORMAT", "SnapshotEnvelope", "SnapshotMeta", "SnapshotStore"]

#: Bump on any incompatible change of :class:`SnapshotEnvelope`.
SNAPSHOT_FORMAT = 1


class SnapshotEnvelope(msgspec.Struct, frozen=True, kw_only=True):
    """Everything needed to resume reading the stream exactly where the index stands."""

    format: int
    generation: str
    n: int
    stream_id: str
    created_s: float
    replica_id: str
    positions: dict[str, tuple[int, int]]
    worker_states: dict[str, str]
    max_fence: int
    index: bytes

    def position_map(self) -> dict[str, Position]:
        return {w: (int(p[0]), int(p[1])) for w, p in self.positions.items()}


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SnapshotEnvelope)


def encode_envelope(envelope: SnapshotEnvelope) -> bytes:
    return _ENCODER.encode(envelope)


def decode_envelope(data: bytes) -> SnapshotEnvelope:
    try:
        envelope = _DECODER.decode(data)
    except msgspec.DecodeError as err:
        raise SnapshotError(f"state snapshot is corrupt: {err}") from err
    if envelope.format != SNAPSHOT_FORMAT:
        raise SnapshotError(
            f"state snapshot format {envelope.format} is not supported (expected {SNAPSHOT_FORMAT})"
        )
    return envelope


@dataclass(frozen=True)
class SnapshotMeta:
    """The metadata hash beside a snapshot."""

    version: int
    generation: str
    n: int
    stream_id: str
    created_s: float
    replica_id: str
    num_bytes: int
    num_blocks: int
    num_workers: int

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> SnapshotMeta:
        try:
            text = {k.decode(): v.decode() for k, v in raw.items()}
            return cls(
                version=int(text["version"]), generation=text["gen"], n=int(text["n"]),
                stream_id=text["stream_id"], created_s=float(text["created_s"]),
                replica_id=text["replica"], num_bytes=int(text["bytes"]),
                num_blocks=int(text["blocks"]), num_workers=int(text["workers"]),
            )
        except (KeyError, ValueError, UnicodeDecodeError) as err:
            raise SnapshotError(f"state snapshot metadata is malformed: {err}") from err


def _meta_args(envelope: SnapshotEnvelope, num_bytes: int, num_blocks: int) -> list[Any]:
    return [
        "gen", envelope.generation, "n", envelope.n, "stream_id", envelope.stream_id,
        "created_s", repr(envelope.created_s), "replica", envelope.replica_id,
        "bytes", num_bytes, "blocks", num_blocks, "workers", len(envelope.positions),
    ]


_WRITE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local mg = redis.call('HGET', KEYS[3], 'gen')
local mn = redis.call('HGET', KEYS[3], 'n')
if mg == ARGV[1] and mn and tonumber(mn) >= tonumber(ARGV[2]) then return 0 end
local v = (tonumber(redis.call('HGET', KEYS[3], 'version')) or 0) + 1
redis.call('SET', KEYS[2], ARGV[3])
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], 'version', v, unpack(ARGV, 4))
return v
"""

_SEED = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED current=' .. tostring(redis.call('GET', KEYS[1])))
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('DEL', KEYS[3])
redis.call('SET', KEYS[4], 0)
local v = (tonumber(redis.call('HGET', KEYS[6], 'version')) or 0) + 1
redis.call('SET', KEYS[5], ARGV[3])
redis.call('DEL', KEYS[6])
redis.call('HSET', KEYS[6], 'version', v, unpack(ARGV, 4))
return v
"""


class SnapshotStore:
    """Read and write the cluster's latest snapshot."""

    def __init__(self, client: redis.Redis, keys: StateKeys) -> None:
        self._client = client
        self._keys = keys
        self._write = client.register_script(_WRITE)
        self._seed = client.register_script(_SEED)

    def write(self, envelope: SnapshotEnvelope, *, num_blocks: int) -> int | None:
        """Store ``envelope`` unless a snapshot at least as new exists; return its version."""
        data = encode_envelope(envelope)
        k = self._keys
        version = int(self._write(
            keys=[k.generation, k.snapshot, k.snapshot_meta],
            args=[envelope.generation, envelope.n, data, *_meta_args(envelope, len(data), num_blocks)],
        ))
        return version if version > 0 else None

    def seed(self, fence: int, envelope: SnapshotEnvelope, *, num_blocks: int) -> int:
        """Start a new stream generation from ``envelope`` (leader only, fenced)."""
        from tokenspeed_router.state._client import redis_module

        data = encode_envelope(envelope)
        k = self._keys
        try:
            return int(self._seed(
                keys=[k.fence, k.generation, k.stream, k.counter, k.snapshot, k.snapshot_meta],
                args=[fence, envelope.generation, data,
                      *_meta_args(envelope, len(data), num_blocks)],
            ))
        except redis_module().ResponseError as err:
            if "FENCED" in str(err):
                raise FencedError(str(err)) from err
            raise

    def meta(self) -> SnapshotMeta | None:
        raw = self._client.hgetall(self._keys.snapshot_meta)
        return SnapshotMeta.from_hash(raw) if raw else None  # type: ignore[arg-type]

    def load(self) -> tuple[SnapshotMeta, SnapshotEnvelope] | None:
        """The latest snapshot and its metadata, read atomically; None if there is none."""
        pipe = self._client.pipeline(transaction=True)
        pipe.hgetall(self._keys.snapshot_meta)
        pipe.get(self._keys.snapshot)
        raw_meta, data = pipe.execute()
        if not raw_meta or data is None:
            return None
        return SnapshotMeta.from_hash(raw_meta), decode_envelope(data)
