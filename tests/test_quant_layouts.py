"""quant.c's packed layouts: what they cost in memory beside the file, and that a change of
layout never changes an output.

The five-bit types (Q5_0, Q5_1, Q5_K: Gemma-3-1B's 1152-wide rows in a Q4_0 or Q4_K_M file)
were once packed a byte a weight, 1.55x the file's bytes; they are now nibbles plus one plane of
the fifth bit (quant.c's header). The integer dots are exact, so the layout moves no output:
the digests below were recorded from the byte layout, on inputs made from integer formulas
(no random generator whose stream a numpy or torch release could change), and every tier gives
the same bits (tests/test_isa_tiers.py).

MXFP4 (gpt-oss's expert weights) keeps the file's 17 bytes a row per 32 weights: its E2M1 codes
as nibbles, looked up in the kernel, and its E8M0 scale bytes. Its tests below hold it to the
`gguf` package's values bit for bit over every code and exponent (subnormal scales included),
to the float64 sum quant.c's header states, and to batch invariance; its digest was recorded
when it came."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from dresd.kernels import quant

pytestmark = pytest.mark.skipif(quant.kernel() is None,
                                reason="the quantized kernel needs a kernel tier and a compiler")
FIVE_BITS = [Q.Q5_0, Q.Q5_1, Q.Q5_K]
# Where each type keeps its float16 scales in a block (bytes): d, and m or dmin.
SCALES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
          Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def formula_blocks(qtype: Q, n: int, k: int) -> np.ndarray:
    """uint8 [n, bytes per row]: every byte from a multiplicative hash of its index, then each
    block's float16 scales set to small finite values (0.0005 to 0.001)."""
    block, size = GGML_QUANT_SIZES[qtype]
    index = np.arange(n * (k // block) * size, dtype=np.uint64)
    raw = (((index * np.uint64(2654435761)) >> np.uint64(13)) & np.uint64(255)).astype(np.uint8)
    raw = raw.reshape(n, k // block, size)
    scale_index = np.arange(n * (k // block), dtype=np.uint16).reshape(n, k // block)
    for first in SCALES.get(qtype, ()):
        bits = np.uint16(0x1010) + (scale_index * np.uint16(37) + np.uint16(first)) % 1024
        raw[..., first:first + 2] = bits.view(np.uint8).reshape(n, k // block, 2)
    if qtype == Q.MXFP4:  # E8M0 exponents 112..135: scales 2^-16 to 2^7
        raw[..., 0] = (112 + scale_index * np.uint16(37) % 24).astype(np.uint8)
    return raw.reshape(n, -1)


def formula_rows(rows: int, k: int) -> torch.Tensor:
    """bf16 [rows, k]: multiples of 1/32 up to 4 in size, exact in bf16."""
    m, j = np.meshgrid(np.arange(rows), np.arange(k), indexing="ij")
    return torch.from_numpy(((m * 131 + j * 71) % 257 - 128) / 32.0).to(torch.bfloat16)


# sha256 (first 16 hex digits) of the float32 outputs of 1, 2, 3 and 5 rows (one call each) of
# a 50 x 512 layer on formula_blocks, as the byte layout gave them before the five-bit layout
# (MXFP4: as its layout gave them when it came, on the avx2 tier).
RECORDED = {
    "Q4_0": "7fd7c96b33b22a45", "Q4_1": "d0137b6c9b20204e", "Q8_0": "b30335ccd6577c30",
    "Q5_0": "082c7460103e27d9", "Q5_1": "b043d3d1af51b06e", "Q4_K": "604aecc11fed51d3",
    "Q5_K": "4053bbdbdacfbe18", "Q6_K": "3673a8eb34c2bc29", "MXFP4": "62fc154b8f825835",
}


@pytest.mark.parametrize("qtype", list(quant.LAYOUTS), ids=lambda t: t.name)
def test_outputs_are_the_ones_recorded_before_the_five_bit_layout(qtype):
    n, k = 50, 512  # 50 outputs: a group and part of one; two K-quant superblocks
    packed = quant.pack_blocks(qtype, formula_blocks(qtype, n, k), n, k)
    digest = hashlib.sha256()
    for rows in (1, 2, 3, 5):  # tiles of 1, 2, 3 and 4 + 1 rows
        y = quant.linear(formula_rows(rows, k), qtype, packed, n, out_dtype=torch.float32)
        digest.update(y.view(torch.int32).numpy().tobytes())
    assert digest.hexdigest()[:16] == RECORDED[qtype.name]


@pytest.mark.parametrize("qtype", [*FIVE_BITS, Q.Q4_K, Q.Q6_K, Q.MXFP4], ids=lambda t: t.name)
def test_packed_types_take_the_files_bytes(qtype):
    """Q5_0, Q5_1, the K-quants and MXFP4 take the file's bytes exactly once rows are padded to
    whole groups of 32 (per 32 weights of 16 rows: 256 bytes of nibbles, 64 of fifth bits, the
    float16 scales; Q4_K and Q5_K: their 12 bytes of six-bit scales and minimums kept as the file
    packs them, in the superblock's header: 144 and 176 bytes a row per 256; MXFP4: 256 bytes of
    E2M1 codes and 16 E8M0 bytes, 17 bytes a row per 32)."""
    block, size = GGML_QUANT_SIZES[qtype]
    for n, k in [(32, 256), (1152, 1152 if block == 32 else 1280), (50, 6912 // 256 * 256)]:
        padded = -(-n // quant.GROUP) * quant.GROUP
        assert quant.packed_bytes(qtype, n, k) == padded * (k // block) * size


@pytest.mark.parametrize("qtype", list(quant.LAYOUTS), ids=lambda t: t.name)
def test_c_and_python_layouts_agree_on_a_groups_bytes(qtype):
    """quant.c fills, and reads, the buffer quant.py sizes: one table in each language."""
    layout = quant.LAYOUTS[qtype]
    for k in (256, 512, 2048, 6912):
        assert quant.kernel().dresd_quant_group_bytes(layout.number, k) == layout.group_bytes(k)


def mapped_kb(path) -> int:
    """This process's resident kB of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:  # a mapping's header
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_DONTNEED"), reason="no madvise")
@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.MXFP4], ids=lambda t: t.name)
def test_packing_lets_a_read_only_files_pages_go(tmp_path, qtype):
    """Each packing thread drops the file pages of the rows it has packed as it goes (Gemma-3's
    320 MB tied head no longer resident beside its packed copy): the same bytes as numpy's
    `pack`, the mapping's pages gone after (3 MB: dropped 1 MB at a time, threads' boundaries
    inside pages), its values still the file's."""
    n, k = 4500, 1024  # 704 bytes a row (Q5_0), 544 (MXFP4)
    raw = formula_blocks(qtype, n, k)
    path = tmp_path / "tensor.bin"
    path.write_bytes(raw.tobytes())
    mapped = np.asarray(np.memmap(path, np.uint8, mode="r").reshape(n, -1))
    assert int(mapped.sum(dtype=np.int64)) == int(raw.sum(dtype=np.int64))  # every page read
    assert mapped_kb(path) >= raw.nbytes // 1024
    packed = quant.pack_blocks(qtype, mapped, n, k)
    assert torch.equal(packed, quant.pack(qtype, raw, n, k))
    assert mapped_kb(path) == 0
    assert np.array_equal(mapped, raw)  # read again from the file


def test_packing_leaves_memory_that_is_not_the_files_alone(tmp_path):
    """An array of its own, and a copy-on-write mapping written to, keep their pages (dropped,
    they would read as zeros or as the file, not as what they hold)."""
    qtype, n, k = Q.Q5_0, 3000, 1024
    raw = formula_blocks(qtype, n, k)
    own = raw.copy()
    assert torch.equal(quant.pack_blocks(qtype, own, n, k), quant.pack(qtype, raw, n, k))
    assert np.array_equal(own, raw)
    path = tmp_path / "tensor.bin"
    path.write_bytes(raw.tobytes())
    written = np.memmap(path, np.uint8, mode="c").reshape(n, -1)
    written[:, 2:] ^= 0x5A  # the quants, not the scales
    expected = quant.pack(qtype, np.array(written), n, k)
    assert torch.equal(quant.pack_blocks(qtype, np.asarray(written), n, k), expected)
    assert not np.array_equal(np.asarray(written), raw)


# --- MXFP4: E2M1 codes looked up in the kernel, E8M0 scale bytes ---------------------------

# E8M0 exponents the tests hold: the subnormal scales 2^-128 and 2^-127 (e = 0, 1), the least
# normal, 2^-1 and 1 (127, 128: 2^(e - 128) is half the E8M0 value, kvalues being 2 x E2M1),
# 2^72, and 2^126, whose largest weights overflow float32 in gguf's dequantizer as in ours.
EXPONENTS = (0, 1, 2, 127, 128, 200, 254)


def mxfp4_blocks(n: int, k: int, rng: np.random.Generator, top: int = 254) -> np.ndarray:
    """uint8 [n, k / 32 * 17]: random codes (every byte of qs random), each block's e drawn
    from 0..top, with rows whose scales are all subnormal (e 0, 1) and rows of one exponent of
    EXPONENTS (those up to top) among them."""
    raw = rng.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(0, top + 1, (n, k // 32))
    raw[1::5, :, 0] %= 2  # subnormal scales only
    held = [e for e in EXPONENTS if e <= top]
    for i, e in enumerate(held):  # rows 2, 7, 12, ...: one exponent each
        raw[2 + 5 * i:3 + 5 * i, :, 0] = e
    return raw.reshape(n, -1)


def test_mxfp4_values_are_the_gguf_packages_bit_for_bit():
    """quant.py's unpacked w = d (q - 12), q = 2v + 12 from the code's table entry and
    d = 2^(e - 128) from the E8M0 byte, is gguf's dequantized MXFP4 in every bit, over every
    code and every exponent (NaN's 255 aside), the subnormal scales of e = 0 and 1 included."""
    n, k = 64, 1024
    raw = mxfp4_blocks(n, k, np.random.default_rng(7))
    blocks = raw.reshape(n, -1, 17)
    blocks.reshape(-1, 17)[-255:, 0] = np.arange(255)  # every exponent, the last 8 rows
    codes = np.concatenate([blocks[..., 1:] & 15, blocks[..., 1:] >> 4], axis=-1)
    assert set(np.unique(codes)) == set(range(16))
    assert set(EXPONENTS) <= set(np.unique(blocks[..., 0]))
    with np.errstate(over="ignore"):  # 2^126 x 12 and the like: inf in both
        expected = gguf_dequantize(raw, Q.MXFP4).reshape(n, k)
        got = quant.dequantize(Q.MXFP4, raw, n, k)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    q, d, c = quant.unpack(Q.MXFP4, raw, n, k)
    assert c is None and q.max() <= 24 and quant.LAYOUTS[Q.MXFP4].offset == 12
    assert (d.view(np.uint32) != 0).all()  # e = 0, 1: subnormal, not flushed to zero


def x_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    """bf16 [rows, k] of normal numbers up to ~16 in size."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=generator) * 4).to(torch.bfloat16)


def header_sum(qtype: Q, raw: np.ndarray, n: int, k: int, x: torch.Tensor) -> np.ndarray:
    """The sum quant.c's header states, in float64 (tests/test_gguf.py's): the weights as
    dequantized, times the rows quantized to 8 bits per block of 32, times each block's dx."""
    rows = x.shape[0]
    blocks = x.float().numpy().reshape(rows, -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.maximum(amax, 1e-30), 0).astype(np.float32)
    xq = np.rint((blocks * inverse).astype(np.float32))
    dx = (amax / np.float32(127))[..., 0]
    weight = quant.dequantize(qtype, raw, n, k).astype(np.float64)
    per_block = np.einsum("mbj,nbj->mnb", xq, weight.reshape(n, -1, 32))
    return (per_block * dx[:, None, :]).sum(axis=2)


def test_mxfp4_kernel_computes_the_sum_its_header_states():
    """The kernel's outputs against the header's float64 sum, within the other types' tolerance
    (1e-5 of the largest |value|), taken per output: its weight row's exponents may be all
    subnormal (outputs ~2^-118) or reach 2^72, and each must be right on its own scale. Up to
    e = 200: beyond ~238 the kernel's float32 d x dot overflows (quant.c's header)."""
    n, k = 50, 512  # a group and part of one
    raw = mxfp4_blocks(n, k, np.random.default_rng(8), top=200)
    x = x_rows(5, k, seed=8)
    expected = header_sum(Q.MXFP4, raw, n, k, x)
    for packed in (quant.pack(Q.MXFP4, raw, n, k), quant.pack_blocks(Q.MXFP4, raw, n, k)):
        got = quant.linear(x, Q.MXFP4, packed, n, out_dtype=torch.float32).double().numpy()
        scale = np.abs(expected).max(axis=0)  # per output
        assert (scale > 0).all() and np.isfinite(got).all()
        assert (np.abs(got - expected).max(axis=0) <= 1e-5 * scale).all()
    assert np.abs(expected[:, 1::5]).max() < 2.0**-100  # the subnormal rows ran as such


def test_mxfp4_rows_do_not_depend_on_the_rows_beside_them():
    """A row's bits alone = among 2..13 rows, at 1 and 2 threads (tests/test_gguf.py's check)."""
    n, k = 70, 256
    raw = mxfp4_blocks(n, k, np.random.default_rng(9), top=200)
    packed = quant.pack_blocks(Q.MXFP4, raw, n, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(9))
    x = x_rows(13, k, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([quant.linear(x[i:i + 1], Q.MXFP4, packed, n, bias)
                           for i in range(13)])
        for count in (2, 3, 4, 5, 8, 13):
            for t in (1, 2):
                torch.set_num_threads(t)
                assert torch.equal(quant.linear(x[:count], Q.MXFP4, packed, n, bias),
                                   alone[:count])
    finally:
        torch.set_num_threads(threads)


def test_mxfp4_packing_in_c_gives_numpys_bytes():
    """quant.c's packer (what loading runs) = quant.py's `pack`: rows farther apart than their
    bytes (a mapped slice), rows ending part way into a group, 1 and 2 threads; every e byte,
    255 too, kept as it is."""
    rng = np.random.default_rng(10)
    threads = torch.get_num_threads()
    try:
        for n, k in [(1, 32), (33, 512), (200, 768)]:
            wide = rng.integers(0, 256, (n, k // 32 * 17 + 40), dtype=np.uint8)
            raw = wide[:, 40:]
            expected = quant.pack(Q.MXFP4, np.ascontiguousarray(raw), n, k)
            assert expected.numel() == -(-n // quant.GROUP) * quant.GROUP * k // 32 * 17
            for t in (1, 2):
                torch.set_num_threads(t)
                assert torch.equal(quant.pack_blocks(Q.MXFP4, raw, n, k), expected), (n, k)
    finally:
        torch.set_num_threads(threads)
