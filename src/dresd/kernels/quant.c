/* Batch-invariant linear layer on GGUF-quantized weights, for CPUs with AVX-512 VNNI, or AVX2
 * with or without AVX-VNNI, or aarch64 NEON with sdot (or usdot) (dresd/kernels/quant.py
 * repacks the weights and loads it; vec.h has each tier's instructions).
 *
 *   y[m, n] = sum over blocks b of 32 k:  dx[m, b] * (d[n, b] * dot[m, n, b] + c[n, b] * sx[m, b])
 *
 * where, as llama.cpp does for these types, each row of x is quantized on the fly to 8-bit
 * blocks of 32 (x[m, k] ~ dx[m, b] * xq[m, k], dx = max|x| / 127 in the block, xq = round(x /
 * dx), sx = sum of the block's xq), and a weight is w[n, k] = d[n, b] * q[n, k] + c[n, b]:
 *   - a type with an offset (Q4_0: q - 8, Q5_0: q - 16, Q8_0: q as stored + 128; MXFP4:
 *     q - 12, q = 2v + 12 for the E2M1 value v): c = -offset d;
 *   - a type with a minimum (Q4_1, Q5_1, and the K-quants' sub-blocks): c = m;
 *   - Q6_K, whose scales change every 16 k: d and c per half block, each half summed apart.
 * q is stored unsigned (0..15 in nibbles; 0..31 or 0..63 in nibbles and planes of high bits;
 * 0..255 in bytes; MXFP4: 0..24, looked up from the nibble's E2M1 code), so one `vpdpbusd`
 * multiplies four weights by four activations and adds them exactly into a 32-bit integer:
 *   dot[m, n, b] = sum_k q[n, k] xq[m, k]      (exact: |dot| < 2^24)
 *
 * The promise, as cpu_linear.c's: y[m, n] depends only on row m of x and on W; not on how many
 * rows came with it, which rows they were, nor on the thread count. Row m's quantization reads
 * row m alone. For each (m, n) the float operations are always these, in this order:
 *   acc = +0.0f
 *   for b = 0, 1, ..., blocks - 1:
 *       term = fma(c[n, b], float(sx[m, b]), d[n, b] * float(dot[m, n, b]))
 *       (Q6_K: term = fma(c1, sx1, fma(d1, dot1, fma(c0, sx0, d0 * dot0))) over the halves)
 *       acc  = fma(term, dx[m, b], acc)
 *   y[m, n] = acc + bias[n]   (then bf16, to nearest, ties to even, or float32 as it is)
 * Vector lanes run over outputs n (16 per register, 8 with AVX2); rows m and outputs n are
 * independent, so how the work is tiled or threaded never changes an output's operations. The
 * integer dots are exact on every tier (vpdpbusd, or vpmaddubsw where no 16-bit pair can
 * saturate) and the float operations per output are the ones above on every tier, so every
 * tier gives the same bits.
 *
 * The weight layout (repacked once by quant.py so that a group streams contiguously): groups
 * of QPARTS panels of 16 outputs (N padded with zero rows to whole groups); per group, per
 * block b, per panel of the group, in this order:
 *   quants  nibbles: 4 x 64 bytes, register r, lane n, byte j: low nibble q[n][32b + 8r + j],
 *                    high nibble q[n][32b + 8r + 4 + j];
 *           bytes:   8 x 64 bytes, register r, lane n, byte j: q[n][32b + 4r + j];
 *           five bits (Q5_0, Q5_1, Q5_K): the nibbles' 4 x 64 bytes of q & 15, then 64 bytes of
 *                    q >> 4, lane n, byte j, bit t: q[n][32b + 4t + j] >> 4 (20 bytes a row a
 *                    block, as the file's qs and qh; bytes would take 32);
 *           six bits (Q6_K): the nibbles' 4 x 64 bytes of q & 15, then 2 x 64 bytes of q >> 4,
 *                    register P, lane n, byte j, bits 2t, 2t + 1: q[n][32b + 4(4P + t) + j] >> 4;
 *   d       16 scales (float16, as the file keeps them; MXFP4: 16 E8M0 bytes, as the file's);
 *   c       16 minimums (float16; types with a minimum only).
 * MXFP4 (gpt-oss's experts; ggml type 39): a block is an E8M0 byte e and 16 bytes of 4-bit
 * E2M1 codes (low nibble k = j, high k = j + 16, as Q4_0's), w = kvalues[code] 2^(e - 128)
 * with kvalues = 2 x E2M1 = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12} (ggml's
 * kvalues_mxfp4). Packed as the nibbles layout with the codes themselves (256 bytes a panel)
 * and the file's e bytes (16): 272 bytes a panel a block, the file's 17 a row. The kernel
 * makes q = kvalues[code] + 12 (0..24) with a 16-byte table lookup (vpshufb, tbl) and
 * d = 2^(e - 128) as the float32 whose bits are (e + 1) << 23, 2^(e - 126), times 2^-2 (vec.h
 * vf_load_e8m0_half): exact, the subnormals 2^-128 and 2^-127 of e = 0 and 1 included (no tier
 * flushes them: FTZ and DAZ are off, and every product below of a subnormal d is exact);
 * c = -12 d. So w = d q + c is the file's value, as ggml's ggml_e8m0_to_fp32_half gives it.
 * The products d dot and c sx are float32 (|dot| < 2^17): they can overflow where e > 238
 * (weights of 2^110 and more, far beyond any model's), and e = 254, 255 (255: NaN in E8M0)
 * read as inf and -0, where ggml reads 2^126 and 2^127.
 * K-quants keep their scales as the file does, as small integers under a float16 scale per 256
 * k (d[n, b] = dsuper[n] * scale[n, b], exact in float32): per group, per superblock of 8
 * blocks, first each panel's header (16 float16 dsuper; Q4_K, Q5_K: then 16 float16 dmin and
 * the file's 12 bytes of six-bit scales and minimums, as 12 planes of 16 lanes: byte i of
 * every lane's 12, so that a panel keeps the file's 144 bytes a row per 256 k; `k_scales`
 * unpacks a block's), then the 8 blocks, each panel's quants (Q6_K: followed by 32 bytes, 16
 * int8 scales for k < 16, 16 for k >= 16).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#define HAVE_MADVISE 1
#endif

#include "vec.h"

#define QLANES 16      /* outputs per panel: one AVX-512 register's float32 lanes */
#define QSLICES (QLANES / VLANES)  /* registers per panel: 1, or 2 with AVX2 */
#define QPARTS 2       /* panels computed together (a group), for independent accumulators */
#ifndef QAHEAD
#define QAHEAD 4       /* blocks ahead that each block's step prefetches */
#endif
#define QMAX_TILE 4    /* rows sharing each weight load */
#define QBLOCK 32      /* k per block */

