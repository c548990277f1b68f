"""Compiling and loading dresd's C kernels (`attention.c`, `linear.c`, `quant.c`, `decoder.c`),
shared by all.

A kernel is compiled once per machine with the system C compiler (`cc`, or `$CC`) into the
cache (`$DRESD_CACHE/kernels/`), keyed by its source, the compiler flags, the compiler and the
CPU, and loaded with ctypes. Where there is no compiler, or the compile fails, `load` returns
None and the caller keeps its PyTorch path.

Kernel tiers: the instruction set the kernels are compiled for is chosen once per process
(`tier()`), from the CPU's flags: the first of `TIERS` the CPU runs, or the one `$DRESD_ISA`
names (so that every tier this CPU can be restricted to runs and is tested on it). The best
tier compiles with -march=native; the others with their own -m flags only, so that a tier
forced on a newer CPU runs the instructions an older one has. Each tier is batch- and
thread-invariant in its own fixed order; outputs may differ between tiers (docs/exactness.md).
On aarch64 the tiers are `neoni8mm` and `neon` (NEON with the dot product; read from
/proc/cpuinfo's Features, or assumed on macOS's arm64, where every CPU has it), built with
their own -march; they are tested for exactness under qemu-aarch64 (tests/test_neon_qemu.py).

`$DRESD_KERNEL_FLAGS` adds compiler flags to every kernel's and `$DRESD_KERNEL_DIR` builds them
elsewhere: the sanitizer test (`tests/test_gguf_distrust.py`) builds them with
`-fsanitize=address,undefined` and runs the kernels' tests against that build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dresd.errors import DresdError
from dresd.host import cache_dir, cpu_flags, cpu_model

BF16_HEADER = Path(__file__).with_name("bf16.h")  # included by linear.c and quant.c
VEC_HEADER = Path(__file__).with_name("vec.h")  # per-tier vector helpers (linear.c, quant.c)
HEADERS = (BF16_HEADER, VEC_HEADER)
NATIVE = "-march=native"  # in a kernel's flags: replaced by its tier's (`Tier.flags`)


@dataclass(frozen=True)
class Tier:
    """An instruction set the kernels are compiled for: the CPU flags (as /proc/cpuinfo names
    them) it needs, and the compiler flags that stand for -march=native in its build."""

    name: str
    needs: frozenset[str]
    flags: tuple[str, ...]
    summary: str  # for `dresd --version`
    arch: str = "x86_64"  # the machine (platform.machine()) it is for


# Best first: where DRESD_ISA is unset, the first the CPU runs is the tier.
TIERS = (
    Tier("avx512bf16", frozenset({"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}),
         (NATIVE,), "AVX-512 bf16 and VNNI"),
    Tier("avx512vnni", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                                  "fma", "f16c"}),
         ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2",
          "-mfma", "-mf16c", "-mno-avx512bf16"), "AVX-512 with VNNI, no bf16"),
    Tier("avx2vnni", frozenset({"avx2", "fma", "f16c", "avx_vnni"}),
         ("-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-mno-avx512f"), "AVX2 with AVX-VNNI"),
    Tier("avx2", frozenset({"avx2", "fma", "f16c"}),
         ("-mavx2", "-mfma", "-mf16c", "-mno-avx512f"), "AVX2, FMA and F16C"),
    # aarch64 (vec.h's NEON helpers): i8mm's usdot multiplies full unsigned bytes, where
    # dotprod's sdot takes Q8_0's as two nibbles (the same integers, so the same bits).
    Tier("neoni8mm", frozenset({"asimd", "asimddp", "i8mm"}),
         ("-march=armv8.2-a+dotprod+i8mm",), "NEON with dot product and int8 matmul",
         "aarch64"),
    Tier("neon", frozenset({"asimd", "asimddp"}), ("-march=armv8.2-a+dotprod",),
         "NEON with dot product", "aarch64"),
)


def machine_flags() -> set[str]:
    """This CPU's flags (`host.cpu_flags`); on macOS's arm64, which has no /proc/cpuinfo, those
    every Apple CPU has that the aarch64 tiers need (NEON and its dot product)."""
    flags = cpu_flags()
    if not flags and platform.machine() == "arm64":
        return {"asimd", "asimddp"}
    return flags


def runnable_tiers(flags: set[str] | None = None) -> list[Tier]:
    """The tiers a CPU with these flags (this one's by default) runs, best first."""
    flags = machine_flags() if flags is None else flags
    return [tier for tier in TIERS if tier.needs <= flags]


@functools.cache
def tier() -> Tier | None:
    """The kernels' tier in this process: `$DRESD_ISA`'s, else the best this CPU runs; None
    where it runs none (then only the portable kernels, attention and drafting, are built).
    A DresdError where `$DRESD_ISA` names no tier, or one this CPU cannot run."""
    forced = os.environ.get("DRESD_ISA", "").strip().lower()
    runnable = runnable_tiers()
    if not forced:
        return runnable[0] if runnable else None
    names = {tier.name: tier for tier in TIERS}
    if forced not in names:
        raise DresdError(f"DRESD_ISA={forced}: not a kernel tier (one of {', '.join(names)})")
    machine = platform.machine().lower().replace("arm64", "aarch64").replace("amd64", "x86_64")
    if names[forced].arch != machine:
        raise DresdError(f"DRESD_ISA={forced}: a tier for {names[forced].arch} CPUs, and this "
                         f"machine is {machine}; it runs "
                         f"{', '.join(t.name for t in runnable) or 'no kernel tier'}")
    if names[forced] not in runnable:
        missing = sorted(names[forced].needs - machine_flags())
        raise DresdError(f"DRESD_ISA={forced}: this CPU cannot run it (it lacks "
                         f"{', '.join(missing)}); it runs "
                         f"{', '.join(t.name for t in runnable) or 'no kernel tier'}")
    return names[forced]


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS)
        return os.cpu_count() or 1


