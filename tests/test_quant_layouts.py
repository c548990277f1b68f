"""quant.c's packed layouts: what they cost in memory beside the file, and that a change of
layout never changes an output.

The five-bit types (Q5_0, Q5_1, Q5_K: Gemma-3-1B's 1152-wide rows in a Q4_0 or Q4_K_M file)
were once packed a byte a weight, 1.55x the file's bytes; they are now nibbles plus one plane of
the fifth bit (quant.c's header). The integer dots are exact, so the layout moves no output:
the digests below were recorded from the byte layout, on inputs made from integer formulas
(no random generator whose stream a numpy or torch release could change), and every tier gives
the same bits (tests/test_isa_tiers.py)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

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
    for first in SCALES[qtype]:
        bits = np.uint16(0x1010) + (scale_index * np.uint16(37) + np.uint16(first)) % 1024
        raw[..., first:first + 2] = bits.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def formula_rows(rows: int, k: int) -> torch.Tensor:
    """bf16 [rows, k]: multiples of 1/32 up to 4 in size, exact in bf16."""
    m, j = np.meshgrid(np.arange(rows), np.arange(k), indexing="ij")
    return torch.from_numpy(((m * 131 + j * 71) % 257 - 128) / 32.0).to(torch.bfloat16)


# sha256 (first 16 hex digits) of the float32 outputs of 1, 2, 3 and 5 rows (one call each) of
# a 50 x 512 layer on formula_blocks, as the byte layout gave them before the five-bit layout.
RECORDED = {
    "Q4_0": "7fd7c96b33b22a45", "Q4_1": "d0137b6c9b20204e", "Q8_0": "b30335ccd6577c30",
    "Q5_0": "082c7460103e27d9", "Q5_1": "b043d3d1af51b06e", "Q4_K": "604aecc11fed51d3",
    "Q5_K": "4053bbdbdacfbe18", "Q6_K": "3673a8eb34c2bc29",
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


@pytest.mark.parametrize("qtype", [*FIVE_BITS, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_packed_types_take_the_files_bytes(qtype):
    """Q5_0, Q5_1 and the K-quants take the file's bytes exactly once rows are padded to whole
    groups of 32 (per 32 weights of 16 rows: 256 bytes of nibbles, 64 of fifth bits, the float16
    scales; Q4_K and Q5_K: their 12 bytes of six-bit scales and minimums kept as the file packs
    them, in the superblock's header: 144 and 176 bytes a row per 256)."""
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
def test_packing_lets_a_read_only_files_pages_go(tmp_path):
    """Each packing thread drops the file pages of the rows it has packed as it goes (Gemma-3's
    320 MB tied head no longer resident beside its packed copy): the same bytes as numpy's
    `pack`, the mapping's pages gone after (3 MB: dropped 1 MB at a time, threads' boundaries
    inside pages), its values still the file's."""
    qtype, n, k = Q.Q5_0, 4500, 1024  # 704 bytes a row
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
