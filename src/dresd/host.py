"""Facts about the machine dresd runs on: where it caches files, what the CPU is, file hashes.

A leaf module (it imports no other dresd module), so that everything that needs one of these
facts (the model loader, the fast path, the attention kernel, the datastores, calibration) can
import it without importing each other.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import hashlib
import os
import platform
from collections.abc import Iterator
from pathlib import Path

# CPU flags (as /proc/cpuinfo names them) for native bf16 matrix multiplication.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cache_dir() -> Path:
    """Where dresd keeps converted models and other downloads (`$DRESD_CACHE` moves it)."""
    return Path(os.environ.get("DRESD_CACHE", Path.home() / ".cache" / "dresd"))


def cpuinfo_field(field: str, cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """The first `field : value` of /proc/cpuinfo (None where it or the field does not exist,
    e.g. on macOS)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, colon, value = line.partition(":")
        if colon and name.strip() == field:
            return value.strip()
    return None


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags: x86's `flags`, aarch64's `Features` (`asimd asimddp ...`);
    empty where /proc/cpuinfo does not exist, e.g. macOS."""
    return set((cpuinfo_field("flags", cpuinfo) or cpuinfo_field("Features", cpuinfo)
                or "").split())


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU's model name, for reports (`AMD EPYC 9R14 96-Core Processor`); else its
    architecture."""
    return cpuinfo_field("model name", cpuinfo) or platform.machine()


def native_bf16_flags() -> list[str]:
    """The native-bf16 flags this CPU has, in `NATIVE_BF16_FLAGS` order."""
    flags = cpu_flags()
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def libc_function(name: str):
    """The C library's function `name` (glibc's `malloc_trim`, `mallopt`), or None where it has
    none (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


# glibc's mallopt parameters (malloc.h) and the largest threshold its dynamic rule reaches
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
DYNAMIC_MMAP_THRESHOLD_MAX = 32 << 20


@contextlib.contextmanager
def large_allocations_mapped(threshold: int = 1 << 20) -> Iterator[None]:
    """While loading, every C allocation of `threshold` bytes or more gets pages of its own
    (mmap), returned to the system when it is freed. Why: loading allocates and frees buffers
    of tens of MB (a layer's packed weights, then the fused copy of its projections), and
    glibc's dynamic rule soon serves such sizes from the heap, where what is freed stays
    resident beside what is allocated next: a Llama-3.2-3B Q4_K_M file peaked 157 MB higher.
    Afterwards the threshold is the one the dynamic rule ends at (and the trim threshold twice
    it, as that rule sets it): kept mapped at run time, large prefill buffers cost 7-9% of the
    prefill's speed in page faults. The setting is the process's: a load beside running
    requests maps their large buffers too for its while (slower, never other results)."""
    mallopt = libc_function("mallopt")
    if mallopt is None:
        yield
        return
    mallopt(M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, DYNAMIC_MMAP_THRESHOLD_MAX)
        mallopt(M_TRIM_THRESHOLD, 2 * DYNAMIC_MMAP_THRESHOLD_MAX)


def give_back_free_heap() -> None:
    """Collect what is garbage, then hand the C heap's free pages back to the system
    (glibc's `malloc_trim`; nothing elsewhere). Why: a load frees large transient objects (a GGUF
    header's vocabulary as Python strings, the tokenizer library's parsed JSON) whose pages the
    allocator otherwise keeps resident, and the weights packed next would stack on top of them
    at the load's peak (measured on a 262k vocabulary: 25-30 MB each)."""
    gc.collect()
    trim = libc_function("malloc_trim")
    if trim is not None:
        trim(0)