/* How a layout stores one block: its quants' width, its scales' precision, whether it keeps
 * a minimum (else c = -offset d). */
typedef struct {
    int nibbles;     /* 1: 4-bit quants (16 bytes a row a block), 0: bytes (32) */
    int half;        /* 1: float16 scales, 0: float32 */
    int has_min;     /* 1: c stored; 0: c = -offset d */
    int offset;
    int halves;      /* 1: d per 16 k (two sets per block, each half's dot apart) */
    int kquant;      /* 1: superblock headers and integer scales (see the header) */
    int six;         /* 1: nibbles and two planes of 2-bit high parts (Q6_K) */
    int five;        /* 1: nibbles and a plane of each weight's bit 4 (Q5_0, Q5_1, Q5_K) */
    int e2m1;        /* 1: nibbles of E2M1 codes (q = E2M1_Q[code]), d an E8M0 byte (MXFP4) */
} QLayout;

/* MXFP4: q = 2v + 12 for each E2M1 code's value v (ggml's kvalues_mxfp4 + 12; offset 12). */
static const uint8_t E2M1_Q[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

static inline int64_t quant_bytes(QLayout l) {
    return l.six ? 384 : l.five ? 320 : l.nibbles ? 256 : 512;
}
static inline int64_t scale_bytes(QLayout l) {
    if (l.e2m1) return 16;  /* the file's E8M0 bytes */
    if (l.kquant) return l.has_min ? 0 : 32;  /* Q4_K, Q5_K: in the header */
    return (l.half ? 32 : 64) * (l.has_min ? 2 : 1) * (l.halves ? 2 : 1);
}
static inline int64_t block_bytes(QLayout l) { return quant_bytes(l) + scale_bytes(l); }
#define K_PLANES 12  /* Q4_K, Q5_K: the file's bytes of scales and minimums per 256 k */
static inline int64_t header_bytes(QLayout l) {
    return l.kquant ? (l.has_min ? 64 + K_PLANES * 16 : 32) : 0;
}
#define SUPER 8  /* blocks per K-quant superblock (256 k) */

/* Q4_K, Q5_K: block j's (of its superblock) 16 lanes of six-bit scales (bytes 0..15) and
 * minimums (16..31), from the header's planes (as ggml's get_scale_min_k4, 16 lanes at once). */
typedef uint8_t u8x16 __attribute__((vector_size(16)));
static inline u8x16 k_plane(const uint8_t *planes, int i) {
    u8x16 plane;
    memcpy(&plane, planes + 16 * i, 16);
    return plane;
}
static inline void k_scales(const uint8_t *planes, int j, uint8_t out[32]) {
    u8x16 scale, minimum;
    if (j < 4) {
        scale = k_plane(planes, j) & 63;
        minimum = k_plane(planes, j + 4) & 63;
    } else {
        u8x16 low = k_plane(planes, j + 4);
        scale = (low & 15) | ((k_plane(planes, j - 4) >> 6) << 4);
        minimum = (low >> 4) | ((k_plane(planes, j) >> 6) << 4);
    }
    memcpy(out, &scale, 16);
    memcpy(out + 16, &minimum, 16);
}

/* K-quants: a group's bytes per superblock (its panels' headers, then its 8 blocks). */
static inline int64_t super_bytes(QLayout l) {
    return QPARTS * (header_bytes(l) + SUPER * block_bytes(l));
}
/* K-quants: where panel p's header of superblock s starts in a group. */
static inline const uint8_t *header_at(QLayout l, const uint8_t *group, int s, int p) {
    return group + s * super_bytes(l) + p * header_bytes(l);
}

/* Where panel p's part of block b starts in a group. */
static inline const uint8_t *block_at(QLayout l, const uint8_t *group, int b, int p) {
    if (!l.kquant) return group + ((int64_t)b * QPARTS + p) * block_bytes(l);
    return header_at(l, group, b / SUPER, QPARTS)  /* past the superblock's headers */
           + ((int64_t)(b % SUPER) * QPARTS + p) * block_bytes(l);
}

/* One row of bf16 x (k a multiple of 32) as 8-bit blocks: xq [k], dx [k / 32], and sx [k / 16]
 * the sums of each half block's xq.
 * dx = amax / 127 and xq = round-to-nearest-even(x * (127 / amax)), as llama.cpp's Q8 rows;
 * an all-zero block has dx = 0 and xq = 0. */
static void quantize_row(const uint16_t *x, int k, int8_t *xq, float *dx, int32_t *sx) {
    enum { PER_BLOCK = QBLOCK / VLANES, PER_HALF = PER_BLOCK / 2 };  /* registers */
    for (int b = 0; b < k / QBLOCK; b++) {
        vf value[PER_BLOCK];
        for (int j = 0; j < PER_BLOCK; j++) value[j] = vf_load_bf16(x + b * QBLOCK + j * VLANES);
        vf top = vf_abs(value[0]);
        for (int j = 1; j < PER_BLOCK; j++) top = vf_max(top, vf_abs(value[j]));
        float amax = vf_reduce_max(top);  /* exact: the same on every tier */
        float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        vf by = vf_set1(inverse);
        sx[2 * b] = sx[2 * b + 1] = 0;
        for (int j = 0; j < PER_BLOCK; j++) {
            vi q = vf_to_i32(vf_mul(value[j], by));  /* to nearest, even */
            vi_store_i8(xq + b * QBLOCK + j * VLANES, q);
            sx[2 * b + j / PER_HALF] += vi_reduce_add(q);
        }
        dx[b] = scale;
    }
}

/* VLANES scales: float16 (half) or float32 */
static inline vf load_scales(const uint8_t *from, int half) {
    return half ? vf_load_f16(from) : vf_loadu((const float *)from);
}

/* acc + the dot products of w's four-byte groups with x[0]'s four bytes (vpdpbusd). In a tile
 * of several rows x[0] is broadcast from memory, written out: given _mm512_set1_epi32, GCC
 * keeps every row's broadcasts in registers across a tile's panels and spills accumulators.
 * One row has the registers to spare, and runs 6-9% faster with them (K-quants, 1B shapes). */
static inline vi dot_broadcast(const int TILE, vi acc, vi w, const int32_t *x) {
#ifdef __AVX512F__
    if (TILE > 1) {
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
        return acc;
    }
#endif
    return vi_dot4(acc, w, vi_set1_32(x[0]));
}

/* The same for bytes up to 255 (Q8_0's q + 128): where vi_dot4 is exact only up to 128, as
 * the dot of the low nibbles plus 16 times that of the high ones (the same integer). */
static inline vi dot_full_bytes(const int TILE, vi acc, vi w, const int32_t *x) {
    if (VDOT_ANY_BYTES) return dot_broadcast(TILE, acc, w, x);
    const vi low_nibbles = vi_set1_8(0x0f);
    vi high = dot_broadcast(TILE, vi_zero(), vi_and(vi_srli16(w, 4), low_nibbles), x);
    return dot_broadcast(TILE, vi_add32(acc, vi_slli32(high, 4)), vi_and(w, low_nibbles), x);
}

/* Slice h of panel p's part of block b (its lanes VLANES h .. VLANES (h + 1) - 1: with
 * AVX-512 the whole panel, h = 0): its 8 registers of quants (w[r] holds k = 4r .. 4r + 3,
 * whether from bytes or from the low (r even) or high (r odd) nibbles of a packed register),
 * and its scales d, c (l.halves: d, c for k < 16 and d2, c2 for k >= 16). A slice's lanes lie
 * at a byte offset of h VLANES times the size of one lane's element in every 16-lane row. */
static inline __attribute__((always_inline)) void load_panel(
        const QLayout l, const uint8_t *group, int b, int p, int h, vi w[8], vf *d, vf *c,
        vf *d2, vf *c2, const uint8_t *k_unpacked) {
    const uint8_t *block = block_at(l, group, b, p);
    const int lane0 = h * VLANES;
    if (l.nibbles) {
        const vi low_nibbles = vi_set1_8(0x0f);
        for (int r = 0; r < 4; r++) {
            vi packed = vi_load(block + 64 * r + 4 * lane0);
            w[2 * r] = vi_and(packed, low_nibbles);
            w[2 * r + 1] = vi_and(vi_srli16(packed, 4), low_nibbles);
        }
        if (l.e2m1) { /* E2M1 codes -> q = 2v + 12 */
            const vi table = vi_table16(E2M1_Q);
            for (int r = 0; r < 8; r++) w[r] = vi_lookup16(table, w[r]);
        }
        if (l.six) { /* bits 4 and 5 of register r from the plane: a byte's bits 2t, 2t + 1 */
            const vi two_bits = vi_set1_8(0x03);
            for (int plane = 0; plane < 2; plane++) {
                vi high = vi_load(block + 256 + 64 * plane + 4 * lane0);
                for (int t = 0; t < 4; t++) {
                    vi bits = vi_and(vi_srli16(high, 2 * t), two_bits);
                    w[4 * plane + t] = vi_or(w[4 * plane + t], vi_slli16(bits, 4));
                }
            }
        }
        if (l.five) { /* bit 4 of register t from the plane's bit t, moved within its byte */
            const vi bit4 = vi_set1_8(0x10);
            vi high = vi_load(block + 256 + 4 * lane0);
            for (int t = 0; t < 8; t++) {
                vi moved = t <= 4 ? vi_slli16(high, 4 - t) : vi_srli16(high, t - 4);
                w[t] = vi_or(w[t], vi_and(moved, bit4));
            }
        }
    } else {
        for (int r = 0; r < 8; r++) w[r] = vi_load(block + 64 * r + 4 * lane0);
    }
    const uint8_t *scales = block + quant_bytes(l);
    if (l.kquant) {  /* float16 headers (2 bytes a lane), byte scales (1) */
        const uint8_t *header = header_at(l, group, b / SUPER, p) + 2 * lane0;
        vf dsuper = load_scales(header, 1);
        if (l.has_min) {  /* the block's scales and minimums, unpacked (`qtile`) */
            *d = vf_mul(dsuper, vf_load_u8(k_unpacked + lane0, 0));
            *c = vf_negate(vf_mul(load_scales(header + 32, 1),
                                  vf_load_u8(k_unpacked + 16 + lane0, 0)));
        } else {
            *d = vf_mul(dsuper, vf_load_u8(scales + lane0, l.halves));
            *c = vf_mul(*d, vf_set1((float)-l.offset));
            *d2 = vf_mul(dsuper, vf_load_u8(scales + 16 + lane0, 1));
            *c2 = vf_mul(*d2, vf_set1((float)-l.offset));
        }
        return;
    }
    if (l.e2m1) {  /* a byte a lane: d = 2^(e - 128), exact (subnormal for e < 2) */
        *d = vf_load_e8m0_half(scales + lane0);
        *c = vf_mul(*d, vf_set1((float)-l.offset));
        return;
    }
    const int size = l.half ? 2 : 4;  /* bytes of one lane's scale */
    *d = load_scales(scales + size * lane0, l.half);
    *c = l.has_min ? load_scales(scales + 16 * size + size * lane0, l.half)
                   : vf_mul(*d, vf_set1((float)-l.offset));
    if (l.halves) { /* the second half's scales (float32); c = -offset d */
        *d2 = load_scales(scales + 64 + 4 * lane0, 0);
        *c2 = vf_mul(*d2, vf_set1((float)-l.offset));
    }
}

/* Rows [0, TILE) of the group at `group`. One panel's quants at a time are live in registers
 * (8), beside the TILE x QPARTS accumulators: with every panel's at once (16), a 4-row tile
 * needs more than the 32 vector registers, and GCC keeps accumulators on the stack. */
static inline __attribute__((always_inline)) void qtile(
        const int TILE, const QLayout l, const int8_t *xq, const float *dx, const int32_t *sx,
        int k, const uint8_t *group, const float *bias, void *y, int64_t y_stride, int outputs,
        int out_bf16) {
    const int blocks = k / QBLOCK, slices = QPARTS * QSLICES;
    const int64_t stride = block_bytes(l);
    const int full_bytes = !l.nibbles && l.offset == 128;  /* Q8_0: bytes up to 255 */
    vf acc[QMAX_TILE][QPARTS * QSLICES];  /* [row][panel p, slice h: p QSLICES + h] */
    #pragma GCC unroll 4  /* every loop over i or s unrolled: acc[i][s] stays in registers */
    for (int i = 0; i < TILE; i++)
        #pragma GCC unroll 4
        for (int s = 0; s < slices; s++) acc[i][s] = vf_zero();
    /* Q4_K, Q5_K: a superblock's scales and minimums, unpacked from its headers' planes as
     * it starts (once per 8 blocks: in each block's step they cost 6-11% at 4 rows) */
    uint8_t k_unpacked[SUPER][QPARTS][32];
    for (int b = 0; b < blocks; b++) {
        if (l.kquant && l.has_min && b % SUPER == 0)
            for (int p = 0; p < QPARTS; p++)
                for (int j = 0; j < SUPER; j++)  /* the planes follow dsuper and dmin */
                    k_scales(header_at(l, group, b / SUPER, p) + 64, j, k_unpacked[j][p]);
        if (b + QAHEAD < blocks) {  /* the block's panels lie together (K: and headers) */
            const char *ahead = (const char *)block_at(l, group, b + QAHEAD, 0);
            for (int64_t line = 0; line < QPARTS * stride; line += 64)
                __builtin_prefetch(ahead + line, 0, 3);  /* prefetcht0 on x86 */
        }
        #pragma GCC unroll 4
        for (int s = 0; s < slices; s++) {
            vi w[8];
            vf d, c, d2 = vf_zero(), c2 = vf_zero();
            load_panel(l, group, b, s / QSLICES, s % QSLICES, w, &d, &c, &d2, &c2,
                       k_unpacked[b % SUPER][s / QSLICES]);
            #pragma GCC unroll 4
            for (int i = 0; i < TILE; i++) {
                const int32_t *x4 = (const int32_t *)(xq + (int64_t)i * k + b * QBLOCK);
                const int32_t *sums = sx + (int64_t)i * 2 * blocks + 2 * b;
                /* two independent chains: k < 16 and k >= 16 (exact integers) */
                vi low = vi_zero(), high = vi_zero();
#ifdef VDOT_NIBBLES4
                /* AVX2 without VNNI: four dots of nibbles or five bits summed in 16 bits
                 * (vec.h; not six bits, whose sum could overflow), the same integers as below */
                if ((l.nibbles && !l.six) || full_bytes) {
                    vi xs[8];
                    for (int r = 0; r < 8; r++) xs[r] = vi_set1_32(x4[r]);
                    const vi low_nibbles = vi_set1_8(0x0f);
                    if (full_bytes) {  /* q = 16 (q >> 4) + (q & 15), each part at most 15 */
                        vi top[8], bottom[8];
                        for (int r = 0; r < 8; r++) {
                            top[r] = vi_and(vi_srli16(w[r], 4), low_nibbles);
                            bottom[r] = vi_and(w[r], low_nibbles);
                        }
                        low = vi_slli32(vi_dot4_nibbles4(vi_zero(), top, xs), 4);
                        high = vi_slli32(vi_dot4_nibbles4(vi_zero(), top + 4, xs + 4), 4);
                        low = vi_dot4_nibbles4(low, bottom, xs);
                        high = vi_dot4_nibbles4(high, bottom + 4, xs + 4);
                    } else {
                        low = vi_dot4_nibbles4(low, w, xs);
                        high = vi_dot4_nibbles4(high, w + 4, xs + 4);
                    }
                } else
#endif
                for (int r = 0; r < 4; r++) {
                    if (full_bytes) {
                        low = dot_full_bytes(TILE, low, w[r], x4 + r);
                        high = dot_full_bytes(TILE, high, w[r + 4], x4 + r + 4);
                    } else {
                        low = dot_broadcast(TILE, low, w[r], x4 + r);
                        high = dot_broadcast(TILE, high, w[r + 4], x4 + r + 4);
                    }
                }
                vf term;
                if (l.halves) {
                    term = vf_fma(c, vf_set1((float)sums[0]), vf_mul(d, vf_from_i32(low)));
                    term = vf_fma(d2, vf_from_i32(high), term);
                    term = vf_fma(c2, vf_set1((float)sums[1]), term);
                } else {
                    vf dot = vf_from_i32(vi_add32(low, high));
                    term = vf_fma(c, vf_set1((float)(sums[0] + sums[1])), vf_mul(d, dot));
                }
                acc[i][s] = vf_fma(term, vf_set1(dx[(int64_t)i * blocks + b]), acc[i][s]);
            }
        }
    }
    #pragma GCC unroll 4
    for (int i = 0; i < TILE; i++)
        #pragma GCC unroll 4
        for (int s = 0; s < slices; s++) {
            int first = s * VLANES;  /* panel s / QSLICES, its slice s % QSLICES */
            if (first >= outputs) break;
            vf value = acc[i][s];
            if (bias) value = vf_add(value, vf_load_part(bias + first, outputs - first));
            if (out_bf16)
                bf16_store_part((uint16_t *)y + i * y_stride + first, value, outputs - first);
            else
                vf_store_part((float *)y + i * y_stride + first, value, outputs - first);
        }
}

/* The layouts quant.py writes, by number (the same table there). */
static const QLayout LAYOUTS[] = {
    /* 0: Q4_0  nibbles, float16 d, q - 8 */
    {.nibbles = 1, .half = 1, .offset = 8},
    /* 1: Q4_1  nibbles, float16 d and m */
    {.nibbles = 1, .half = 1, .has_min = 1},
    /* 2: Q8_0  bytes (q + 128), float16 d */
    {.half = 1, .offset = 128},
    /* 3: Q5_0  five bits (0..31), float16 d, q - 16 */
    {.nibbles = 1, .five = 1, .half = 1, .offset = 16},
    /* 4: Q5_1  five bits, float16 d and m */
    {.nibbles = 1, .five = 1, .half = 1, .has_min = 1},
    /* 5: Q4_K  nibbles, dsuper and dmin, six-bit scales, minimums */
    {.nibbles = 1, .half = 1, .has_min = 1, .kquant = 1},
    /* 6: Q5_K  five bits, the same scales */
    {.nibbles = 1, .five = 1, .half = 1, .has_min = 1, .kquant = 1},
    /* 7: Q6_K  six bits (0..63), dsuper, int8 scales per 16, q - 32 */
    {.nibbles = 1, .six = 1, .half = 1, .offset = 32, .halves = 1, .kquant = 1},
    /* 8: MXFP4  nibbles of E2M1 codes (q 0..24 by table), E8M0 byte d, q - 12 */
    {.nibbles = 1, .e2m1 = 1, .offset = 12},
};

/* Every (layout, rows) pair its own function, compiled apart: inlined together into one
 * switch, GCC gave some pairs worse code (accumulators on the stack) than alone. */
#define QTILE_FN(L, T) \
    static void __attribute__((noinline)) qtile_##L##_##T( \
            const int8_t *xq, const float *dx, const int32_t *sx, int k, const uint8_t *group, \
            const float *bias, void *y, int64_t y_stride, int outputs, int out_bf16) { \
        qtile(T, LAYOUTS[L], xq, dx, sx, k, group, bias, y, y_stride, outputs, out_bf16); \
    }
