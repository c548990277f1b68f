"""The aarch64 tiers (`neon`, `neoni8mm`) of dresd's C kernels, run under qemu-aarch64: every
GGUF layout's quantized linear, the bf16 linear and attention against the x86 tests' float64
references, rows bit for bit the same alone and in a batch at 1 to 3 threads, the whole C
decoder (Llama's and Gemma's layers, bf16 and quantized) and the drafting kernels, and every
output bit for bit the x86 avx2 tier's (tests/kernels_c/harness.py says why and how). MXFP4
runs there on gguf's quantized blocks, and here besides over every code and a wide range of
exponents, subnormal scales included (`mxfp4_cases`).

Skips where `aarch64-linux-gnu-gcc` or `qemu-aarch64` is absent: `make test-neon` installs
them (Debian: gcc-aarch64-linux-gnu, libc6-dev-arm64-cross, qemu-user) and runs this."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "kernels_c"))
import harness  # noqa: E402

MISSING = harness.missing_tools()


def mxfp4_cases(suite: harness.Suite) -> None:
    """MXFP4 beyond the exponents gguf's quantizer gives (the harness's own MXFP4 case): random
    codes, e 0..200, whole rows of subnormal scales (e 0, 1), of the least normal (2) and of
    2^72 (200). Packed in C as numpy packs; against the header's float64 sum per output (each
    on its own scale, as tests/test_quant_layouts.py); rows alone = in calls of 2..13 rows at
    1 to 3 threads; and, through the harness, every output the avx2 tier's bits."""
    quant = harness.quant
    qtype, n, k, rows = quant.Q.MXFP4, 50, 256, 13
    layout = quant.LAYOUTS[qtype].number
    rng = np.random.default_rng(17)
    raw = rng.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(0, 201, (n, k // 32))
    raw[1::5, :, 0] %= 2
    raw[2::5, :, 0] = 2
    raw[3::5, :, 0] = 200
    raw = raw.reshape(n, -1)
    expected_packing = quant.pack(qtype, raw, n, k).numpy()
    packed, expected_bytes = suite.array(expected_packing), expected_packing.tobytes()
    for t in (1, 2):
        packing = suite.job("pack", layout, n, k, t, suite.array(raw))

        def packed_as_numpy(out, packing=packing):
            assert out[packing] == expected_bytes
        suite.check(f"MXFP4 (every exponent): packed in C at {t} threads = numpy",
                    packed_as_numpy)
    x = (torch.from_numpy(rng.standard_normal((rows, k))) * 4).to(torch.bfloat16)
    whole = suite.job("quant", layout, rows, k, n, 0, 1, suite.array(x), packed, "-")
    xq, dx = harness.quantized_rows(x.float().numpy())
    weight = quant.dequantize(qtype, raw, n, k).astype(np.float64)
    per_block = np.einsum("mbj,nbj->mnb", xq.reshape(rows, -1, 32), weight.reshape(n, -1, 32))
    expected = (per_block * dx[:, None, :]).sum(axis=2)

    def against_sum(out, whole=whole, expected=expected):
        got = np.frombuffer(out[whole], dtype=np.float32).reshape(-1, n).astype(np.float64)
        scale = np.abs(expected).max(axis=0)  # per output: 2^-118 to 2^80
        assert (np.abs(got - expected).max(axis=0) <= 1e-5 * scale).all()
    suite.check("MXFP4 (every exponent): the header's sum (float64), per output", against_sum)
    bias_file = suite.array(torch.from_numpy(rng.standard_normal(n)).float())
    alone = [suite.job("quant", layout, 1, k, n, 1, 1, suite.array(x[m:m + 1]), packed,
                       bias_file) for m in range(rows)]
    for count in (2, 5, 13):
        for t in (1, 3):
            batch = suite.job("quant", layout, count, k, n, 1, t, suite.array(x[:count]),
                              packed, bias_file)

            def invariant(out, batch=batch, count=count):
                assert out[batch] == b"".join(out[a] for a in alone[:count])
            suite.check(f"MXFP4 (every exponent): {count} rows at {t} threads = alone",
                        invariant)


@pytest.mark.subprocess  # cross-compiles, and runs qemu-aarch64 (~25 s on 2 cores)
@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
def test_kernels_under_qemu_aarch64(tmp_path, monkeypatch):
    quant_cases = harness.quant_cases  # the harness's quantized cases, then MXFP4's above
    monkeypatch.setattr(harness, "quant_cases",
                        lambda suite: (quant_cases(suite), mxfp4_cases(suite)))
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