def cpu_key() -> str:
    """What -march=native compiles for: the CPU's model name and flags."""
    return "\n".join([cpu_model(), *sorted(cpu_flags())])


def tier_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    """`flags` with -march=native replaced by the tier's flags (as they are without a tier)."""
    chosen = tier()
    if chosen is None:
        return flags
    return tuple(part for flag in flags
                 for part in (chosen.flags if flag == NATIVE else (flag,)))


def load(source: Path, flags: tuple[str, ...], switch: str, instead: str,
         includes: tuple[Path, ...] = ()) -> ctypes.CDLL | None:
    """The shared library built from `source` with `flags` (-march=native standing for the
    tier's; compiled on first use on this machine, then taken from the cache), or None:
    `$switch` is "0", there is no compiler, or the compile failed (then stderr says so, and
    that `instead` runs). `includes`: the files `source` includes, part of what the cached
    library is keyed by."""
    if os.environ.get(switch, "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    # A kernel built for the tier carries the tier's name: each tier its own cache file.
    stem = f"{source.stem}-{tier().name}" if NATIVE in flags and tier() else source.stem
    flags = (*tier_flags(flags), *os.environ.get("DRESD_KERNEL_FLAGS", "").split())
    text = "\n".join(path.read_text() for path in (source, *includes))
    digest = hashlib.sha256("\n".join([text, *flags, compiler, cpu_key()]).encode())
    folder = Path(os.environ.get("DRESD_KERNEL_DIR") or cache_dir() / "kernels")
    path = folder / f"{stem}-{digest.hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            # The source before the flags: libraries named by flags (-fopenmp's) come after it.
            result = subprocess.run([compiler, str(source), *flags, "-o", str(built)],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                print(f"dresd: could not compile {source.name} ({instead} instead):\n"
                      f"{result.stderr.strip()}", file=sys.stderr)
                return None
            built.replace(path)  # atomic: another process sees a whole library or none
    return ctypes.CDLL(str(path))