#define QTILE_FNS(L) QTILE_FN(L, 1) QTILE_FN(L, 2) QTILE_FN(L, 3) QTILE_FN(L, 4)
QTILE_FNS(0) QTILE_FNS(1) QTILE_FNS(2) QTILE_FNS(3)
QTILE_FNS(4) QTILE_FNS(5) QTILE_FNS(6) QTILE_FNS(7)
QTILE_FNS(8)

typedef void (*QTileFn)(const int8_t *, const float *, const int32_t *, int, const uint8_t *,
                        const float *, void *, int64_t, int, int);
#define QTILE_ROW(L) {qtile_##L##_1, qtile_##L##_2, qtile_##L##_3, qtile_##L##_4}
/* QTILES[layout][rows - 1] */
static const QTileFn QTILES[][QMAX_TILE] = {QTILE_ROW(0), QTILE_ROW(1), QTILE_ROW(2), QTILE_ROW(3),
                                     QTILE_ROW(4), QTILE_ROW(5), QTILE_ROW(6), QTILE_ROW(7),
                                     QTILE_ROW(8)};

/* Bytes of one group of `layout` over k inputs (exported: quant.py's Layout.group_bytes must
 * agree, since `dresd_quant_pack` fills a buffer of that size, and benchmarks/micro/quant_ab.py
 * sizes each build's own layout by it). */
