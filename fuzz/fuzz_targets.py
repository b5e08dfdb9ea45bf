"""The Python half of the fuzz targets (fuzz/*.c embed CPython and call these).

The C harnesses link the extension's own csrc/*.c, instrumented, and register
it as the builtin module ``tokenspeed_router._native`` before this module
imports the package, so ``KvIndex`` here drives the instrumented core. What a
target must hold is checked here, where it reads like the tests:

* ``ingest_one``: a fuzz input is up to 8 payloads. Each goes to the raw path
  (``KvIndex.apply_raw``) of one index and, when the raw path declines it, to
  the typed path (``decode_batch`` + ``KvIndex.apply``) of both; when the raw
  path takes it, the typed path of a twin index must do exactly the same
  (counters, unknown parent, every entry). An allocation failure injected into
  the raw call must raise MemoryError and leave the index as it was.
* ``convert_case`` / ``check_tokens`` / ``check_ext``: the objects fuzz_convert.c
  hands to ``tokens_from``, ``toks_open``/``toks_convert`` and ``ext_key``,
  and what those must answer.

An assertion failing here aborts the process (the harness calls abort()), so
libFuzzer and the replay driver record the input as a finding.
"""

from __future__ import annotations

import array
import enum
import struct
from typing import Any

import msgspec
import xxhash

from tokenspeed_router import _native
from tokenspeed_router.errors import TokenspeedError, UnknownParentError, WireError
from tokenspeed_router.events.codec import decode_batch
from tokenspeed_router.router.index import KvIndex

assert not hasattr(_native, "__file__"), "the fuzz harness must run the instrumented builtin core"

M64 = (1 << 64) - 1
SEPARATOR = b"\xc1FZ\xc1"  # 0xc1 is never used by msgpack: splits an input into payloads
MAX_PAYLOADS = 8
WORKER = "w"
BLOCK_SIZES = (4, 16, 1, 2)
BYTES_SEED = 0x7473726F75746572  # ext_key's seed for bytes ids (csrc/convert.c)
M_SIGNED, M_BYTES = 4, 8  # csrc/common.h

# ------------------------------------------------------------------ ingest

_PRELUDE_CACHE: dict[int, list[bytes]] = {}


def _prelude(bs: int) -> list[bytes]:
    """Blocks the fuzzed payloads can name as parents: int ids 0..3, bin ids, a negative id."""
    if bs not in _PRELUDE_CACHE:
        enc = msgspec.msgpack.encode
        _PRELUDE_CACHE[bs] = [
            enc([1.0, [{"type": "BlockStored", "block_hashes": [0, 1, 2, 3], "parent_block_hash": None,
                        "token_ids": list(range(4 * bs)), "block_size": bs}]]),
            enc([1.0, [["BlockStored", [b"a", b"b" * 32, -1], 3, list(range(100, 100 + 3 * bs)), bs, None, "cpu"]]]),
        ]
    return _PRELUDE_CACHE[bs]


def _state(index: KvIndex) -> Any:
    """Everything an index holds, order-free (table layouts may differ after a rollback)."""
    out = []
    for name in index.workers():
        ext, content, unm, tier_index, tier_code = index._core.items(name)
        unmatchable = set(unm)
        codes = dict(zip(tier_index, tier_code, strict=True))
        entries = sorted(
            (type(e).__name__, e, c, i in unmatchable, codes.get(i, 1))
            for i, (e, c) in enumerate(zip(ext, content, strict=True))
        )
        info = index.worker_info(name)
        assert info.blocks == len(ext), (info, len(ext))
        assert info.matchable == len(ext) - len(unmatchable), (info, len(unmatchable))
        out.append((name, index.block_size_of(name), entries, tuple(info)))
    stats = index.statistics()
    stats.pop("unknown_media")  # process-wide, shared by both indexes
    return out, stats, index.num_distinct_blocks()


def _typed(index: KvIndex, batch: Any) -> Any:
    """The typed path's outcome: its stats, or the kind of refusal."""
    try:
        return index.apply(WORKER, batch)
    except UnknownParentError:
        return "unknown_parent"
    except TokenspeedError as err:
        return type(err).__name__


