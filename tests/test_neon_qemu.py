"""The aarch64 tiers (`neon`, `neoni8mm`) of dresd's C kernels, run under qemu-aarch64: every
GGUF layout's quantized linear, the bf16 linear and attention against the x86 tests' float64
references, rows bit for bit the same alone and in a batch at 1 to 3 threads, the whole C
decoder (Llama's and Gemma's layers, bf16 and quantized) and the drafting kernels, and every
output bit for bit the x86 avx2 tier's (tests/kernels_c/harness.py says why and how).

Skips where `aarch64-linux-gnu-gcc` or `qemu-aarch64` is absent: `make test-neon` installs
them (Debian: gcc-aarch64-linux-gnu, libc6-dev-arm64-cross, qemu-user) and runs this."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "kernels_c"))
import harness  # noqa: E402

MISSING = harness.missing_tools()


@pytest.mark.subprocess  # cross-compiles, and runs qemu-aarch64 (~25 s on 2 cores)
@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
def test_kernels_under_qemu_aarch64(tmp_path):
    report = harness.run(tmp_path)
    print(report.summary())
    assert not report.failed, report.summary()
    # every tier ran every check: the references, the batch checks, the other kernels' build
    assert len(report.passed) >= 2 * 200, report.summary()


def test_the_c_decoder_is_built_on_aarch64_as_on_x86(monkeypatch):
    """On an aarch64 tier the C decoder is built as on x86 (its whole forward ran under qemu
    above); kernels.load is where DRESD_CPU_DECODER=0 turns it off, on every tier."""
    from dresd import kernels
    from dresd.kernels import attention, decoder, linear

    neon = next(tier for tier in kernels.TIERS if tier.name == "neon")
    monkeypatch.setattr(kernels, "tier", lambda: neon)
    monkeypatch.setattr(linear, "kernel", lambda: object())
    monkeypatch.setattr(attention, "kernel", lambda: object())
    monkeypatch.delenv("DRESD_CPU_DECODER", raising=False)
    built = []
    monkeypatch.setattr(kernels, "load", lambda source, flags, switch, *args, **kw:
                        built.append((source.name, switch)))  # None: no library here
    decoder.kernel.cache_clear()
    try:
        assert decoder.kernel() is None
        assert built == [("decoder.c", "DRESD_CPU_DECODER")]
    finally:
        decoder.kernel.cache_clear()