int64_t dresd_quant_group_bytes(int layout, int k) {
    QLayout l = LAYOUTS[layout];
    return (int64_t)(k / QBLOCK) * QPARTS * block_bytes(l)
           + (int64_t)(k / QBLOCK / SUPER) * QPARTS * header_bytes(l);
}

/* y = x W^T (+ bias): x rows x k bf16 (row stride x_stride elements; k a multiple of 32);
 * packed: the header's layout, ceil(n / 32) groups; bias: float32 [n] or NULL; y: rows x n,
 * bf16 (out_bf16 = 1) or float32, row stride y_stride. Returns 0, -1 where memory for the
 * quantized rows could not be had, -2 where the sizes are none it takes (a layout it has not,
 * k not a whole number of blocks, n < 1, y's rows narrower than n): it reads nothing then. The
 * packed buffer's size it cannot see: its callers check it (quant.py `check_sizes`). */
int dresd_quant_linear(int layout, const uint16_t *x, int64_t x_stride, int rows, int k,
                       const uint8_t *packed, int n, const float *bias, void *y,
                       int64_t y_stride, int out_bf16, int threads) {
    if (layout < 0 || layout >= (int)(sizeof(LAYOUTS) / sizeof(LAYOUTS[0])) || rows < 0
        || k < QBLOCK || k % QBLOCK || (LAYOUTS[layout].kquant && k % (QBLOCK * SUPER))
        || n < 1 || y_stride < n || x_stride < k)
        return -2;
    const int blocks = k / QBLOCK;
    int8_t *xq = malloc((size_t)rows * k + 64);
    float *dx = malloc(sizeof(float) * (size_t)rows * blocks);
    int32_t *sx = malloc(sizeof(int32_t) * (size_t)rows * 2 * blocks);
    if (!xq || !dx || !sx) {
        free(xq); free(dx); free(sx);
        return -1;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows >= 8)
    for (int m = 0; m < rows; m++)
        quantize_row(x + m * x_stride, k, xq + (int64_t)m * k, dx + (int64_t)m * blocks,
                     sx + (int64_t)m * 2 * blocks);

    const int64_t group_stride = dresd_quant_group_bytes(layout, k);
    const int groups = (n + QPARTS * QLANES - 1) / (QPARTS * QLANES);
    const int tiles = (rows + QMAX_TILE - 1) / QMAX_TILE;
    const int items = groups * tiles;
    if (threads > items) threads = items;
    /* Work item = (group, row tile), group-major, as cpu_linear.c's: a thread's items are
     * consecutive row tiles of one group, whose weights stay in cache across its rows. */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int item = 0; item < items; item++) {
        int group = item / tiles, first = item % tiles * QMAX_TILE;
        int count = rows - first < QMAX_TILE ? rows - first : QMAX_TILE;
        int output0 = group * QPARTS * QLANES;
        int outputs = n - output0 < QPARTS * QLANES ? n - output0 : QPARTS * QLANES;
        size_t element = out_bf16 ? 2 : 4;
        QTILES[layout][count - 1](xq + (int64_t)first * k, dx + (int64_t)first * blocks,
                  sx + (int64_t)first * 2 * blocks, k, packed + group * group_stride,
                  bias ? bias + output0 : NULL,
                  (char *)y + ((int64_t)first * y_stride + output0) * element,
                  y_stride, outputs, out_bf16);
    }
    free(xq); free(dx); free(sx);
    return 0;
}

