"""Linear layers on GGUF-quantized weights, batch-invariant, in C (the kernel: `quant.c`).

A GGUF file keeps a weight as blocks of 32 (or 256) numbers: small integers and a scale per
block. `unpack` reads a tensor's blocks into the form every supported type shares,

    w[n, k] = d[n, b] * q[n, k] + c[n, b]        (b = k // 32, q unsigned)

and `pack` lays that out once for the kernel (`quant.c`'s header), panel by panel. The weights
stay quantized: a Q4_1 layer keeps its 20 bytes per 32 weights, a Q5_0 layer its 22 (nibbles
and a plane of fifth bits), a Q8_0 layer its 34, an MXFP4 layer (gpt-oss's experts) its 17 (the
E2M1 codes as nibbles, looked up in the kernel, and the E8M0 scale byte).

`quant.c` multiplies by quantizing each row of activations to 8 bits per block of 32 (as
llama.cpp does) and summing in a fixed order, so a row's output never depends on the rows
beside it: every exactness rule of the bf16 kernels holds for a quantized model.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from dresd import kernels
from dresd.errors import DresdError
from dresd.kernels import HEADERS

SOURCE = Path(__file__).with_name("quant.c")
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC", "-fopenmp")
LANES = 16  # outputs per panel (quant.c's QLANES)
PARTS = 2  # panels per group (quant.c's QPARTS)
GROUP = LANES * PARTS  # outputs per group: a packed tensor's rows are padded to whole groups
BLOCK = 32  # k per block (quant.c's QBLOCK)

Q = GGMLQuantizationType


@dataclass(frozen=True)
class Layout:
    """How `quant.c` stores one type's blocks (its LAYOUTS table, by `number`)."""

    number: int
    nibbles: bool  # 4-bit quants, else bytes
    half: bool  # float16 scales, else float32
    has_min: bool  # c stored, else c = -offset * d
    offset: int = 0
    halves: bool = False  # d per 16 k (Q6_K), else per 32
    kquant: bool = False  # superblock headers and integer scales (K-quants)
    six: bool = False  # nibbles and two planes of 2-bit high parts (Q6_K)
    five: bool = False  # nibbles and a plane of each weight's bit 4 (Q5_0, Q5_1, Q5_K)
    e2m1: bool = False  # nibbles of E2M1 codes (q = E2M1_Q[code]), d an E8M0 byte (MXFP4)

    def quant_bytes(self) -> int:
        return 384 if self.six else 320 if self.five else 256 if self.nibbles else 512

    def block_bytes(self) -> int:
        """One panel's bytes of one block of 32 k: its quants and scales (Q4_K and Q5_K keep
        theirs in the header)."""
        if self.kquant:
            return self.quant_bytes() + (0 if self.has_min else 32)
        if self.e2m1:  # the file's E8M0 bytes, one a lane
            return self.quant_bytes() + LANES
        scales = (32 if self.half else 64) * (2 if self.has_min else 1) * (2 if self.halves else 1)
        return self.quant_bytes() + scales

    def header_bytes(self) -> int:
        """One panel's header per 256 k (K-quants): dsuper; Q4_K, Q5_K: dmin and the file's
        12 bytes of scales and minimums, 16 lanes each."""
        if not self.kquant:
            return 0
        return 64 + 12 * LANES if self.has_min else 32

    def group_bytes(self, k: int) -> int:
        """One group's bytes over k inputs (quant.c's dresd_quant_group_bytes): its blocks and,
        for K-quants, a header per panel per 256 k."""
        return PARTS * ((k // BLOCK) * self.block_bytes() + (k // 256) * self.header_bytes())


# The weight types that run natively, and the layout each is packed in.
LAYOUTS: dict[Q, Layout] = {
    Q.Q4_0: Layout(0, nibbles=True, half=True, has_min=False, offset=8),
    Q.Q4_1: Layout(1, nibbles=True, half=True, has_min=True),
    Q.Q8_0: Layout(2, nibbles=False, half=True, has_min=False, offset=128),
    Q.Q5_0: Layout(3, nibbles=True, half=True, has_min=False, offset=16, five=True),
    Q.Q5_1: Layout(4, nibbles=True, half=True, has_min=True, five=True),
    Q.Q4_K: Layout(5, nibbles=True, half=True, has_min=True, kquant=True),
    Q.Q5_K: Layout(6, nibbles=True, half=True, has_min=True, kquant=True, five=True),
    Q.Q6_K: Layout(7, nibbles=True, half=True, has_min=False, offset=32, halves=True,
                   kquant=True, six=True),
    Q.MXFP4: Layout(8, nibbles=True, half=False, has_min=False, offset=12, e2m1=True),
}

# MXFP4: q = 2v + 12 for each E2M1 code's value v (ggml's kvalues_mxfp4, which are 2v, + 12),
# so that w = d * (q - 12) with d = 2^(e - 128) (quant.c's E2M1_Q).
E2M1_Q = np.array([12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0], np.uint8)


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel for this process's tier (compiled on first use, then cached), or
    None where it cannot be (no kernel tier: a CPU without AVX2; no compiler; or
    DRESD_CPU_QUANT=0)."""
    if kernels.tier() is None:
        return None
    library = kernels.load(SOURCE, FLAGS, "DRESD_CPU_QUANT", "no quantized linears",
                           includes=HEADERS)
    if library is None:
        return None
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.dresd_quant_linear.argtypes = [i32, pointer, i64, i32, i32, pointer, i32, pointer,
                                           pointer, i64, i32, i32]
    library.dresd_quant_linear.restype = i32
    library.dresd_quant_pack.argtypes = [i32, pointer, i64, i32, i32, pointer, i32, i32]
    library.dresd_quant_pack.restype = i32
    library.dresd_quant_group_bytes.argtypes = [i32, i32]
    library.dresd_quant_group_bytes.restype = i64
    return library


# --- reading GGUF blocks -------------------------------------------------------------------

def _half(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 from [..., 2] bytes."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] quants: the low nibbles are k 0..15, the high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] bits, bit j for k = j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit minimums, one per 32."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float32 2^(e - 128), half the E8M0 value, exactly: bits (e - 1) << 23 for
    e >= 2, the subnormals 2^-128 and 2^-127 for e = 0, 1 (ggml's ggml_e8m0_to_fp32_half)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << np.minimum(e, 2),
                    (np.maximum(e, 1) - 1) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def unpack_mxfp4(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 blocks as the file keeps them: (codes uint8 [n, k], each an E2M1 code 0..15; e
    uint8 [n, k / 32], each block's E8M0 byte). A block is e, then 16 bytes whose low nibbles
    are k 0..15 and high 16..31 (gguf's MXFP4, ggml's block_mxfp4)."""
    blocks = raw.reshape(n, k // BLOCK, 1 + BLOCK // 2)
    return _nibbles(blocks[..., 1:]).reshape(n, k), blocks[..., 0]


def unpack(qtype: Q, raw: np.ndarray, n: int, k: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A tensor's raw blocks (uint8 [n, bytes per row]) -> (q uint8 [n, k], d [n, k / 32],
    c [n, k / 32] or None), with w = d * q + c (c None: c = -offset * d, the layout's offset).
    d and c are float16 where the file keeps them so, else float32 (K-quants: d * scale;
    MXFP4: 2^(e - 128), its q = 2v + 12 for the E2M1 value v); Q6_K's d is per 16 k: [n, k / 16]."""
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(n, k // block, size)
    if qtype == Q.MXFP4:
        codes, e = unpack_mxfp4(raw, n, k)
        return E2M1_Q[codes], _e8m0_half(e), None
    if qtype == Q.Q4_0:
        return _nibbles(blocks[..., 2:]).reshape(n, k), _half(blocks[..., 0:2]), None
    if qtype == Q.Q4_1:
        q = _nibbles(blocks[..., 4:]).reshape(n, k)
        return q, _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    if qtype == Q.Q8_0:
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q.reshape(n, k), _half(blocks[..., 0:2]), None
    if qtype in (Q.Q5_0, Q.Q5_1):
        first = 2 if qtype == Q.Q5_0 else 4
        q = _nibbles(blocks[..., first + 4:]) | (_high_bits(blocks[..., first:first + 4]) << 4)
        c = None if qtype == Q.Q5_0 else _half(blocks[..., 2:4])
        return q.reshape(n, k), _half(blocks[..., 0:2]), c
    if qtype in K_QUANTS:  # d * scale: exact in float32 (float16 x an 8-bit integer)
        q, d, dmin, scales = unpack_k(qtype, raw, n, k)
        if qtype == Q.Q6_K:  # a scale per 16 k
            d16 = np.repeat(d.astype(np.float32), 16, axis=1)
            return q, d16 * scales.reshape(n, -1).view(np.int8).astype(np.float32), None
        d32, dmin32 = (np.repeat(v.astype(np.float32), 8, axis=1) for v in (d, dmin))
        return (q, d32 * scales[..., 0].astype(np.float32),
                -(dmin32 * scales[..., 1].astype(np.float32)))
    raise DresdError(f"no native kernel for {qtype.name} weights")


K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def unpack_k(qtype: Q, raw: np.ndarray, n: int, k: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """A K-quant tensor as the file keeps its scales: (q uint8 [n, k], d float16 [n, k / 256],
    dmin float16 [n, k / 256] or None, scales uint8 [n, k / 32, 2]): per block of 32, Q4_K and
    Q5_K's 6-bit scale and minimum (w = d * scale * q - dmin * minimum), Q6_K's two int8 scales,
    one per 16 k (w = d * scale * (q - 32)); kept as integers, so that the kernel's
    d * scale is exact in float32 (packed: Q6_K's a byte each, Q4_K and Q5_K's as the file's
    12 bytes per 256 k, `pack`)."""
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(n, k // block, size)
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])  # [n, blocks of 256]
        sc, mn = _k_scales(blocks[..., 4:16])  # [n, blocks, 8]
        if qtype == Q.Q4_K:
            qs = blocks[..., 16:144].reshape(n, k // 256, 4, 32)  # 4 pairs of sub-blocks
            q = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [n, blocks, 4, 2, 32]
        else:
            qh = np.unpackbits(blocks[..., 16:48], axis=-1, bitorder="little")
            qh = qh.reshape(n, k // 256, 32, 8).transpose(0, 1, 3, 2)  # bit j of byte i: sub j
            qs = blocks[..., 48:176].reshape(n, k // 256, 4, 32)
            low = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k // 256, 8, 32)
            q = low | (qh << 4)
        scales = np.stack([sc.reshape(n, -1), mn.reshape(n, -1)], axis=-1)
        return q.reshape(n, k).astype(np.uint8), d, dmin, scales
    # Q6_K: 128 low nibbles, 64 bytes of 2 high bits, 16 int8 scales, d
    ql = blocks[..., 0:128].reshape(n, k // 256, 2, 2, 32)  # [half, j, l]: bytes 64h+32j+l
    qh = blocks[..., 128:192].reshape(n, k // 256, 2, 1, 32)
    # element 128h + 32i + l, i = 0..3: low nibble of ql[h][i % 2] (i < 2) or its high
    # nibble (i >= 2), with bits 2i, 2i + 1 of qh[h] as bits 4 and 5
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # [n, b, h, 4, 32]
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    q = low | (((qh >> shifts) & 3) << 4)
    scales = blocks[..., 192:208].reshape(n, -1, 2)  # [n, blocks of 32, the two halves]
    return q.reshape(n, k).astype(np.uint8), _half(blocks[..., 208:210]), None, scales


def dequantize(qtype: Q, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """float32 [n, k] from the unpacked form (what the kernel multiplies by)."""
    q, d, c = unpack(qtype, raw, n, k)
    d32 = np.repeat(d.astype(np.float32), k // d.shape[1], axis=1)
    if c is None:
        return d32 * (q.astype(np.float32) - LAYOUTS[qtype].offset)
    return d32 * q.astype(np.float32) + np.repeat(c.astype(np.float32), BLOCK, axis=1)


def _by_panel(values: np.ndarray, panels: int) -> np.ndarray:
    """[rows, columns] per output row -> [panel, column, bytes]: each column's 16 lanes side by
    side, as the kernel loads them."""
    values = values.reshape(panels, LANES, -1).transpose(0, 2, 1)
    return np.ascontiguousarray(values).view(np.uint8).reshape(panels, values.shape[1], -1)


def pack(qtype: Q, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """uint8 tensor in `quant.c`'s layout: ceil(n / 32) groups of k / 32 blocks, each block
    its panels' quants and scales one after the other (K-quants: a header per 256 k)."""
    layout = LAYOUTS[qtype]
    if layout.kquant:
        q, d, dmin, scales = unpack_k(qtype, raw, n, k)
    elif layout.e2m1:  # the codes as nibbles (the kernel looks q up), the e bytes as d
        (q, d), c = unpack_mxfp4(raw, n, k), None
    else:
        q, d, c = unpack(qtype, raw, n, k)
    groups, blocks = -(-n // GROUP), k // BLOCK
    panels = groups * PARTS
    padded = panels * LANES

    def pad(values: np.ndarray | None) -> np.ndarray | None:
        """Zero rows up to whole groups: zero quants and scales, outputs the kernel drops."""
        if values is None or padded == n:
            return values
        return np.concatenate([values, np.zeros((padded - n, *values.shape[1:]), values.dtype)])

    q = pad(q).reshape(panels, LANES, blocks, BLOCK)
    # q [panel, lane, block, 32] -> [panel, block, register, lane, 4 bytes]
    if layout.nibbles:  # register r: low nibbles k = 8r + j, high nibbles 8r + 4 + j
        low = (q & 0x0F).reshape(panels, LANES, blocks, 4, 2, 4)
        low = low[..., 0, :] | (low[..., 1, :] << 4)  # [panel, lane, block, r, j]
        quants = low.transpose(0, 2, 3, 1, 4).reshape(panels, blocks, 256)
        if layout.six:  # plane P, lane n, byte j: bits 2t, 2t + 1 = q[4(4P + t) + j] >> 4
            high = (q >> 4).reshape(panels, LANES, blocks, 2, 4, 4)  # [.., P, t, j]
            plane = sum(high[..., t, :] << (2 * t) for t in range(4)).astype(np.uint8)
            quants = np.concatenate(
                [quants, plane.transpose(0, 2, 3, 1, 4).reshape(panels, blocks, 128)], axis=2)
        if layout.five:  # lane n, byte j: bit t = q[4t + j] >> 4
            high = (q >> 4).reshape(panels, LANES, blocks, 8, 4)  # [.., t, j]
            plane = sum(high[..., t, :] << t for t in range(8)).astype(np.uint8)
            quants = np.concatenate(
                [quants, plane.transpose(0, 2, 1, 3).reshape(panels, blocks, 64)], axis=2)
    else:
        quants = q.reshape(panels, LANES, blocks, 8, 4).transpose(0, 2, 3, 1, 4)
        quants = quants.reshape(panels, blocks, 512)
    if layout.kquant:
        supers = blocks // 8
        headers = [_by_panel(pad(v).astype(np.float16), panels) for v in (d, dmin)
                   if v is not None]  # [panel, superblock, 32]
        if layout.has_min:  # Q4_K, Q5_K: the file's 12 bytes, plane i holding every lane's i
            file_bytes = raw.reshape(n, supers, -1)[..., 4:16]
            headers.append(_by_panel(pad(file_bytes), panels).reshape(
                panels, supers, 12, LANES).reshape(panels, supers, 12 * LANES))
            per_block = quants
        else:  # Q6_K: per block, quants, then 16 + 16 integer scales
            scales = pad(scales).reshape(panels, LANES, blocks, 2).transpose(0, 2, 3, 1)
            per_block = np.concatenate([quants, scales.reshape(panels, blocks, 32)], axis=2)
        header = np.concatenate(headers, axis=2)
        per_block = per_block.reshape(groups, PARTS, supers, 8, -1).transpose(0, 2, 3, 1, 4)
        header = header.reshape(groups, PARTS, supers, -1).transpose(0, 2, 1, 3)
        packed = np.concatenate([header.reshape(groups, supers, -1),
                                 per_block.reshape(groups, supers, -1)], axis=2)
        return torch.from_numpy(np.ascontiguousarray(packed).reshape(-1))
    scale_type = np.uint8 if layout.e2m1 else np.float16 if layout.half else np.float32
    parts = [quants, _by_panel(pad(d).astype(scale_type), panels)]
    if layout.has_min:
        parts.append(_by_panel(pad(c).astype(scale_type), panels))
    packed = np.concatenate(parts, axis=2)  # [panel, block, bytes]
    assert packed.shape[2] == layout.block_bytes()
    packed = packed.reshape(groups, PARTS, blocks, -1).transpose(0, 2, 1, 3)  # group, block, part
    return torch.from_numpy(np.ascontiguousarray(packed).reshape(-1))


def pack_blocks(qtype: Q, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """`pack` in C (quant.c's `dresd_quant_pack`): the same bytes, read straight from the
    file's mapped rows (`raw`: uint8 [n, bytes per row], each row contiguous), groups of rows
    spread over every core this process may use (a model loads before anything else runs, as
    llama.cpp's does; numpy's `pack` took ~5 s a GB).

    Where `raw` lies in a read-only file mapping, each thread drops the pages of the rows it has
    packed as it goes (they are the file's, read again from it if anyone looks): else a big
    tensor's mapped bytes stay resident beside its packed copy, Gemma-3's 262k-row tied head
    ~320 MB at the load's peak (32 MB slices, each dropped after its call, still left 18 MB at
    the peak of a Gemma-3-1B file's load)."""
    block, size = GGML_QUANT_SIZES[qtype]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape != (n, k // block * size):
        raise DresdError(f"a {qtype.name} tensor of {n} x {k} cannot hold {raw.shape} bytes")
    if raw.strides[1] != 1:
        raw = np.ascontiguousarray(raw)
    packed = torch.empty(packed_bytes(qtype, n, k), dtype=torch.uint8)
    mapped = raw.strides[0] > 0 and _read_only_mapping(raw) is not None
    status = kernel().dresd_quant_pack(LAYOUTS[qtype].number, raw.ctypes.data, raw.strides[0],
                                       n, k, packed.data_ptr(), kernels.usable_cores(),
                                       int(mapped))
    if status:
        raise DresdError(f"quant.c could not pack a {qtype.name} tensor of {n} x {k} "
                         f"(status {status})")
    return packed


def _read_only_mapping(raw: np.ndarray) -> mmap.mmap | None:
    """The mmap under `raw` where `raw` views a read-only np.memmap (its pages are only ever
    the file's, so dropping them loses nothing), else None (an array of its own, or a mapping
    that may have been written: dropping its pages would lose what it holds)."""
    read_only, base = False, raw
    while isinstance(base, np.ndarray):
        read_only |= isinstance(base, np.memmap) and base.mode == "r"
        base = base.base
    return base if read_only and isinstance(base, mmap.mmap) else None


def drop_file_pages(mapping: mmap.mmap, start: int, end: int) -> None:
    """madvise(MADV_DONTNEED) the pages of a read-only file mapping over its offsets
    [start, end): the page holding `start` from its beginning, and the last page whole, so
    either may hold bytes beside the range (rows packed before or after, another tensor's);
    they are only ever the file's, read again from it if anyone looks."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, first, end - first)


def packed_bytes(qtype: Q, out_features: int, k: int) -> int:
    """The bytes `pack` gives a `qtype` weight of out_features x k."""
    return -(-out_features // GROUP) * LAYOUTS[qtype].group_bytes(k)


def check_sizes(qtype: Q, packed: torch.Tensor, out_features: int, k: int,
                bias: torch.Tensor | None) -> None:
    """A ValueError unless the kernel may read a k-input row against `packed` (the kernel reads
    ceil(out_features / 32) groups of k inputs' blocks from it: an input whose k is not the
    weight's would read past its end) and `bias` [out_features]."""
    block = 256 if LAYOUTS[qtype].kquant else BLOCK
    if k < 1 or k % block or out_features < 1:
        raise ValueError(f"quant.linear: {qtype.name} takes inputs of a multiple of {block} to "
                         f"{out_features} outputs, not {k}")
    if (packed.dtype != torch.uint8 or not packed.is_contiguous()
            or packed.numel() != packed_bytes(qtype, out_features, k)):
        raise ValueError(f"quant.linear: a {qtype.name} weight of {out_features} outputs and "
                         f"{k} inputs packs into {packed_bytes(qtype, out_features, k)} bytes, "
                         f"not {packed.numel()} ({packed.dtype}): the input's size is not the "
                         "weight's")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() < out_features
                             or not bias.is_contiguous()):
        raise ValueError(f"quant.linear: the bias must be float32 [{out_features}], not "
                         f"{bias.dtype} [{bias.numel()}]")


def linear(x: torch.Tensor, qtype: Q, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16
           ) -> torch.Tensor:
    """x [..., k] bf16 -> [..., out_features] in out_dtype (bf16 or float32)."""
    library = kernel()
    shape = x.shape
    rows_x = x.reshape(-1, shape[-1])
    if rows_x.dtype != torch.bfloat16 or rows_x.stride(-1) != 1:
        rows_x = rows_x.to(torch.bfloat16).contiguous()
    rows, k = rows_x.shape
    check_sizes(qtype, packed, out_features, k, bias)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"quant.linear: out_dtype bf16 or float32, not {out_dtype}")
    y = torch.empty(rows, out_features, dtype=out_dtype)
    status = library.dresd_quant_linear(
        LAYOUTS[qtype].number, rows_x.data_ptr(), rows_x.stride(0), rows, k, packed.data_ptr(),
        out_features, None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
        1 if out_dtype == torch.bfloat16 else 0, torch.get_num_threads())
    if status == -2:  # quant.c's own check of its arguments
        raise ValueError(f"quant.c: {qtype.name}, k={k}, {out_features} outputs: sizes it "
                         "does not take")
    if status != 0:
        raise MemoryError("quant.c: no memory for the quantized activations")
    return y.reshape(*shape[:-1], out_features)


class QuantLinear(torch.nn.Module):
    """A linear layer on a GGUF tensor's blocks, packed once (no float copy of the weight);
    `from_blocks` packs a file's tensor."""

    def __init__(self, qtype: Q, packed: torch.Tensor, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16
                 ) -> None:
        super().__init__()
        self.qtype, self.out_features, self.in_features = qtype, out_features, in_features
        self.out_dtype = out_dtype
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous(),
                             persistent=False)

    @classmethod
    def from_blocks(cls, qtype: Q, raw: np.ndarray, out_features: int, in_features: int,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16
                    ) -> QuantLinear:
        """From a tensor's raw blocks (uint8 [out_features, bytes per row])."""
        block, size = GGML_QUANT_SIZES[qtype]
        if in_features % block or raw.shape != (out_features, in_features // block * size):
            raise DresdError(f"a {qtype.name} tensor of {out_features} x {in_features} cannot "
                             f"hold {raw.shape[0]} rows of {raw.shape[-1]} bytes")
        return cls(qtype, pack_blocks(qtype, raw, out_features, in_features), out_features,
                   in_features, bias, out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.qtype, self.packed, self.out_features, self.bias, self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.qtype.name}, in={self.in_features}, out={self.out_features}"


def _stacked_bias(modules: list[QuantLinear]) -> torch.Tensor | None:
    """The modules' biases side by side (zeros for a module without one), or None."""
    if all(module.bias is None for module in modules):
        return None
    return torch.cat([module.bias if module.bias is not None
                      else torch.zeros(module.out_features) for module in modules])


class QuantParts(torch.nn.Module):
    """Projections that share an input but not a type (a Q4_K_M file's q and k in Q4_K, its v
    in Q6_K): one module whose output is theirs side by side; the C decoder runs each part
    into its own columns."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.out_features = sum(part.out_features for part in parts)
        self.register_buffer("bias", _stacked_bias(parts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def fuse(modules: list[QuantLinear]) -> QuantLinear | QuantParts:
    """One module for projections that share an input. Where they have one type and each fills
    whole panels, one `QuantLinear` whose packed buffer is theirs one after another (the parts
    then read views of it: no weight is held twice); else a `QuantParts`. Either way each
    output is computed exactly as by its own module (quant.c's header)."""
    first = modules[0]
    if (any(m.qtype != first.qtype or m.out_features % GROUP for m in modules)
            or any(m.out_dtype != first.out_dtype for m in modules)):
        return QuantParts(modules)
    # Each part is copied into its place and then reads it there, its own buffer freed before
    # the next is copied: the load's peak grows by the largest part, not by all of them.
    packed = torch.empty(sum(m.packed.numel() for m in modules), dtype=first.packed.dtype)
    fused = QuantLinear(first.qtype, packed, sum(m.out_features for m in modules),
                        first.in_features, _stacked_bias(modules), first.out_dtype)
    offset = outputs = 0
    for module in modules:  # each part reads its rows of the fused buffers
        size = module.packed.numel()
        packed[offset:offset + size].copy_(module.packed)
        module.packed = packed[offset:offset + size]
        if module.bias is not None:
            module.bias = fused.bias[outputs:outputs + module.out_features]
        offset, outputs = offset + size, outputs + module.out_features
    return fused