def ingest_one(data: bytes) -> None:
    if len(data) < 2:
        return
    flags, fault = data[0], data[1]
    bs = BLOCK_SIZES[(flags >> 1) & 3]
    salvage = bool(flags & 1)
    fault_on = (flags >> 3) & 7  # the payload (1-based) whose raw apply gets an allocation failure
    raw, typed = KvIndex(core="native"), KvIndex(core="native")
    for payload in _prelude(bs):
        for index in (raw, typed):
            index.apply(WORKER, decode_batch(payload))
    for n, payload in enumerate(data[2:].split(SEPARATOR)[:MAX_PAYLOADS], start=1):
        _ingest_payload(raw, typed, payload, salvage, fault if fault_on == n else 0)
    assert _state(raw) == _state(typed)
    probe = list(range(4 * bs))
    assert raw.match_detail(probe) == typed.match_detail(probe)


def _ingest_payload(raw: KvIndex, typed: KvIndex, payload: bytes, salvage: bool, fault: int) -> None:
    try:
        batch = decode_batch(payload)
    except WireError:
        batch = None
    ts = _native.scan_batch(payload)
    if batch is None:
        assert ts is None, "scan_batch took a payload the typed decoder refuses"
    elif ts is not None:
        assert ts == batch.ts, (ts, batch.ts)
    before = _state(raw)
    _native._fail_alloc_after(fault)
    try:
        got = raw.apply_raw(WORKER, payload, salvage=salvage)
    except MemoryError:
        assert fault and _native._fail_alloc_after(0) == 0, "MemoryError without an injected failure"
        assert _state(raw) == before, "an allocation failure changed the index"
        return
    finally:
        _native._fail_alloc_after(0)
    if got is None:  # not provably the fast case (another grid included): the typed path decides
        assert _state(raw) == before, "apply_raw declined but changed the index"
        if batch is not None:
            assert str(_typed(raw, batch)) == str(_typed(typed, batch))
        return
    assert ts is not None and batch is not None, "apply_raw took a payload scan_batch/typed refuse"
    assert got.ts == ts
    if got.unknown_parent:  # nothing applied (its counter moved)
        after = _state(raw)
        assert (after[0], after[2]) == (before[0], before[2]), "a refused batch changed the index"
    if salvage:
        # IndexIngestor's salvage has no typed twin here: the twin takes the raw side's state
        typed.__dict__.update(KvIndex.restore(raw.snapshot()).__dict__)
        return
    want = _typed(typed, batch)
    if got.unknown_parent:
        assert want == "unknown_parent", want
    else:
        assert want == got.stats, (want, got.stats)
    assert _state(raw) == _state(typed)


# ------------------------------------------------------------------ convert


class _Tier(enum.IntEnum):
    """int subclasses take the API paths of convert.c, not the digit-reading fast ones."""

    A = 3
    B = 2**40
    C = -(2**40)