/* ---- Repacking: a GGUF tensor's blocks into the layout above, once, at load ----------------
 * (quant.py's `pack` is the same in numpy: the tests hold this to its bytes.) Each row's
 * blocks are first read into one form every type shares: q[k] unsigned; per block of 32, d and
 * c as float16 bits (c: types with a minimum); K-quants: per 256 k dsuper (and dmin) as float16
 * bits, and per block of 32 two bytes of integer scales (Q4_K, Q5_K: scale and minimum; Q6_K:
 * the int8 scales of its two halves). The GGUF blocks (ggml-common.h):
 *   Q4_0 d, qs[16]          Q4_1 d, m, qs[16]        Q8_0 d, qs[32] (int8)
 *   Q5_0 d, qh[4], qs[16]   Q5_1 d, m, qh[4], qs[16]
 *   Q4_K d, dmin, scales[12], qs[128]    Q5_K d, dmin, scales[12], qh[32], qs[128]
 *   Q6_K ql[128], qh[64], scales[16] (int8), d
 *   MXFP4 e (E8M0), qs[16] (E2M1 codes)
 * where a byte of qs holds element j in its low nibble and j + 16 (Q4_K: + 32) in its high.
 * MXFP4's q here is the code (packed as it is, looked up in the kernel), its d the e byte. */
