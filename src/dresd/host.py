"""Facts about the machine dresd runs on: where it caches files, what the CPU is, file hashes.

A leaf module (it imports no other dresd module), so that everything that needs one of these
facts (the model loader, the fast path, the attention kernel, the datastores, calibration) can
import it without importing each other.
"""

from __future__ import annotations

import hashlib
import os
import platform
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
