"""Compiling and loading dresd's C kernels (`attention.c`, `linear.c`, `decoder.c`), shared by all.

A kernel is compiled once per machine with the system C compiler (`cc`, or `$CC`) into the
cache (`$DRESD_CACHE/kernels/`), keyed by its source, the compiler flags, the compiler and the
CPU (-march=native compiles for this CPU only), and loaded with ctypes. Where there is no
compiler, or the compile fails, `load` returns None and the caller keeps its PyTorch path.

`$DRESD_KERNEL_FLAGS` adds compiler flags to every kernel's and `$DRESD_KERNEL_DIR` builds them
elsewhere: the sanitizer test (`tests/test_gguf_distrust.py`) builds them with
`-fsanitize=address,undefined` and runs the kernels' tests against that build.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dresd.host import cache_dir, cpu_flags, cpu_model

BF16_HEADER = Path(__file__).with_name("bf16.h")  # included by linear.c and quant.c


def cpu_key() -> str:
    """What -march=native compiles for: the CPU's model name and flags."""
    return "\n".join([cpu_model(), *sorted(cpu_flags())])


def load(source: Path, flags: tuple[str, ...], switch: str, instead: str,
         includes: tuple[Path, ...] = ()) -> ctypes.CDLL | None:
    """The shared library built from `source` with `flags` (compiled on first use on this
    machine, then taken from the cache), or None: `$switch` is "0", there is no compiler, or
    the compile failed (then stderr says so, and that `instead` runs). `includes`: the files
    `source` includes, part of what the cached library is keyed by."""
    if os.environ.get(switch, "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    flags = (*flags, *os.environ.get("DRESD_KERNEL_FLAGS", "").split())
    text = "\n".join(path.read_text() for path in (source, *includes))
    digest = hashlib.sha256("\n".join([text, *flags, compiler, cpu_key()]).encode())
    folder = Path(os.environ.get("DRESD_KERNEL_DIR") or cache_dir() / "kernels")
    path = folder / f"{source.stem}-{digest.hexdigest()[:16]}.so"
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