typedef struct {
    uint8_t *q;        /* [k] */
    uint16_t *d, *c;   /* [k / 32] float16 bits (not K-quants; MXFP4's d: the e byte) */
    uint16_t *dsuper, *dmin;  /* [k / 256] float16 bits (K-quants) */
    uint8_t *scales;   /* [k / 32][2] (Q6_K) */
    uint8_t *k_bytes;  /* [k / 256][12] the file's scales and minimums (Q4_K, Q5_K) */
} DecodedRow;

/* Bytes of one GGUF block of each layout (32 k; K-quants: 256 k), by layout number. */
static const int GGUF_BLOCK_BYTES[] = {18, 20, 34, 22, 24, 144, 176, 210, 17};
static inline int gguf_block_k(int layout) { return LAYOUTS[layout].kquant ? 256 : 32; }

static inline uint16_t half_at(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static void decode_row(int layout, const uint8_t *raw, int k, DecodedRow r) {
    const int per = gguf_block_k(layout), blocks = k / per;
    for (int b = 0; b < blocks; b++) {
        const uint8_t *x = raw + (int64_t)b * GGUF_BLOCK_BYTES[layout];
        uint8_t *q = r.q + (int64_t)b * per;
        switch (layout) {
        case 0: case 1: {  /* Q4_0, Q4_1 */
            const uint8_t *qs = x + (layout ? 4 : 2);
            for (int j = 0; j < 16; j++) { q[j] = qs[j] & 15; q[j + 16] = qs[j] >> 4; }
            r.d[b] = half_at(x);
            if (layout == 1) r.c[b] = half_at(x + 2);
            break;
        }
        case 2:  /* Q8_0: int8 + 128 */
            for (int j = 0; j < 32; j++) q[j] = (uint8_t)(x[2 + j] ^ 0x80);
            r.d[b] = half_at(x);
            break;
        case 3: case 4: {  /* Q5_0, Q5_1: bit j of qh (little-endian) is element j's bit 4 */
            const uint8_t *qh = x + (layout == 3 ? 2 : 4), *qs = qh + 4;
            uint32_t high = (uint32_t)qh[0] | qh[1] << 8 | qh[2] << 16 | (uint32_t)qh[3] << 24;
            for (int j = 0; j < 16; j++) {
                q[j] = (qs[j] & 15) | ((high >> j) & 1) << 4;
                q[j + 16] = (qs[j] >> 4) | ((high >> (j + 16)) & 1) << 4;
            }
            r.d[b] = half_at(x);
            if (layout == 4) r.c[b] = half_at(x + 2);
            break;
        }
        case 5: case 6: {  /* Q4_K, Q5_K: eight 6-bit scales and minimums in 12 bytes */
            const uint8_t *qh = x + 16, *qs = x + (layout == 5 ? 16 : 48);
            memcpy(r.k_bytes + (int64_t)b * K_PLANES, x + 4, K_PLANES);  /* kept as they are */
            for (int pair = 0; pair < 4; pair++)  /* sub-blocks 2 pair and 2 pair + 1 */
                for (int l = 0; l < 32; l++) {
                    q[64 * pair + l] = qs[32 * pair + l] & 15;
                    q[64 * pair + 32 + l] = qs[32 * pair + l] >> 4;
                }
            if (layout == 6)  /* bit s of qh[l]: sub-block s's element l, bit 4 */
                for (int sub = 0; sub < 8; sub++)
                    for (int l = 0; l < 32; l++) q[32 * sub + l] |= ((qh[l] >> sub) & 1) << 4;
            r.dsuper[b] = half_at(x);
            r.dmin[b] = half_at(x + 2);
            break;
        }
        case 8:  /* MXFP4: the codes as they are, e as d */
            for (int j = 0; j < 16; j++) { q[j] = x[1 + j] & 15; q[j + 16] = x[1 + j] >> 4; }
            r.d[b] = x[0];
            break;
        default: {  /* Q6_K: element 128h + 32i + l: a nibble of ql, two bits of qh */
            const uint8_t *ql = x, *qh = x + 128;
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 4; i++)
                    for (int l = 0; l < 32; l++) {
                        uint8_t low = ql[64 * h + 32 * (i % 2) + l];
                        low = i < 2 ? low & 15 : low >> 4;
                        q[128 * h + 32 * i + l] = low | ((qh[32 * h + l] >> (2 * i)) & 3) << 4;
                    }
            memcpy(r.scales + (int64_t)b * 16, x + 192, 16);
            r.dsuper[b] = half_at(x + 208);
            break;
        }
        }
    }
}