class _Index:
    """Not an int, but has __index__ (numpy-like scalars take this path)."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


def _int_of(chunk: bytes) -> Any:
    """One item from a few bytes: ints of every width and sign, and the odd types."""
    if not chunk:
        return 0
    kind, body = chunk[0], chunk[1:]
    v = int.from_bytes(body, "little")
    match kind % 16:
        case 0 | 1 | 2 | 3:
            return v
        case 4:
            return -v
        case 5:
            return v & 0x3FFFFFFF
        case 6:
            return (1 << 64) - 1 - (v & 0xFFFF)
        case 7:
            return (1 << 63) + (v & 0xFFFF) - 0x8000
        case 8:
            return -(1 << 63) + (v & 0xFF) - 0x80
        case 9:
            return bool(v & 1)
        case 10:
            return (_Tier.A, _Tier.B, _Tier.C)[v % 3]
        case 11:
            return _Index(v - (1 << 63))
        case 12:
            return float(v & 0xFF)
        case 13:
            return None
        case 14:
            return body
        case _:
            return v << (kind >> 4) * 8


def _items(data: bytes) -> list[Any]:
    out = []
    i = 0
    while i < len(data):
        n = 1 + data[i] % 12
        out.append(_int_of(data[i : i + n]))
        i += n
    return out


def convert_case(data: bytes) -> Any:
    """An object to convert, from the fuzz input: a list, tuple, buffer, or wrong type."""
    if not data:
        return []
    sel, body = data[0], data[1:]
    match sel % 8:
        case 0 | 1:
            return _items(body)
        case 2:
            return tuple(_items(body))
        case 3:
            code = "bBhHiIlLqQfd"[(sel >> 3) % 12]
            size = array.array(code).itemsize
            return array.array(code, body[: len(body) // size * size])
        case 4:
            fmt = ["B", "b", "<H", "=i", "@q", "Q", "d", "?"][(sel >> 3) % 8]
            size = struct.calcsize(fmt)
            raw = body[: len(body) // size * size]
            return memoryview(raw).cast("B").cast(fmt.lstrip("<=@")) if raw else memoryview(b"")  # type: ignore[call-overload]
        case 5:
            return body if sel & 8 else body.decode("latin-1")
        case 6:
            return range(int.from_bytes(body[:2], "little") % 3000) if sel & 8 else set(_items(body)[:1])
        case _:
            return [*_items(body)] * (1 + (sel >> 3) % 4)


def _expected(obj: Any, strict: bool) -> list[int] | None:
    """What tokens_from must give (None: an exception)."""
    if isinstance(obj, (bytes, bytearray, str)):
        return None
    try:
        seq = list(obj)
    except TypeError:
        return None
    out = []
    for item in seq:
        if isinstance(item, float) or item is None or isinstance(item, bytes):
            return None
        try:
            v = item.__index__()
        except (AttributeError, TypeError):
            return None
        if strict and not 0 <= v <= M64:
            return None
        out.append(v & M64)
    return out


def _want(obj: Any, strict: bool) -> list[int] | None:
    if isinstance(obj, memoryview) and obj.format in ("d", "?"):
        return None  # a float or bool buffer is refused
    if isinstance(obj, array.array) and obj.typecode in "fd":
        return None
    return _expected(obj, strict)


def check_tokens(obj: Any, strict: bool, got: bytes | None, err: BaseException | None) -> None:
    """tokens_from(obj, strict) answered got (native u64s) or raised err."""
    want = _want(obj, strict)
    if got is None:
        assert want is None, (obj, strict, want, err)
        assert isinstance(err, (TypeError, ValueError, OverflowError)), repr(err)
        return
    values = list(struct.unpack(f"={len(got) // 8}Q", got))
    assert want is not None, (obj, strict, values)
    assert values == want, (obj, strict, values, want)


def check_lazy(obj: Any, got: bytes | None, slow: bool, err: BaseException | None) -> None:
    """toks_open + toks_convert in chunks: the strict values, or a stop for the slow path."""
    want = _want(obj, True)
    if err is not None:
        assert want is None, (obj, want, err)
        return
    if slow:  # an item is not an int: the walk converts it all outside the lock
        assert isinstance(obj, (list, tuple)) and not all(isinstance(x, int) for x in obj), obj
        return
    assert got is not None and want is not None, (obj, got)
    assert list(struct.unpack(f"={len(got) // 8}Q", got)) == want, (obj, want)


def check_ext(item: Any, key: int | None, kind: int | None, err: BaseException | None) -> None:
    """ext_key(item): an int in [-2**63, 2**64) or bytes -> (key, kind flag)."""
    if isinstance(item, bytes):
        want = (xxhash.xxh3_64_intdigest(item, seed=BYTES_SEED), M_BYTES)
    elif isinstance(item, int) and -(1 << 63) <= item <= M64:
        want = (item & M64, M_SIGNED if item < 0 else 0)
    else:
        want = None
    if key is None:
        assert want is None, (item, want, err)
        assert isinstance(err, (TypeError, ValueError, OverflowError)), repr(err)
        return
    assert (key, kind) == want, (item, key, kind, want)
