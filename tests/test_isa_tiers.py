"""Kernel tiers (`dresd.kernels.tier`): chosen from the CPU's flags, forced with DRESD_ISA, and
every tier this CPU can be restricted to passes the kernels' exactness tests (each run in a
child process under DRESD_ISA: a process builds one tier)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dresd import host, kernels
from dresd.errors import DresdError

HERE = Path(__file__).parent
DEFAULT = kernels.tier()
# Every tier this CPU runs except the one this process already tests.
OTHERS = [tier.name for tier in kernels.runnable_tiers() if tier != DEFAULT]
needs_other_tiers = pytest.mark.skipif(not OTHERS, reason="this CPU runs one kernel tier")
# avx2vnni differs from avx2 only in quant.c's integer dot, which gives the same integers (the
# bits test below checks it): where both run, avx2's suite covers the pair's float code.
SUITE_TIERS = [name for name in OTHERS if not (name == "avx2vnni" and "avx2" in OTHERS)]

# The exactness tests each tier runs: the kernels against their references, rows alone equal
# to rows in a batch, the quantized outputs recorded before a layout change, every method
# equal to `ar` (bf16 and GGUF), batched equal to alone.
EXACTNESS = ["tests/test_kernel_linear.py", "tests/test_kernel_decoder.py",
             "tests/test_kernel_attention.py", "tests/test_quant_layouts.py",
             "tests/test_gguf.py", "-k",
             "not gemma3 and not cli and not damaged and not packing and not unpacked "
             "and not qwen2"]  # llama-q4_1 against transformers covers the decoder (CI time)


def run_under(tier: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRESD_ISA": tier}
    return subprocess.run([sys.executable, *args], env=env, cwd=HERE.parent,
                          capture_output=True, text=True, timeout=600)


def test_the_default_is_the_best_tier_the_cpu_runs(monkeypatch):
    monkeypatch.delenv("DRESD_ISA", raising=False)
    kernels.tier.cache_clear()
    try:
        runnable = kernels.runnable_tiers()
        assert kernels.tier() == (runnable[0] if runnable else None)
    finally:
        kernels.tier.cache_clear()


def test_tiers_by_flags():
    avx2 = {"avx2", "fma", "f16c"}
    assert [t.name for t in kernels.runnable_tiers(avx2)] == ["avx2"]
    assert [t.name for t in kernels.runnable_tiers(avx2 | {"avx_vnni"})] == ["avx2vnni", "avx2"]
    ice_lake = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
    assert [t.name for t in kernels.runnable_tiers(ice_lake)] == ["avx512vnni", "avx2"]
    assert kernels.runnable_tiers({"sse2", "avx"}) == []
    assert kernels.runnable_tiers({"asimd", "fphp"}) == []  # aarch64 without the dot product
    graviton2 = {"fp", "asimd", "fphp", "asimdhp", "asimddp", "asimdrdm"}
    assert [t.name for t in kernels.runnable_tiers(graviton2)] == ["neon"]
    graviton3 = graviton2 | {"i8mm", "bf16", "sve"}
    assert [t.name for t in kernels.runnable_tiers(graviton3)] == ["neoni8mm", "neon"]


def test_aarch64_features_are_its_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 243.75\n"
                       "Features\t: fp asimd evtstrm aes asimddp i8mm\nCPU implementer\t: 0x41\n")
    assert {"asimd", "asimddp", "i8mm"} <= host.cpu_flags(cpuinfo)


@pytest.mark.parametrize("value, message", [("sse9", "not a kernel tier"),
                                            ("neon", "a tier for aarch64 CPUs|cannot run it"),
                                            ("avx512bf16", "x86_64 CPUs|cannot run it")])
def test_a_tier_the_cpu_cannot_run_is_a_clear_error(monkeypatch, value, message):
    if value in {tier.name for tier in kernels.runnable_tiers()}:
        pytest.skip(f"this CPU runs {value}")
    monkeypatch.setenv("DRESD_ISA", value)
    kernels.tier.cache_clear()
    try:
        with pytest.raises(DresdError, match=message):
            kernels.tier()
    finally:
        kernels.tier.cache_clear()


def test_forced_tiers_build_their_own_libraries(monkeypatch):
    monkeypatch.setenv("DRESD_ISA", "avx2")
    kernels.tier.cache_clear()
    try:
        if kernels.tier() is None:
            pytest.skip("no kernel tier")
        flags = kernels.tier_flags(("-O3", kernels.NATIVE))
        assert "-march=native" not in flags and "-mavx2" in flags and "-mno-avx512f" in flags
    except DresdError:
        pytest.skip("this CPU cannot run avx2")
    finally:
        kernels.tier.cache_clear()


QUANT_BITS = """
import hashlib, sys
import gguf, numpy as np, torch
sys.path.insert(0, "tests")
from gguf_files import random_blocks
from dresd import host, kernels
from dresd.kernels import quant
digest = hashlib.sha256()
rng = np.random.default_rng(3)
for qtype in quant.LAYOUTS:
    n, k = 72, 512
    if qtype in quant.K_QUANTS:  # gguf has no quantizer for these
        raw = random_blocks(qtype, n, k, rng)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    x = (torch.from_numpy(rng.standard_normal((5, k))) * 2).to(torch.bfloat16)
    bias = torch.from_numpy(rng.standard_normal(n)).float()
    for dtype in (torch.float32, torch.bfloat16):
        y = quant.linear(x, qtype, quant.pack(qtype, raw, n, k), n, bias, dtype)
        digest.update(y.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy())
# MXFP4 beyond what gguf's quantizer gives: every code, exponents 0..200 (every third row's
# all 0 or 1: subnormal scales), packed in C
raw = rng.integers(0, 256, (72, 512 // 32, 17), dtype=np.uint8)
raw[..., 0] = rng.integers(0, 201, raw.shape[:2])
raw[::3, :, 0] %= 2
raw = raw.reshape(72, -1)
x = (torch.from_numpy(rng.standard_normal((5, 512))) * 4).to(torch.bfloat16)
packed = quant.pack_blocks(gguf.GGMLQuantizationType.MXFP4, raw, 72, 512)
y = quant.linear(x, gguf.GGMLQuantizationType.MXFP4, packed, 72, None, torch.float32)
digest.update(y.view(torch.int32).numpy())
print(kernels.tier().name, digest.hexdigest())
"""


@needs_other_tiers
def test_quantized_linears_give_the_same_bits_on_every_tier():
    """quant.c's integer dots are exact and its float steps per output the same on every tier
    (its header), so every tier gives the default's bits."""
    results = {}
    for tier in [DEFAULT.name, *OTHERS]:
        done = run_under(tier, "-c", QUANT_BITS)
        assert done.returncode == 0, done.stderr[-3000:]
        name, digest = done.stdout.split()
        assert name == tier
        results[tier] = digest
    assert len(set(results.values())) == 1, results


@needs_other_tiers
@pytest.mark.parametrize("tier", SUITE_TIERS)
def test_exactness_tests_pass_on_every_tier(tier):
    done = run_under(tier, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *EXACTNESS)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], \
        done.stdout[-2000:]