/* Panel lane `lane`'s part of block b: its quants (the header's order) and scales. */
static void place_block(QLayout l, const DecodedRow *r, int b, int lane, uint8_t *block) {
    const uint8_t *q = r->q + (int64_t)b * QBLOCK;
    if (l.nibbles) {
        for (int reg = 0; reg < 4; reg++)
            for (int j = 0; j < 4; j++)
                block[64 * reg + 4 * lane + j] =
                    (q[8 * reg + j] & 15) | (q[8 * reg + 4 + j] & 15) << 4;
        if (l.six)
            for (int plane = 0; plane < 2; plane++)
                for (int j = 0; j < 4; j++) {
                    uint8_t bits = 0;
                    for (int t = 0; t < 4; t++)
                        bits |= ((q[4 * (4 * plane + t) + j] >> 4) & 3) << (2 * t);
                    block[256 + 64 * plane + 4 * lane + j] = bits;
                }
        if (l.five)
            for (int j = 0; j < 4; j++) {
                uint8_t bits = 0;
                for (int t = 0; t < 8; t++) bits |= ((q[4 * t + j] >> 4) & 1) << t;
                block[256 + 4 * lane + j] = bits;
            }
    } else {
        for (int reg = 0; reg < 8; reg++) memcpy(block + 64 * reg + 4 * lane, q + 4 * reg, 4);
    }
    uint8_t *scales = block + quant_bytes(l);
    if (l.e2m1) {  /* MXFP4: the e byte */
        scales[lane] = (uint8_t)r->d[b];
        return;
    }
    if (l.kquant) {
        if (!l.has_min) {  /* Q6_K (Q4_K and Q5_K's are in the header) */
            scales[lane] = r->scales[2 * b];
            scales[16 + lane] = r->scales[2 * b + 1];
        }
        return;
    }
    memcpy(scales + 2 * lane, &r->d[b], 2);
    if (l.has_min) memcpy(scales + 32 + 2 * lane, &r->c[b], 2);
}

