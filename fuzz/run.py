"""Build and run the fuzz targets of the native decoders (docs/development.md, "Fuzzing").

    python fuzz/run.py smoke [--seconds S]         every target, S seconds each (CI: tests/unit/test_fuzz_smoke.py)
    python fuzz/run.py campaign TARGET --seconds S  one long libFuzzer run, its figures in a JSON summary
    python fuzz/run.py build | seeds                just that step
    python fuzz/run.py coverage                     line coverage of each decoder by the corpora

Targets: ingest (csrc/ingest_decode.c into a real core), msgpack (csrc/msgpack.c),
convert (csrc/convert.c). Each links the same csrc/*.c that setup.py compiles,
under AddressSanitizer + UBSan, with CPython embedded (fuzz/embed.h says why).

Engine: libFuzzer when ``clang -fsanitize=fuzzer`` links (Debian: ``apt-get
install clang libclang-rt-14-dev``), else fuzz/driver.c built with the C
compiler the extension uses (gcc): the same targets and sanitizers, replaying
the corpus plus random mutations, without coverage guidance. Nothing is
downloaded: the seeds come from tests/data/captures/ and the edge cases below,
plus the minimized corpus kept in fuzz/corpus/.

Exit status: 0 clean, 1 a finding (the input is written to build/fuzz/findings/),
2 the build failed. FUZZ_OUT moves build/fuzz elsewhere (a smoke run beside a campaign).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FUZZ = ROOT / "fuzz"
CSRC = ROOT / "csrc"
OUT = Path(os.environ.get("FUZZ_OUT") or ROOT / "build" / "fuzz")
TARGETS = ("ingest", "msgpack", "convert")
SEPARATOR = b"\xc1FZ\xc1"  # fuzz_targets.SEPARATOR
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]
# TSR_FUZZ: the extension counts its live allocations (csrc/common.h) for the harness's leak check
CFLAGS = ["-g", "-O1", "-std=c11", "-Wall", "-Wno-missing-braces", "-DTSR_FUZZ", *SANITIZE]
# Leaks: the harnesses check the extension's own live-allocation count after
# every input (exact, and cheap); LeakSanitizer beside an embedded interpreter
# would scan Python's whole heap after most inputs (30 ms each), so it is off.
# allocator_may_return_null: a huge allocation is MemoryError, as in production.
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=0:allocator_may_return_null=1:symbolize=1"
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1"


def _libfuzzer_works() -> bool:
    """clang can build and link a libFuzzer target with the sanitizers."""
    if not shutil.which("clang"):
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("#include <stdint.h>\n#include <stddef.h>\n"
                       "int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { return 0; }\n")
        cmd = ["clang", "-fsanitize=fuzzer,address,undefined", str(src), "-o", str(Path(tmp) / "probe")]
        return subprocess.run(cmd, capture_output=True).returncode == 0


def _c_compiler() -> str:
    return os.environ.get("CC") or sysconfig.get_config_var("CC").split()[0] or "cc"


def engine() -> str:
    """libfuzzer, or driver (the fallback without clang); FUZZ_ENGINE forces one."""
    forced = os.environ.get("FUZZ_ENGINE", "").strip()
    if forced in ("libfuzzer", "driver"):
        return forced
    return "libfuzzer" if _libfuzzer_works() else "driver"


def _python_link() -> tuple[list[str], list[str]]:
    """Compile and link flags to embed this interpreter."""
    inc = sysconfig.get_paths()["include"]
    libdir = sysconfig.get_config_var("LIBDIR")
    ver = sysconfig.get_config_var("LDVERSION") or sysconfig.get_python_version()
    link = [f"-L{libdir}", f"-Wl,-rpath,{libdir}", f"-lpython{ver}", "-ldl", "-lm", "-lpthread"]
    return [f"-I{inc}"], link


def _stale(out: Path, inputs: list[Path], flags: list[str]) -> bool:
    stamp = out.with_suffix(out.suffix + ".flags")
    key = " ".join(flags)
    if not out.exists() or not stamp.exists() or stamp.read_text() != key:
        return True
    t = out.stat().st_mtime
    return any(p.stat().st_mtime > t for p in inputs)


def _compile(cc: str, src: Path, obj: Path, flags: list[str]) -> None:
    headers = [*CSRC.glob("*.h"), *FUZZ.glob("*.h")]
    if not _stale(obj, [src, *headers], flags):
        return
    obj.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([cc, *flags, "-c", str(src), "-o", str(obj)], check=True)
    obj.with_suffix(obj.suffix + ".flags").write_text(" ".join(flags))


def build(eng: str | None = None) -> dict[str, Path]:
    """The three target binaries (rebuilt only when a source changed)."""
    eng = eng or engine()
    cc = "clang" if eng == "libfuzzer" else _c_compiler()
    pyinc, pylink = _python_link()
    base = [*CFLAGS, f"-I{CSRC}", f"-I{CSRC / 'xxhash'}", *pyinc]
    # the extension's files as setup.py builds them (hidden symbols included)
    ext_flags = [*base, "-fvisibility=hidden"] + (["-fsanitize=fuzzer-no-link"] if eng == "libfuzzer" else [])
    obj_dir = OUT / eng / "obj"
    jobs: list[tuple[Path, Path, list[str]]] = [
        (src, obj_dir / (src.stem + ".o"), ext_flags) for src in sorted(CSRC.glob("*.c"))
    ]
    harness_flags = base + (["-fsanitize=fuzzer-no-link"] if eng == "libfuzzer" else [])
    for t in TARGETS:
        jobs.append((FUZZ / f"fuzz_{t}.c", obj_dir / f"fuzz_{t}.o", harness_flags))
    if eng == "driver":
        jobs.append((FUZZ / "driver.c", obj_dir / "driver.o", base))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for f in [pool.submit(_compile, cc, src, obj, fl) for src, obj, fl in jobs]:
            f.result()
    ext_objs = [obj_dir / (src.stem + ".o") for src in sorted(CSRC.glob("*.c"))]
    out: dict[str, Path] = {}
    for t in TARGETS:
        exe = OUT / eng / f"fuzz_{t}"
        objs = [*ext_objs, obj_dir / f"fuzz_{t}.o"] + ([obj_dir / "driver.o"] if eng == "driver" else [])
        link = [*SANITIZE] + (["-fsanitize=fuzzer"] if eng == "libfuzzer" else [])
        if _stale(exe, objs, link + pylink):
            subprocess.run([cc, *link, *map(str, objs), *pylink, "-o", str(exe)], check=True)
            exe.with_suffix(".flags").write_text(" ".join(link + pylink))
        out[t] = exe
    return out


# ------------------------------------------------------------------ seeds


def _captures() -> Iterator[list[bytes]]:
    """The payloads, in order, of every recorded stream in tests/data/captures/."""
    from tokenspeed_router.events.kvcap import read_kvcap

    for cap in sorted((ROOT / "tests" / "data" / "captures").glob("*/*.kvcap")):
        payloads = [r.frames[-1] for r in read_kvcap(cap) if r.frames and r.frames[-1]]
        yield payloads


def _ingest_edge_cases() -> Iterator[bytes]:
    import msgspec

    enc = msgspec.msgpack.encode
    stored = {"type": "BlockStored", "block_hashes": [10, 11], "parent_block_hash": 3,
              "token_ids": list(range(8)), "block_size": 4}
    yield enc([1.0, [stored]])
    yield enc([1.0, [["BlockStored", [b"x" * 32, -5], b"a", list(range(7)), 4, None, "GPU"]], 0])
    yield enc([2, [stored, {"type": "BlockRemoved", "block_hashes": [10, 99]}, {"type": "AllBlocksCleared"}]])
    yield enc([2, [["BlockRemoved", [0, 1], " Disk "], ["AllBlocksCleared", "cpu"], ["AllBlocksCleared"]], None])
    yield enc([3.5, [{**stored, "medium": "CPU_PINNED", "future": [1, {"a": b"b"}]}]])
    yield enc([3.5, [{**stored, "lora_id": 7, "cache_salt": "s"}]])
    yield enc([1.0, [{**stored, "parent_block_hash": 12345}], 1])  # unknown parent
    yield enc([1.0, [{**stored, "block_size": 8}]])  # another grid
    yield enc([float("nan"), []])
    yield b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff"  # array32 claiming 4 G events
    yield b"\x92\x01\x91\x85\xa4type\xabBlockStored\xacblock_hashes\xdd\x7f\xff\xff\xff"
    yield enc([1.0, [[["nested"] * 3] * 3]])
    yield enc([1.0, [{"type": "BlockStored", "block_hashes": [1] * 100, "parent_block_hash": None,
                      "token_ids": [2**40, 2**63 + 5, 0xCD, 0xCE] * 100, "block_size": 4}]])


def _tokens_edge_cases() -> Iterator[bytes]:
    import msgspec

    enc = msgspec.msgpack.encode
    for v in ([], [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1], [2**63], [-1], [-33],
              list(range(20)), list(range(70000)), [1.5], [None], ["x"], [True]):
        yield enc(v)
    yield b"\xdc\x00\x02\xd0\x05\xd3" + (7).to_bytes(8, "big")
    yield b"\xdd\x00\x00\x00\x01\xcf\x7f\xff\xff\xff\xff\xff\xff\xff"
    yield b"\x91\xce\x00\x01"  # truncated
    yield b"\x91\x01\x01"  # trailing byte
    yield b"\xdd\xff\xff\xff\xff"


def _convert_edge_cases() -> Iterator[bytes]:
    bodies = [b"", bytes(range(64)), b"\x05\x01\x02\x03\x04" * 40, b"\x0b\x07" + b"\xff" * 11, b"\x04\x09" * 30,
              b"\x0c\x01\x00\x00" * 5 + b"\x03\x06\x07", b"\x08\xff" * 600]
    for sel in range(64):
        for body in bodies:
            yield bytes([sel]) + body


def seeds() -> dict[str, Path]:
    """Seed corpora under build/fuzz/seeds/TARGET (rewritten each time: they are derived data)."""
    dirs = {t: OUT / "seeds" / t for t in TARGETS}
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)

    def put(target: str, data: bytes) -> None:
        (dirs[target] / hashlib.sha1(data).hexdigest()).write_bytes(data)

    import msgspec

    for payloads in _captures():
        bs16 = 1 << 1  # fuzz_targets: flags bits 1-2 pick the block size (16 for the captures)
        for p in payloads:
            put("ingest", bytes([bs16, 0]) + p)
        for start in range(0, len(payloads), 8):  # streams: the batches in order, so parents are known
            put("ingest", bytes([bs16, 0]) + SEPARATOR.join(payloads[start : start + 8]))
            put("ingest", bytes([bs16 | (1 << 3), 3]) + SEPARATOR.join(payloads[start : start + 8]))  # a fault
        for p in payloads:
            try:
                batch = msgspec.msgpack.decode(p)
            except msgspec.DecodeError:
                continue
            for ev in batch[1] if isinstance(batch, list) and len(batch) > 1 else []:
                toks = ev.get("token_ids") if isinstance(ev, dict) else (ev[3] if len(ev) > 3 else None)
                if isinstance(toks, list):
                    put("msgpack", msgspec.msgpack.encode(toks))
    for i, p in enumerate(_ingest_edge_cases()):
        put("ingest", bytes([0, 0]) + p)
        put("ingest", bytes([1, 0]) + p)  # salvage
        put("ingest", bytes([1 << 3, 1 + i % 6]) + p)  # an allocation failure
    for p in _tokens_edge_cases():
        put("msgpack", p)
    put("msgpack", b"")
    put("convert", b"")
    put("ingest", b"\x00\x00")
    for p in _convert_edge_cases():
        put("convert", p)
    return dirs


# ------------------------------------------------------------------ running


def _env() -> dict[str, str]:
    paths = [str(FUZZ), str(ROOT), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)),
        PYTHONHOME=sys.base_prefix,
        PYTHONHASHSEED="0",
        ASAN_OPTIONS=ASAN_OPTIONS,
        UBSAN_OPTIONS=UBSAN_OPTIONS,
        TOKENSPEED_ROUTER_INDEX="native",
    )
    return env


def _corpus_dirs(target: str) -> list[Path]:
    """Seeds, the kept (minimized) corpus, and the inputs of past findings (replayed by every run)."""
    dirs = (OUT / "seeds" / target, FUZZ / "corpus" / target, FUZZ / "regressions" / target)
    return [d for d in dirs if d.is_dir()]


_STATS = re.compile(r"#(\d+)\s+(\w+)\s+cov: (\d+) ft: (\d+) corp: (\d+)/(\S+)(?:.*?exec/s: (\d+))?")


def _figures(log: str) -> dict[str, object]:
    """libFuzzer's last status line (or the driver's summary)."""
    fig: dict[str, object] = {}
    for m in _STATS.finditer(log):
        fig = {"execs": int(m[1]), "cov": int(m[3]), "ft": int(m[4]), "corpus": int(m[5]),
               "corpus_size": m[6], "exec_per_s": int(m[7] or 0)}
    inited = re.search(r"#\d+\s+INITED\s+cov: (\d+) ft: (\d+) corp: (\d+)", log)
    if inited:  # what the seeds alone reach
        fig.update(seed_cov=int(inited[1]), seed_ft=int(inited[2]), seed_corpus=int(inited[3]))
    units = re.search(r"stat::number_of_executed_units: (\d+)", log)
    if units:
        fig["execs"] = int(units[1])
    done = re.search(r"==driver== Done (\d+) runs in ([\d.]+) s \(corpus (\d+)", log)
    if done:
        fig = {"execs": int(done[1]), "seconds": float(done[2]), "corpus": int(done[3])}
    return fig


def run_target(target: str, exe: Path, eng: str, seconds: float, work: Path, extra: list[str] | None = None) -> tuple[int, str]:
    """Fuzz one target for `seconds` over its corpora; (exit status, log)."""
    findings = OUT / "findings" / target
    findings.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    args = [str(exe), f"-max_total_time={max(1, int(seconds))}", f"-artifact_prefix={findings}/",
            "-print_final_stats=1", "-max_len=65536", "-timeout=20", "-rss_limit_mb=4096", "-detect_leaks=0",
            *(extra or [])]
    if eng == "libfuzzer":
        args += [str(work), *map(str, _corpus_dirs(target))]  # the first dir gathers new inputs
    else:
        args += [f"-seed={int(time.time())}", *map(str, _corpus_dirs(target))]
    proc = subprocess.run(args, env=_env(), cwd=work, capture_output=True, text=True, errors="replace")
    return proc.returncode, proc.stdout + proc.stderr


def smoke(seconds: float) -> int:
    """Every target for `seconds`: the bounded run CI makes (tests/unit/test_fuzz_smoke.py)."""
    eng = engine()
    t0 = time.monotonic()
    try:
        exes = build(eng)
    except subprocess.CalledProcessError as err:
        print(f"fuzz build failed: {err}", file=sys.stderr)
        return 2
    seeds()
    print(f"engine {eng}: built in {time.monotonic() - t0:.1f} s")
    worst = 0
    for t in TARGETS:
        with tempfile.TemporaryDirectory() as tmp:
            rc, log = run_target(t, exes[t], eng, seconds, Path(tmp))
        fig = _figures(log)
        print(f"{t}: exit {rc} {json.dumps(fig)}")
        if rc != 0:
            print(log[-6000:], file=sys.stderr)
            worst = 1
    print(f"smoke: {time.monotonic() - t0:.1f} s in all")
    return worst


def campaign(target: str, seconds: float, keep: bool) -> int:
    """One long run of one target (libFuzzer wanted); the corpus grows in build/fuzz/corpus/TARGET."""
    eng = engine()
    exes = build(eng)
    seeds()
    work = OUT / "corpus" / target
    t0 = time.monotonic()
    rc, log = run_target(target, exes[target], eng, seconds, work)
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (OUT / "logs" / f"{target}-{stamp}.log").write_text(log)
    fig = _figures(log)
    fig.update(target=target, engine=eng, exit=rc, wall_s=round(time.monotonic() - t0, 1),
               findings=sorted(p.name for p in (OUT / "findings" / target).iterdir()))
    if keep and rc == 0 and eng == "libfuzzer":
        kept = FUZZ / "corpus" / target  # the minimized corpus the smoke run replays
        tmp = OUT / "merge" / target
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        subprocess.run([str(exes[target]), "-merge=1", str(tmp), str(work), *map(str, _corpus_dirs(target))],
                       env=_env(), cwd=OUT, capture_output=True, check=True)
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(tmp, kept)
        fig["kept_corpus"] = len(list(kept.iterdir()))
    print(json.dumps(fig))
    (OUT / "logs" / f"{target}-{stamp}.json").write_text(json.dumps(fig, indent=1))
    return 0 if rc == 0 else 1


COVERED = {"ingest": "ingest_decode.c", "msgpack": "msgpack.c", "convert": "convert.c"}


def coverage() -> dict[str, dict[str, float]]:
    """Line / region / function coverage of each decoder by its corpora (clang source-based).

    The targets are built once more without sanitizers, with -fprofile-instr-generate, and
    fuzz/driver.c replays the seeds, the kept corpus and the regressions (no mutation);
    llvm-cov reports the decoder file each target is for.
    """
    cc, pyinc, pylink = "clang", *_python_link()
    flags = ["-g", "-O0", "-std=c11", "-DTSR_FUZZ", "-fprofile-instr-generate", "-fcoverage-mapping",
             f"-I{CSRC}", f"-I{CSRC / 'xxhash'}", *pyinc]
    out_dir = OUT / "coverage"
    objs = []
    for src in [*sorted(CSRC.glob("*.c")), FUZZ / "driver.c"]:
        obj = out_dir / "obj" / (src.stem + ".o")
        _compile(cc, src, obj, flags + (["-fvisibility=hidden"] if src.parent == CSRC else []))
        objs.append(obj)
    seeds()
    result: dict[str, dict[str, float]] = {}
    for t, covered in COVERED.items():
        harness = out_dir / "obj" / f"fuzz_{t}.o"
        _compile(cc, FUZZ / f"fuzz_{t}.c", harness, flags)
        exe = out_dir / f"fuzz_{t}"
        subprocess.run([cc, "-fprofile-instr-generate", *map(str, objs), str(harness), *pylink, "-o", str(exe)],
                       check=True)
        raw = out_dir / f"{t}.profraw"
        env = {**_env(), "LLVM_PROFILE_FILE": str(raw)}
        subprocess.run([str(exe), "-runs=0", *map(str, _corpus_dirs(t))], env=env, cwd=out_dir, check=True,
                       capture_output=True)
        prof = out_dir / f"{t}.profdata"
        subprocess.run(["llvm-profdata", "merge", "-sparse", str(raw), "-o", str(prof)], check=True)
        rep = subprocess.run(["llvm-cov", "report", str(exe), f"-instr-profile={prof}", str(CSRC / covered)],
                             check=True, capture_output=True, text=True).stdout
        total = next(line for line in rep.splitlines() if line.startswith("TOTAL")).split()
        # TOTAL regions missed cover% functions missed exec% lines missed cover% [branches ...]
        result[covered] = {"regions_pct": float(total[3].rstrip("%")), "functions_pct": float(total[6].rstrip("%")),
                           "lines_pct": float(total[9].rstrip("%")), "lines": int(total[7])}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build")
    sub.add_parser("seeds")
    sub.add_parser("coverage", help="line coverage of each decoder by its corpora (needs clang, llvm-cov)")
    p = sub.add_parser("smoke")
    p.add_argument("--seconds", type=float, default=float(os.environ.get("FUZZ_SMOKE_SECONDS", "6")))
    p = sub.add_parser("campaign")
    p.add_argument("target", choices=TARGETS)
    p.add_argument("--seconds", type=float, default=1800)
    p.add_argument("--keep", action="store_true", help="merge the result into fuzz/corpus/TARGET")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        print(json.dumps({k: str(v) for k, v in build().items()}))
        return 0
    if a.cmd == "seeds":
        print(json.dumps({k: len(list(v.iterdir())) for k, v in seeds().items()}))
        return 0
    if a.cmd == "smoke":
        return smoke(a.seconds)
    if a.cmd == "coverage":
        print(json.dumps(coverage(), indent=1))
        return 0
    return campaign(a.target, a.seconds, a.keep)


if __name__ == "__main__":
    sys.exit(main())