/* Let the kernel drop this process's pages of a read-only file mapping over [from, to): the
 * whole pages from the one holding `from` (to the one holding `to`, that one too where `whole`).
 * They are the file's, read again from it if anyone looks (a page shared with bytes another
 * thread still reads is read again by it: the same bytes). */
static void drop_file_pages(const uint8_t *from, const uint8_t *to, int whole) {
#ifdef HAVE_MADVISE
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)from / page * page;
    uintptr_t end = whole ? ((uintptr_t)to + page - 1) / page * page : (uintptr_t)to / page * page;
    if (end > start) madvise((void *)start, end - start, MADV_DONTNEED);
#else
    (void)from; (void)to; (void)whole;
#endif
}

#define DROP_BYTES (1 << 20)  /* a thread drops what it has read each time it has read this */

/* raw: n rows of a `layout` tensor's GGUF blocks over k inputs, row stride raw_stride bytes;
 * packed: ceil(n / 32) groups of dresd_quant_group_bytes (zeroed by this: rows past n stay
 * zero). Groups are independent, spread over `threads`. drop_read: raw lies in a read-only
 * file mapping, and each thread drops the pages of the rows it has packed as it goes (every
 * DROP_BYTES), so a big tensor's mapped bytes are never resident beside its packed copy (~1 MB
 * a thread instead). Returns 0, -1 without memory, -2 for sizes it does not take (it writes
 * nothing then). */
int dresd_quant_pack(int layout, const uint8_t *raw, int64_t raw_stride, int n, int k,
                     uint8_t *packed, int threads, int drop_read) {
    if (layout < 0 || layout >= (int)(sizeof(LAYOUTS) / sizeof(LAYOUTS[0])) || n < 1
        || k < QBLOCK || k % gguf_block_k(layout)
        || raw_stride < (int64_t)k / gguf_block_k(layout) * GGUF_BLOCK_BYTES[layout])
        return -2;
    const QLayout l = LAYOUTS[layout];
    const int groups = (n + QPARTS * QLANES - 1) / (QPARTS * QLANES), blocks = k / QBLOCK;
    const int supers = blocks / SUPER;
    const int64_t group_stride = dresd_quant_group_bytes(layout, k);
    const int64_t row_bytes = (int64_t)k / gguf_block_k(layout) * GGUF_BLOCK_BYTES[layout];
    memset(packed, 0, (size_t)groups * group_stride);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && groups > 1)
    {
        DecodedRow r = {malloc(k), malloc(2 * (size_t)blocks), malloc(2 * (size_t)blocks),
                        malloc(2 * (size_t)supers + 2), malloc(2 * (size_t)supers + 2),
                        malloc(2 * (size_t)blocks), malloc(K_PLANES * (size_t)supers + 1)};
        int ready = r.q && r.d && r.c && r.dsuper && r.dmin && r.scales && r.k_bytes;
        const uint8_t *read_from = NULL, *read_to = NULL;  /* this thread's rows not dropped */
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) {
            if (!ready) {  /* every thread still takes its share of the loop */
#pragma omp atomic write
                failed = 1;
                continue;
            }
            uint8_t *group = packed + g * group_stride;
            for (int part = 0; part < QPARTS; part++)
                for (int lane = 0; lane < QLANES; lane++) {
                    int64_t row = (int64_t)g * QPARTS * QLANES + part * QLANES + lane;
                    if (row >= n) continue;  /* padding: zeros */
                    decode_row(layout, raw + row * raw_stride, k, r);
                    for (int b = 0; b < blocks; b++)
                        place_block(l, &r, b, lane, (uint8_t *)block_at(l, group, b, part));
                    for (int s = 0; s < supers && l.kquant; s++) {  /* K-quants' headers */
                        uint8_t *header = (uint8_t *)header_at(l, group, s, part);
                        memcpy(header + 2 * lane, &r.dsuper[s], 2);
                        if (l.has_min) {
                            memcpy(header + 32 + 2 * lane, &r.dmin[s], 2);
                            for (int i = 0; i < K_PLANES; i++)  /* plane i, lane `lane` */
                                header[64 + 16 * i + lane] = r.k_bytes[s * K_PLANES + i];
                        }
                    }
                }
            if (drop_read) {  /* this group's rows, read: dropped every DROP_BYTES */
                int64_t last = (int64_t)(g + 1) * QPARTS * QLANES;
                if (!read_from) read_from = raw + (int64_t)g * QPARTS * QLANES * raw_stride;
                read_to = raw + ((last < n ? last : n) - 1) * raw_stride + row_bytes;
                if (read_to - read_from >= DROP_BYTES) {
                    drop_file_pages(read_from, read_to, 0);
                    read_from = read_to;
                }
            }
        }
        if (read_from) drop_file_pages(read_from, read_to, 1);
        free(r.q); free(r.d); free(r.c); free(r.dsuper); free(r.dmin); free(r.scales);
        free(r.k_bytes);
    }
    return failed ? -1 : 0;
}
